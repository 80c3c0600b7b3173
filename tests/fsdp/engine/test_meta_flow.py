"""FSDP2's meta-device flow and the user's own gradient division, at world 2.

- Meta flow: build on the meta device, wrap, ``model.to_empty(device=...)``,
  then the model's own init method: the sharded parameters hold exactly what
  that init gives one process from the same seed (every strategy, and with a
  bf16 compute copy), the first forward equals one process's, and a forward
  before ``to_empty`` is refused.
- Gradient division (torchtitan's loop): each rank sums its token losses and
  divides by the global token count; with ``set_gradient_divide_factor(1.0)``
  (FSDP2's switch) the gradients and the training equal one process on the
  whole batch, with SGD and Adam, though the ranks hold different numbers of
  tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mf_fsdp
from mf.models import GPT
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import CONFIG, batch, full_params, make_optimizer, unit_classes

SEED = 11


def _meta_wrapped(strategy: int, **options: object) -> mf_fsdp.MegatronFSDP:
    with torch.device("meta"):
        module = GPT(CONFIG)
    return mf_fsdp.fully_shard_model(
        module, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy, **options
    )


def _rank_meta_flow(rank: int, world: int) -> None:
    reference = GPT(CONFIG)
    torch.manual_seed(SEED)
    reference.reset_parameters()  # the model's own init method, on one process
    tokens, targets = batch(0, 0)
    expected = reference(tokens, targets)
    bf16 = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy, options in [
        (0, {}),
        (1, {}),
        (2, {}),
        (3, {}),
        (3, {"mixed_precision_policy": bf16}),
    ]:
        model = _meta_wrapped(strategy, **options)
        with pytest.raises(
            RuntimeError, match=r"(?s)materialized from meta.*was wrapped on the meta device"
        ):
            model(tokens, targets)
        assert model.to_empty(device="cpu") is model
        assert not any(b.is_meta for b in model.buffers())
        torch.manual_seed(SEED)
        model.reset_parameters()  # reaches GPT.reset_parameters through the wrapper
        for name, value in full_params(model).items():
            torch.testing.assert_close(
                value, reference.get_parameter(name), rtol=0, atol=0, msg=f"z{strategy} {name}"
            )
        got = model(tokens, targets)
        if options:
            torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=0)
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"to_empty: device='meta', but the engine's buffers"):
        _meta_wrapped(3).to_empty(device="meta")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_meta_model_wrapped_then_to_empty_then_its_own_init_equals_one_process() -> None:
    run_on_ranks(_rank_meta_flow, 2, timeout=180)


IGNORE = -100


def _summed_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens whose targets are masked differently per rank (rank r masks r + 3 positions)."""
    tokens, targets = batch(step, rank)
    targets = targets.clone()
    targets.view(-1)[: rank + 3] = IGNORE
    return tokens, targets


def _token_loss_sum(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(tokens)
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def _rank_divide(rank: int, world: int, opt_name: str) -> None:
    steps = 4
    reference = GPT(CONFIG)
    ref_opt = make_optimizer(opt_name, reference.parameters())
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.load_state_dict(reference.state_dict())
    opt = make_optimizer(opt_name, model.parameters())
    model, opt = mf_fsdp.fully_shard(model, opt, fsdp_unit_modules=unit_classes())
    model.set_gradient_divide_factor(1.0)
    for step in range(steps):
        batches = [_summed_batch(step, r) for r in range(world)]
        global_tokens = sum(int((t != IGNORE).sum()) for _, t in batches)
        # One process: the mean over every valid token of the global batch (a backward
        # per rank's part, as the ranks sum their gradients).
        for part in batches:
            (_token_loss_sum(reference, *part) / global_tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # Each rank: its token sum over the global count (all-reduced), mf summing grads.
        count = torch.tensor(float((batches[rank][1] != IGNORE).sum()))
        dist.all_reduce(count)
        loss = _token_loss_sum(model, *batches[rank]) / count
        loss.backward()
        opt.step()
        opt.zero_grad()
    for name, value in full_params(model).items():
        torch.testing.assert_close(
            value,
            reference.get_parameter(name),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{opt_name} {n}: {m}",
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_summed_loss_with_divide_factor_one_equals_one_process(opt_name: str) -> None:
    run_on_ranks(_rank_divide, 2, opt_name, timeout=120)


def _rank_divide_options(rank: int, world: int) -> None:
    model = mf_fsdp.fully_shard_model(GPT(CONFIG), fsdp_unit_modules=unit_classes())
    for bad, error in [(0, ValueError), (float("inf"), ValueError), ("2", TypeError)]:
        with pytest.raises(error, match="factor: expected a"):
            model.set_gradient_divide_factor(bad)
    per_token = mf_fsdp.fully_shard_model(
        GPT(CONFIG), fsdp_unit_modules=unit_classes(), calculate_per_token_loss=True
    )
    with pytest.warns(UserWarning, match=r"calculate_per_token_loss and average_in_collective no"):
        per_token.set_gradient_divide_factor(1.0)


@pytest.mark.multiprocess
def test_divide_factor_checks_its_value_and_says_what_it_overrides() -> None:
    run_on_ranks(_rank_divide_options, 2)

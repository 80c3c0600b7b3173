"""FSDP2's ``ignored_params`` through ``mf_fsdp.fsdp2``: parameters the engine leaves alone.

The tiny GPT is sharded torchtitan's way, with the position embedding and the
first block's attention projection ignored (one at the root, one inside a unit).
At world 2:

- the ignored parameters stay plain tensors, the others are sharded DTensors;
- their gradients are each rank's own (different data, different gradients:
  nothing reduced them); averaged by hand, as a DDP user would, the run equals one
  process on the global batch for SGD and Adam (Adam's state for the ignored
  parameters survives every step);
- DSD's state dicts hold them as plain tensors and load back into a fresh model;
- bad entries are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    make_optimizer,
    reference_run,
)
from tests.fsdp.frontends.test_fsdp2_frontend import shard_like_torchtitan

WORLD = 2
STEPS = 4
IGNORED = ("wpe.weight", "blocks.0.attn.proj.weight")


def _sharded(ignore: tuple[str, ...] = IGNORED) -> tuple[torch.nn.Module, set]:
    model = make_model()
    params = dict(model.named_parameters())
    ignored = {params[name] for name in ignore}
    shard_like_torchtitan(model, ignored_params=ignored)
    return model, ignored


def _step(model, opt, ignored: set, step: int, rank: int) -> float:
    loss = model(*batch(step, rank))
    loss.backward()
    for param in ignored:  # nothing reduced them: each rank holds its own batch's
        mine = param.grad.clone()
        theirs = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(theirs, mine)
        assert not torch.equal(theirs[0], theirs[1])
        dist.all_reduce(param.grad)
        param.grad /= WORLD
    total = loss.detach().clone()
    dist.all_reduce(total)
    opt.step()
    opt.zero_grad()
    return total.item() / WORLD


def _rank_parity(rank: int, world: int) -> None:
    for opt_name in ("sgd", "adam"):
        ref_losses, ref_params = reference_run(opt_name, world, STEPS)
        model, ignored = _sharded()
        opt = make_optimizer(opt_name, model.parameters())
        losses = [_step(model, opt, ignored, step, rank) for step in range(STEPS)]
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) is (name not in IGNORED), name
        assert all(p in opt.state for p in ignored) is (opt_name == "adam")
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"{opt_name} ignored", 1e-5, 1e-6
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_ignored_params_stay_local_and_the_rest_trains_as_one_process() -> None:
    run_on_ranks(_rank_parity, WORLD, timeout=150)


def _copy(value):
    """A copy later steps leave alone (a state dict's tensors are the live ones)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _rank_state_dict(rank: int, world: int) -> None:
    model, ignored = _sharded()
    opt = make_optimizer("adam", model.parameters())
    for step in range(2):
        _step(model, opt, ignored, step, rank)
    model_sd, opt_sd = tree_map(_copy, get_state_dict(model, opt))
    for name in IGNORED:
        assert type(model_sd[name]) is torch.Tensor, name
        assert type(opt_sd["state"][name]["exp_avg"]) is torch.Tensor, name
    expected = [_step(model, opt, ignored, step, rank) for step in (2, 3)]
    resumed, resumed_ignored = _sharded()
    resumed_opt = make_optimizer("adam", resumed.parameters())
    set_state_dict(resumed, resumed_opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
    got = [_step(resumed, resumed_opt, resumed_ignored, step, rank) for step in (2, 3)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dsd_state_dicts_hold_ignored_params_as_plain_tensors_and_resume() -> None:
    run_on_ranks(_rank_state_dict, WORLD, timeout=150)


def _rank_refusals(rank: int, world: int) -> None:
    model = make_model()
    with pytest.raises(TypeError, match="ignored_params must be a set of parameters"):
        fsdp2.fully_shard(model, ignored_params=model.wte.weight)
    with pytest.raises(TypeError, match="ignored_params holds 'wte'"):
        fsdp2.fully_shard(model, ignored_params={"wte"})
    stranger = torch.nn.Parameter(torch.zeros(3, 5))
    fsdp2.fully_shard(model, ignored_params={stranger})
    with pytest.raises(ValueError, match=r"ignored_params: \(3, 5\) is not a parameter of FSDPGPT"):
        model(*batch(0, rank))  # the engine is built, and the entries checked, at first use
    model = make_model()  # nothing left to shard: it runs as the plain module, as FSDP2's
    plain = make_model()
    fsdp2.fully_shard(model, ignored_params=set(model.parameters()))
    torch.testing.assert_close(model(*batch(0, rank)), plain(*batch(0, rank)), rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bad_ignored_params_are_refused_by_name() -> None:
    run_on_ranks(_rank_refusals, WORLD, timeout=90)

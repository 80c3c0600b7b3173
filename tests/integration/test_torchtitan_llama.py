"""torchtitan's Llama 3 "debugmodel" under mf-fsdp at world 2, as a torchtitan user runs it.

torchtitan 0.3.0 (a test-only dev dependency) builds the model from its own
config, with one change for the CPU: the inner attention is torchtitan's SDPA
module (its flex attention has no backward on the CPU). The model is built on
the meta device, wrapped with each block a unit, then ``to_empty`` and
torchtitan's ``init_weights``: FSDP2's flow. It has what makes it hard: a fused
``wqkv`` saved as ``wq``/``wk``/``wv`` by state-dict hooks, a RoPE cache buffer,
per-parameter inits drawing replicated tensors and ``trunc_normal_``'s rejection
loop. Each test compares with one process running the same code.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import mf_fsdp
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._helpers import optimizer_step

try:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

# The CPU runs DTensor's own random ops (torchtitan's fused-QKV init draws replicated
# DTensors) with a warning that they may not be complete there; the values are checked.
pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete")
# The ranks import this module (their functions are its), and so torchtitan: seconds of
# CPU per rank, which the forkserver pays once instead (torchtitan imported: no skip here).
preload_in_ranks(__name__)

VOCAB, SEQ, BATCH = 2048, 32, 2
RTOL, ATOL = 1e-5, 1e-6


def _config():
    """The debugmodel (dim 256, 6 layers, vocab 2048, fused QKV) with SDPA attention."""
    config = model_registry("debugmodel").model

    def on_cpu(layer):
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=64)
        attention = dataclasses.replace(
            layer.attention, inner_attention=ScaledDotProductAttention.Config(), rope=rope
        )
        return dataclasses.replace(layer, attention=attention)

    return dataclasses.replace(config, layers=[on_cpu(layer) for layer in config.layers])


def _initialised(model, seed: int = 0):
    """torchtitan's init after ``to_empty`` (the trainer's order)."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _plain(seed: int = 0):
    with torch.device("meta"):
        module = _config().build()
    return _initialised(module, seed)


def _wrapped(seed: int = 0, divide_factor: float | None = None):
    with torch.device("meta"):
        module = _config().build()
    unit = type(module.layers["0"])
    model = mf_fsdp.fully_shard_model(module, fsdp_unit_modules=[unit])
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
    return _initialised(model, seed)


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    """This rank's batches; the loss averaged over ranks, per step."""
    return [optimizer_step(_loss(model, *_batch(step, rank)), opt, world) for step in steps]


def _reference(world: int, steps: range):
    """One process on the global batch (each rank's part, averaged)."""
    model = _plain()
    opt = _adamw(model)
    losses = []
    for step in steps:
        total = 0.0
        for rank in range(world):
            loss = _loss(model, *_batch(step, rank)) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _assert_params(got: dict, want, label: str, rtol: float, atol: float) -> None:
    for name, value in got.items():
        torch.testing.assert_close(
            value,
            want.get_parameter(name),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{label} {n}: {m}",
        )


def _rank_resume(rank: int, world: int, root: str) -> None:
    # FSDP2's meta flow: exactly one process's init.
    model = _wrapped()
    _assert_params(_full_params(model), _plain(), "meta init", 0, 0)
    opt = _adamw(model)
    reference, ref_losses = _reference(world, range(7))
    losses = _train(model, opt, rank, world, range(5))
    torch.testing.assert_close(losses, ref_losses[:5], rtol=RTOL, atol=ATOL)
    path = mf_fsdp.save_checkpoint(Path(root), model, opt, step=5)
    # torchtitan's own resume form: the model's state dict (its keys: wq/wk/wv) and
    # DSD's optimizer state (by parameter name), full; copies, as DSD's are live.
    options = StateDictOptions(full_state_dict=True)
    saved_model = {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in model.state_dict().items()
    }
    assert "layers.0.attention.qkv_linear.wq.weight" in saved_model
    saved_optim = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    expected = _train(model, opt, rank, world, range(5, 7))
    torch.testing.assert_close(expected, ref_losses[5:], rtol=RTOL, atol=ATOL)
    _assert_params(_full_params(model), reference, "7 steps", RTOL, ATOL)

    resumed = _wrapped(seed=1)
    resumed_opt = _adamw(resumed)
    assert mf_fsdp.load_checkpoint(path, resumed, resumed_opt)["step"] == 5
    assert _train(resumed, resumed_opt, rank, world, range(5, 7)) == expected, "load_checkpoint"

    through_dsd = _wrapped(seed=2)
    dsd_opt = _adamw(through_dsd)
    through_dsd.load_state_dict(saved_model)
    set_optimizer_state_dict(through_dsd, dsd_opt, saved_optim, options=options)
    assert _train(through_dsd, dsd_opt, rank, world, range(5, 7)) == expected, "DSD"
    # DSD's model state dict walks every key through module attributes: the fused
    # layer's ``wq`` is none, so torch refuses it for the plain model as for this one.
    for subject in (_plain(), model):
        with pytest.raises(AttributeError, match="object has no attribute 'wq'"):
            get_model_state_dict(subject)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_meta_init_trains_like_one_process_and_resumes_exactly(tmp_path) -> None:
    """Meta flow, 5 AdamW steps, save, 2 more; resumed by load_checkpoint and via DSD."""
    run_on_ranks(_rank_resume, 2, str(tmp_path), timeout=280)


def _rank_fullgraph(rank: int, world: int) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = _wrapped()
    eager_losses = _train(eager, _adamw(eager), rank, world, range(3))
    with torch.device("meta"):
        module = _config().build()
    counter = CompileCounterWithBackend("inductor")
    for block in module.layers.values():  # torchtitan's recipe: before wrapping
        block.compile(backend=counter, fullgraph=True)
    model = mf_fsdp.fully_shard_model(module, fsdp_unit_modules=[type(module.layers["0"])])
    _initialised(model)
    opt = _adamw(model)
    losses, frames = [], []
    for step in range(3):
        losses += _train(model, opt, rank, world, range(step, step + 1))
        frames.append(counter.frame_count)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    assert frames[0] > 0, "nothing was compiled"
    assert frames[-1] == frames[0], f"recompiled after step 1: {frames}"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_blocks_compiled_with_fullgraph_train_like_eager() -> None:
    run_on_ranks(_rank_fullgraph, 2, timeout=380)


IGNORE = -100


def _rank_summed(rank: int, world: int) -> None:
    """torchtitan's loss: token sums over the global token count, FSDP division off."""

    def masked(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = _batch(step, r)
        targets = targets.clone()
        targets.view(-1)[: 5 * (r + 1)] = IGNORE  # ranks hold different token counts
        return tokens, targets

    def token_sum(model, tokens, targets) -> torch.Tensor:
        logits = model(tokens).flatten(0, 1).float()
        return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum")

    model = _wrapped(divide_factor=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = _plain()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        parts = [masked(step, r) for r in range(world)]
        tokens = sum(int((t != IGNORE).sum()) for _, t in parts)
        for part in parts:
            (token_sum(reference, *part) / tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (token_sum(model, *parts[rank]) / tokens).backward()
        opt.step()
        opt.zero_grad()
    _assert_params(_full_params(model), reference, "summed loss", RTOL, ATOL)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_summed_token_loss_with_division_off_equals_one_process() -> None:
    run_on_ranks(_rank_summed, 2, timeout=180)

"""Which of torch's optimizer kernels mf steps with when the user left the choice to torch.

On CUDA, SGD, Adam and AdamW step with torch's fused kernels (``prefer_fast_kernels``),
and so does the host-side state of an engine on an accelerator
(``offload_optimizer_state``), with torch's fused CPU kernels; elsewhere every
elementwise optimizer takes the multi-tensor path. Both fused paths are proven here
on the CPU, whose fused kernels torch also has: the rank functions add ``"cpu"`` to
``FUSED_DEVICES``, or take it out of ``HOST_DEVICES`` (so that this CPU engine counts
as an accelerator's). The GPU itself runs ``tests/fsdp/engine/test_devices.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

import mf_fsdp
from mf_fsdp.optim import kernel_choice
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    optimizer_step,
    reference_run,
    unit_classes,
)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4


def _optimizer(name: str, params, **choice) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, **choice)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, **choice)
    return torch.optim.Adam(params, lr=1e-2, **choice)


def _fused(name: str, params) -> torch.optim.Optimizer:
    return _optimizer(name, params, fused=True)


def _wrapped(name: str, strategy: int = 3, options: dict | None = None, **choice):
    module = make_model()
    opt = _optimizer(name, module.parameters(), **choice)
    return mf_fsdp.fully_shard(
        module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy, **(options or {})
    )


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    return [optimizer_step(model(*batch(step, rank)), opt, world) for step in steps]


def _assert_trains_like_torch_fused(name: str, rank: int, world: int, runs: dict) -> None:
    """Every run (label: ``_wrapped`` keywords) steps fused, with torch's ``fused=True`` result."""
    ref_losses, ref_params = reference_run(name, world, STEPS, optimizer=_fused)
    for label, wrapping in runs.items():
        model, opt = _wrapped(name, **wrapping)
        assert all(group["fused"] is True for group in opt.param_groups), label
        losses = _train(model, opt, rank, world, range(STEPS))
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"{name} {label}", RTOL, ATOL
        )


def _rank_fused_parity(rank: int, world: int) -> None:
    kernel_choice.FUSED_DEVICES = frozenset({"cpu", "cuda"})
    runs = {f"ZeRO-{strategy} fused": {"strategy": strategy} for strategy in (1, 3)}
    for name in ("sgd", "adam", "adamw"):
        _assert_trains_like_torch_fused(name, rank, world, runs)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_choice_left_to_torch_steps_fused_and_equals_torch_fused() -> None:
    """SGD (momentum), Adam, AdamW on fused devices: torch's ``fused=True`` result."""
    run_on_ranks(_rank_fused_parity, 2, timeout=150)


def _rank_choices(rank: int, world: int) -> None:
    kernel_choice.FUSED_DEVICES = frozenset({"cpu", "cuda"})
    # A user's choice is kept, whichever it is.
    for choice, expected in (
        ({"foreach": True}, (None, True)),
        ({"foreach": False}, (None, False)),
        ({"fused": False}, (False, True)),
        ({"fused": True}, (True, None)),
    ):
        _, opt = _wrapped("sgd", **choice)
        group = opt.param_groups[0]
        expected_fused, expected_foreach = expected
        assert (group["fused"], group["foreach"]) == (expected_fused, expected_foreach), choice
    # Without fused kernels in torch (Adamax) or off the fused devices: multi-tensor.
    module = make_model()
    opt = torch.optim.Adamax(module.parameters(), lr=1e-2)
    _, opt = mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=unit_classes())
    assert opt.param_groups[0]["foreach"] is True
    kernel_choice.FUSED_DEVICES = frozenset({"cuda"})
    _, opt = _wrapped("adam")
    assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (None, True)
    # A state dict saved with the choice left to torch (plain PyTorch's) loads into
    # the fused path again, and the run goes on as torch's fused optimizer would.
    kernel_choice.FUSED_DEVICES = frozenset({"cpu", "cuda"})
    model, opt = _wrapped("adam")
    _train(model, opt, rank, world, range(2))
    saved_model = _copy(model.state_dict())
    saved = _copy(opt.state_dict())
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = None, None
    expected = _train(model, opt, rank, world, range(2, 4))
    resumed, resumed_opt = _wrapped("adam")
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved)
    assert all(group["fused"] is True for group in resumed_opt.param_groups)
    assert _train(resumed, resumed_opt, rank, world, range(2, 4)) == expected


def _copy(state: dict) -> dict:
    """A copy of ``state`` that later steps, which update tensors in place, leave alone."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_users_choice_is_kept_and_a_loaded_choice_left_to_torch_steps_fused() -> None:
    run_on_ranks(_rank_choices, 2, timeout=150)


def _rank_host_state(rank: int, world: int) -> None:
    offload = {"offload_optimizer_state": True}
    # A CPU engine's host-side state is its device's: plain PyTorch's kernels and result.
    _, opt = _wrapped("adamw", options=offload)
    assert all(group["foreach"] is True and not group["fused"] for group in opt.param_groups)
    # An accelerator's: torch's fused CPU kernels, with and without the in-backward step.
    kernel_choice.HOST_DEVICES = frozenset()
    runs = {
        f"offloaded, in backward {on}": {"options": {**offload, "optimizer_step_in_backward": on}}
        for on in (False, True)
    }
    for name in ("sgd", "adamw"):
        _assert_trains_like_torch_fused(name, rank, world, runs)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_host_side_state_of_an_accelerator_steps_fused_on_the_cpu() -> None:
    """``offload_optimizer_state``: torch's fused CPU result where the engine is not the host."""
    run_on_ranks(_rank_host_state, 2, timeout=150)

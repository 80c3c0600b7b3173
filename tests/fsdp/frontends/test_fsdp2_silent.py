"""The three cases where ``mf_fsdp.fsdp2`` once trained silently wrong (issue 57, part 1).

Each test runs torch's FSDP2 and ``mf_fsdp.fsdp2`` on the same script in the same
gloo ranks and compares, over several steps with SGD and with AdamW, the losses,
every parameter's gradient after ``backward()`` (before the step: what code that
reads, logs or clips gradients sees) and the weights after the step:

- an explicit backward prefetch list naming a unit whose backward is already done
  (torch's ``test_backward_misprefetch``): the unit gathered again must not outlive
  the step, or the next forward computes with the weights from before it;
- HSDP over a 2x2 (replicate, shard) mesh (``test_train_parity_hsdp``): ``.grad`` is
  averaged over both dims when ``backward()`` returns, so ``clip_grad_norm_`` between
  backward and step sees FSDP2's norm;
- weights frozen with ``requires_grad_(False)`` after ``fully_shard`` and after the
  optimizer was built (``test_train_mixed_requires_grad_per_group``): no gradient,
  never moved.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp import fsdp2
from tests._multiprocess import cpu_mesh, run_on_ranks

ENGINES = (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard))
OPTIMIZERS = ("sgd", "adamw")
DIM = 8
STEPS = 3

Shard = Callable[..., object]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM)) for _ in range(3))
    )


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor.detach().clone()


def _leaves_shapes(loss: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of the leaves ``loss``'s backward accumulates into (frozen ones it skips)."""
    shapes, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            shapes.append(tuple(variable.shape))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return sorted(shapes)


def _snapshot(model: nn.Module, what: str) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole value (``what`` "weight") or gradient (``what`` "grad")."""
    return {
        name: _full(param.grad if what == "grad" else param.detach())
        for name, param in model.named_parameters()
    }


def _assert_same(
    label: str, mf: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None]
) -> None:
    assert mf.keys() == ref.keys(), label
    for name, expected in ref.items():
        got = mf[name]
        if expected is None or got is None:
            assert got is expected, f"{label} {name}: mf {got}, torch {expected}"
            continue
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{label} {name}")


def _train(
    rank: int,
    prepare: Callable[[nn.Sequential, Shard], None],
    after_optimizer: Callable[[nn.Module], None] = lambda model: None,
    between: Callable[[nn.Module], torch.Tensor] | None = None,
) -> None:
    """Train torch's FSDP2 and mf's on the same batches; compare after each backward and step.

    ``prepare`` shards a fresh model with the given ``fully_shard``;
    ``after_optimizer`` edits it once its optimizer is built; ``between`` runs
    after each backward (before the step) and returns a value to compare.
    """
    for optim_name in OPTIMIZERS:
        runs: dict[str, list[dict[str, object]]] = {}
        for engine, shard in ENGINES:
            model = _model()
            prepare(model, shard)
            optim = _optimizer(optim_name, model)
            after_optimizer(model)
            records: list[dict[str, object]] = []
            torch.manual_seed(100 + rank)
            for _ in range(STEPS):
                optim.zero_grad()
                loss = model(torch.randn(4, DIM)).sum()
                leaves = _leaves_shapes(loss)
                loss.backward()
                record: dict[str, object] = {
                    "loss": loss.detach(),
                    "grads": _snapshot(model, "grad"),
                    "leaves": leaves,
                }
                if between is not None:
                    record["between"] = between(model)
                optim.step()
                record["weights"] = _snapshot(model, "weight")
                records.append(record)
            runs[engine] = records
        for step, (mf, ref) in enumerate(zip(runs["mf"], runs["torch"], strict=True)):
            label = f"{optim_name} step {step}"
            torch.testing.assert_close(mf["loss"], ref["loss"], msg=f"{label} loss")
            assert mf["leaves"] == ref["leaves"], f"{label}: autograd reaches {mf['leaves']}"
            _assert_same(f"{label} grad", mf["grads"], ref["grads"])  # type: ignore[arg-type]
            _assert_same(f"{label} weight", mf["weights"], ref["weights"])  # type: ignore[arg-type]
            if "between" in ref:
                torch.testing.assert_close(mf["between"], ref["between"], msg=f"{label} between")


def _shard_blocks(model: nn.Sequential, shard: Shard, **kwargs: object) -> None:
    for block in model:
        shard(block, **kwargs)
    shard(model, **kwargs)


def _rank_backward_misprefetch(rank: int, world: int) -> None:
    def prepare(model: nn.Sequential, shard: Shard) -> None:
        _shard_blocks(model, shard)
        # The backward runs blocks 2, 1, 0: block 0 prefetching block 2 gathers a unit
        # whose backward is done.
        model[0].set_modules_to_backward_prefetch([model[2]])

    _train(rank, prepare)


@pytest.mark.multiprocess
def test_backward_misprefetch_trains_as_fsdp2() -> None:
    """A unit a backward prefetch list gathers after its backward is released before the step."""
    run_on_ranks(_rank_backward_misprefetch, 2)


def _rank_hsdp(rank: int, world: int) -> None:
    mesh = cpu_mesh((2, 2), ("replicate", "shard"))

    def prepare(model: nn.Sequential, shard: Shard) -> None:
        _shard_blocks(model, shard, mesh=mesh)

    def clip(model: nn.Module) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        return _full(norm)  # type: ignore[return-value]

    _train(rank, prepare, between=clip)
    # The clipped grads were compared through the weights; the raw ones before clipping
    # are compared by a second run without it.
    _train(rank, prepare)
    dist.barrier()


@pytest.mark.multiprocess
def test_hsdp_grads_are_reduced_when_backward_returns() -> None:
    """HSDP: ``.grad`` and ``clip_grad_norm_`` between backward and step equal FSDP2's."""
    run_on_ranks(_rank_hsdp, 4)


def _rank_frozen_after_wrap(rank: int, world: int) -> None:
    def freeze(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)

    _train(rank, _shard_blocks, after_optimizer=freeze)


@pytest.mark.multiprocess
def test_frozen_after_fully_shard_gets_no_grad() -> None:
    """Weights frozen after ``fully_shard`` and the optimizer get no grad and stay, as FSDP2's."""
    run_on_ranks(_rank_frozen_after_wrap, 2)

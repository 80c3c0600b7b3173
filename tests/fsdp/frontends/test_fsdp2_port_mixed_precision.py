"""More of torch's FSDP2 mixed-precision tests (``test_fully_shard_mixed_precision.py``).

Each scenario is a function of the ``fully_shard`` it is given and runs once
per engine in the same two gloo ranks (``on_both``), with torch's assertions
(the dtypes each module sees, computes in and reduces in). torch runs these on
GPUs; on the CPU, batch norm with fp32 running stats refuses a low-precision
input in both engines (torch's test expects that only of 2-D batch norm on
CUDA), so those subtests assert the refusal and the two ways round it run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import patch_reduce_scatter
from torch.testing._internal.common_utils import TestCase
from torch.utils.checkpoint import checkpoint

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, torch_case
from tests.fsdp._fsdp2_port_common import NEWER_FSDP2, on_both
from tests.fsdp._issued import REDUCTIONS, spy_collectives

preload_in_ranks(*RANK_MODULES)


def _submodules_with_external_inputs(fully_shard, case: TestCase, cast: bool) -> None:
    """A child's input made inside the parent is cast only if the child's policy casts."""
    seen: dict[str, torch.Tensor] = {}

    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(100, 100)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            seen["child_x"], seen["child_y"] = x, y
            return self.lin(x)

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(100, 100)
            self.l2 = Child()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["model_x"] = x
            return self.l2(self.l1(x), torch.ones(2, 100))

    model = Parent()
    half = torch.float16
    fully_shard(
        model.l2, mp_policy=MixedPrecisionPolicy(param_dtype=half, cast_forward_inputs=cast)
    )
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=half))
    model(torch.zeros(2, 100)).sum().backward()
    case.assertEqual(seen["model_x"].dtype, half)
    case.assertEqual(seen["child_x"].dtype, half)
    case.assertEqual(seen["child_y"].dtype, half if cast else torch.float32)


class _RecordingLinear(nn.Linear):
    """A 1-to-1 linear that notes the dtype of every input it gets."""

    def __init__(self) -> None:
        super().__init__(1, 1)
        self.input_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtypes.append(x.dtype)
        return super().forward(x)


class _CheckpointedLinear(nn.Module):
    """The linear under non-reentrant activation checkpointing; its output dtypes noted."""

    def __init__(self, input_dtype: torch.dtype) -> None:
        super().__init__()
        self.linear1 = _RecordingLinear()
        self.input_dtype = input_dtype
        self.output_dtypes: list[torch.dtype] = []

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear1(x)
        self.output_dtypes.append(out.dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self._run, x.to(self.input_dtype), use_reentrant=False, early_stop=False)
        return x.float().sum()


def _checkpoint_recompute_casts(fully_shard, case: TestCase, cast: str) -> None:
    """The recomputation casts as the forward did: the input (``"input"``) or the output."""
    bf16 = torch.bfloat16
    if cast == "input":
        input_dtype = torch.float32
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    else:
        input_dtype = bf16
        policy = MixedPrecisionPolicy(
            param_dtype=bf16,
            reduce_dtype=bf16,
            output_dtype=torch.float32,
            cast_forward_inputs=False,
        )
    torch.manual_seed(42)
    model = _CheckpointedLinear(input_dtype)
    fully_shard(model.linear1, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model(torch.randn(8, 1)).backward()
    if cast == "input":
        case.assertEqual(model.linear1.input_dtypes, [bf16, bf16])
    else:
        case.assertEqual(model.output_dtypes, [torch.float32, torch.float32])


def _norm_model(fully_shard, norm: nn.Module, dtype: torch.dtype, norm_policy=None) -> nn.Module:
    """``[linear or conv, norm, linear or conv]``, each a unit, then the root."""
    if isinstance(norm, nn.BatchNorm2d):
        model = nn.Sequential(nn.Conv2d(1, 5, 3), norm, nn.Conv2d(5, 4, 3))
    else:
        model = nn.Sequential(nn.Linear(32, 32), norm, nn.Linear(32, 32))
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    fully_shard(model[1], mp_policy=norm_policy or policy)
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=policy)
    return model


def _norm_modules(fully_shard, case: TestCase, dtype: torch.dtype) -> None:
    """Layer and batch norm units under a low ``param_dtype``: forward and backward run."""

    def run(model: nn.Module, x: torch.Tensor) -> None:
        out = model(x)
        case.assertEqual(out.dtype, dtype)
        out.sum().backward()

    image = torch.randn((3, 1, 9, 9))
    run(_norm_model(fully_shard, nn.LayerNorm(32), dtype), torch.randn((4, 32)))
    # fp32 running stats against a low-precision input: the CPU kernels refuse it.
    for norm, inp in ((nn.BatchNorm1d(32), torch.randn((4, 32))), (nn.BatchNorm2d(5), image)):
        with case.assertRaisesRegex(RuntimeError, "expected scalar type"):
            run(_norm_model(fully_shard, norm, dtype), inp)
    model = _norm_model(fully_shard, nn.BatchNorm2d(5), dtype)
    model[1].running_mean = model[1].running_mean.to(dtype)
    model[1].running_var = model[1].running_var.to(dtype)
    run(model, image)
    norm_policy = MixedPrecisionPolicy(output_dtype=dtype)
    run(_norm_model(fully_shard, nn.BatchNorm2d(5), dtype, norm_policy), image)


@contextlib.contextmanager
def _reduction_dtypes(fully_shard) -> Iterator[list[torch.dtype]]:
    """The dtype of every gradient reduction the engine issues inside the block.

    torch's FSDP2 reduces through ``dist.reduce_scatter_single`` (torch 2.11:
    ``reduce_scatter_tensor``; torch's own ``patch_reduce_scatter``); mf packs small
    reductions into all-reduces on gloo, so its collectives are read from
    ``spy_collectives``.
    """
    dtypes: list[torch.dtype] = []
    if fully_shard is torch_fully_shard:
        # the collective torch's patch_reduce_scatter replaces (torch 2.11: reduce_scatter_tensor)
        original = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

        def spy(output: torch.Tensor, *args, **kwargs):
            dtypes.append(output.dtype)
            return original(output, *args, **kwargs)

        with patch_reduce_scatter(spy):
            yield dtypes
        return
    with spy_collectives() as issued:
        yield dtypes
    dtypes.extend(call.dtype for call in issued if call.kind in REDUCTIONS)


def _clamp_reduce_dtype(fully_shard, case: TestCase) -> None:
    """A bf16 ``reduce_dtype`` on a model built in bf16 stays bf16 after ``.to(float32)``."""
    bf16 = torch.bfloat16
    model = nn.Sequential(nn.Linear(32, 32, dtype=bf16), nn.Linear(32, 32, dtype=bf16))
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    case.assertEqual(policy.reduce_dtype, bf16)
    for module in (model[0], model[1], model):
        fully_shard(module, mp_policy=policy)
    model.to(torch.float32)
    with _reduction_dtypes(fully_shard) as dtypes:
        model(torch.randn((4, 32))).sum().backward()
    case.assertGreater(len(dtypes), 0)
    case.assertEqual(set(dtypes), {bf16})


def _rank_scenarios(rank: int, world: int) -> None:
    case = torch_case()
    for cast in (False, True):
        on_both(case, _submodules_with_external_inputs, case, cast)
    for recompute_cast in ("input", "output"):
        on_both(case, _checkpoint_recompute_casts, case, recompute_cast, torch_runs=NEWER_FSDP2)
    for dtype in (torch.bfloat16, torch.float16):
        on_both(case, _norm_modules, case, dtype)
    on_both(case, _clamp_reduce_dtype, case)


@pytest.mark.multiprocess
def test_mixed_precision_scenarios_match_torch() -> None:
    """torch's mixed-precision tests listed in docs/fsdp2.md (more), on both engines."""
    run_on_ranks(_rank_scenarios, WORLD)

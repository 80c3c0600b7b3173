"""The harness under ``test_fsdp2_conformance``: torch's FSDP2 test scenarios, on gloo ranks.

torch's own tests (``test/distributed/_composable/fsdp/`` in its sources, not in
its wheel) run in ``FSDPTest`` processes with NCCL or a threaded fake group and
compare against ``replicate`` (DDP) and ``check_sharded_parity``. Here a scenario
runs in ``tests._multiprocess`` ranks on gloo, and the pieces torch's harness
assumes of its own engine are replaced by what they mean for mf:

- ``check_sharded_parity``: torch cuts the reference with ``distribute_tensor``
  (``torch.chunk`` rows); mf's pieces are row-aligned pieces of flat buckets,
  so the reference is cut in the sharded parameter's own layout
  (``uneven_local_piece``). The checks are torch's: names equal, parameters
  are DTensors, local pieces equal, a gradient exists exactly where the
  reference has one and its piece equals the reference's.
- reduce-dtype spies: torch's ``patch_reduce_scatter`` replaces
  ``dist.reduce_scatter_single`` (FSDP2's collective), which mf never calls; on
  gloo mf packs small reduce-scatters into all-reduces. The tests spy on every
  collective mf hands to torch.distributed instead (``tests/fsdp/_issued.py``).
- ``assertEqual``: torch's ``TestCase.assertEqual`` itself (its dtype-based
  tolerances), through one ``TestCase`` instance per rank.

Nothing here asserts on its own: the assertions stay in the test bodies.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import TestCase

from mf_dtensor import UnevenDTensor, uneven_local_piece

__all__ = [
    "RANK_MODULES",
    "WORLD",
    "broadcast_params",
    "check_sharded_parity",
    "replicated_reference",
    "torch_case",
]

WORLD = 2
"""The ranks every mirrored test runs on (torch runs most at 4 or 8 on GPUs)."""

RANK_MODULES = (
    "torch.testing._internal.common_fsdp",
    "torch.testing._internal.distributed._tensor.common_dtensor",
    "tests.fsdp._fsdp2_conformance",
)
"""What the ranks import before a test body runs (``preload_in_ranks``): torch's test
helpers take about 2 s to import, once per rank pool instead of once per launch."""


def torch_case() -> TestCase:
    """A ``TestCase`` for torch's ``assertEqual`` (dtype-aware tolerances) in a rank."""
    return TestCase()


def replicated_reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` under torch's ``replicate`` (DDP): gradients averaged over ranks."""
    reference = copy.deepcopy(model)
    replicate(reference)
    return reference


def broadcast_params(model: nn.Module) -> None:
    """Rank 0's parameter values on every rank (torch's tests do this where seeds differ)."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.detach(), src=0)


def _reference_piece(value: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's piece of the replicated ``value`` in ``sharded``'s layout."""
    if isinstance(sharded, UnevenDTensor):
        return uneven_local_piece(value.detach(), sharded)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.detach(), sharded.device_mesh, sharded.placements).to_local()


def check_sharded_parity(
    case: TestCase,
    replicated_module: nn.Module,
    sharded_module: nn.Module,
    prefixes_to_ignore: tuple[str, ...] = (),
) -> None:
    """torch's ``check_sharded_parity`` checks, with the reference cut in mf's layout."""
    pairs = zip(
        replicated_module.named_parameters(), sharded_module.named_parameters(), strict=True
    )
    for (ref_name, ref_param), (name, param) in pairs:
        for prefix in prefixes_to_ignore:
            name = name.replace(prefix, "")
        case.assertEqual(ref_name, name)
        case.assertIsInstance(param, DTensor)
        case.assertEqual(param.to_local(), _reference_piece(ref_param, param))
        if ref_param.grad is None:
            case.assertIsNone(param.grad)
            continue
        case.assertIsNotNone(param.grad)
        case.assertIsInstance(param.grad, DTensor)
        case.assertEqual(param.grad.to_local(), _reference_piece(ref_param.grad, param))

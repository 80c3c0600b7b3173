"""torch's FSDP2 init and state tests (``test_fully_shard_init.py``, ``test_fully_shard_state.py``).

Each scenario runs in the same rank twice: once through torch's ``fully_shard`` and
once through ``mf_fsdp.fsdp2.fully_shard``, and the same assertions hold for both
(torch's exception types and message fragments, its placements and values). All
of them run in one launch of two gloo ranks (torch runs these on 1 to 4 threads).
mf's pieces are its own rows: where torch compares a local piece with
``torch.chunk``, the piece is compared in the parameter's own layout
(``check_local_rows``) and the full tensor with the original.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_checks import BOTH, check_local_rows

preload_in_ranks(*RANK_MODULES)


# ------------------------------------------------------------------ test_fully_shard_init.py
def _invalid_mesh_ndim(case, fully_shard, world: int) -> None:
    mesh = init_device_mesh("cpu", (world, 1, 1))
    with case.assertRaisesRegex(ValueError, r"fully\_shard expects a 1D or 2D DeviceMesh but got"):
        fully_shard(MLP(8), mesh=mesh)


def _2d_mesh_without_mesh_dim_names(case, fully_shard, world: int) -> None:
    mesh = init_device_mesh("cpu", (world // 2, 2))
    with case.assertRaisesRegex(
        AssertionError, "Please init the 2D mesh for HSDP with mesh_dim_names specified"
    ):
        fully_shard(MLP(8), mesh=mesh)


def _raise_scalar_parameter(case, fully_shard, world: int) -> None:
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    with case.assertRaisesRegex(
        ValueError, "Change scalar_p to a 1D tensor with numel equal to 1."
    ):
        fully_shard(model)


def _raise_noncontiguous_parameter(case, fully_shard, world: int) -> None:
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    with case.assertRaisesRegex(
        NotImplementedError, "FSDP does not support non-contiguous parameters"
    ):
        fully_shard(conv)


def _shard_tensor_parameters(case, fully_shard, world: int) -> None:
    """Odd sizes (uneven pieces); then with one projection shared by two MLPs."""
    mesh = init_device_mesh("cpu", (world,))
    for share in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
        if share:
            model[0].in_proj = model[1].in_proj
        originals = [param.detach().clone() for param in model.parameters()]
        fully_shard(model)
        sharded = list(model.parameters())
        case.assertEqual(len(originals), len(sharded))
        for original, param in zip(originals, sharded, strict=True):
            case.assertIsInstance(param, DTensor)
            # mf names the mesh it builds for mesh=None ("dp_shard"): same ranks, another name.
            case.assertEqual(param.device_mesh.mesh, mesh.mesh)
            case.assertEqual(param.size(), original.size())
            case.assertEqual(param.stride(), original.stride())
            case.assertEqual(param.placements, (Shard(0),))
            check_local_rows(case, original, param)


def _transformer(world: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(42)
    model = Transformer(ModelArgs(n_layers=3, dropout_p=0.0))
    broadcast_params(model)
    return model, copy.deepcopy(model)


def _init_1d_transformer_shard_dim_neg1(case, fully_shard, world: int) -> None:
    """``Shard(-1)`` from ``shard_placement_fn``: the full values are the model's."""
    model, ref_model = _transformer(world)
    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=lambda param: Shard(-1))
    fully_shard(model, shard_placement_fn=lambda param: Shard(-1))
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        case.assertEqual(param.full_tensor(), ref_param)


def _old_import_training(case, fully_shard, world: int) -> None:
    """bf16 compute per unit: the modules are FSDPModules and a step runs."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for module in (model[0], model[1], model):
        fully_shard(module, mp_policy=policy)
    for module in (model[0], model[1], model):
        case.assertIsInstance(module, FSDPModule)
    model(torch.randn((8, 16))).sum().backward()


# ----------------------------------------------------------------- test_fully_shard_state.py
def _fully_shard_reapply(case, fully_shard, world: int) -> None:
    model = MLP(8)
    fully_shard(model)
    with case.assertRaisesRegex(
        AssertionError,
        "Each distinct composable distributed API can only be applied to a module once.",
    ):
        fully_shard(model)


def _fully_shard_cls(case, fully_shard, world: int) -> None:
    """Only the module given gets the FSDP class; a slice of a Sequential does not."""
    model = MLP(8)
    fully_shard(model)
    case.assertIsInstance(model, MLP)
    case.assertIsInstance(model, FSDPModule)
    case.assertEqual(type(model).__name__, "FSDPMLP")
    for module in model.modules():
        if module is not model:
            case.assertNotIsInstance(module, FSDPModule)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    fully_shard(model)
    case.assertIsInstance(model, nn.Sequential)
    case.assertIsInstance(model, FSDPModule)
    case.assertEqual(type(model).__name__, "FSDPSequential")
    sliced = model[:2]
    case.assertIsInstance(sliced, nn.Sequential)
    case.assertNotIsInstance(sliced, FSDPModule)


def _fully_shard_unsupported_module_cls(case, fully_shard, world: int) -> None:
    regex = r"fully\_shard does not support containers that do not implement forward"
    for model in (
        nn.ModuleList([MLP(8) for _ in range(3)]),
        nn.ModuleDict({"1": MLP(8), "2": MLP(8)}),
    ):
        with case.assertRaisesRegex(ValueError, regex):
            fully_shard(model)


def _fully_shard_deepcopy(case, fully_shard, world: int) -> None:
    model = MLP(8)
    fully_shard(model)
    with case.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
        copy.deepcopy(model)


SCENARIOS = (
    _invalid_mesh_ndim,
    _2d_mesh_without_mesh_dim_names,
    _raise_scalar_parameter,
    _raise_noncontiguous_parameter,
    _shard_tensor_parameters,
    _init_1d_transformer_shard_dim_neg1,
    _old_import_training,
    _fully_shard_reapply,
    _fully_shard_cls,
    _fully_shard_unsupported_module_cls,
    _fully_shard_deepcopy,
)


def _rank_scenarios(rank: int, world: int) -> None:
    case = torch_case()
    for scenario in SCENARIOS:
        for label, fully_shard in zip(BOTH, (torch_fully_shard, mf_fully_shard), strict=True):
            try:
                scenario(case, fully_shard, world)
            except BaseException as error:
                raise AssertionError(f"{scenario.__name__} on {label}: {error}") from error


@pytest.mark.multiprocess
def test_init_and_state_scenarios_match_torch() -> None:
    """torch's init and state tests (listed in docs/fsdp2.md), on torch's FSDP2 and on mf."""
    run_on_ranks(_rank_scenarios, WORLD)

"""``mf_fsdp.fsdp2.fully_shard`` on meshes as torch builds them (``fsdp2/meshes.py``).

- A dp mesh over part of the ranks: world 4 as ``(rest, dp)`` = ``(2, 2)``, each
  half training its own copy of the tiny GPT over its own ``dp`` slice (the
  halves start from other weights and read other batches); each equals one
  process on its half's global batch over 3 SGD steps, so the engine used that
  half's groups alone. The same with the world mesh unflattened from 1-D
  (torchtitan's way), where the slice's root is the 1-D world mesh.
- The mesh object: the sharded parameters' DTensors carry the mesh the user
  passed, named or not (it was a renamed copy).
- ``dp_mesh_dims`` given what FSDP2 refuses: another type, an unnamed mesh, plain
  parameters without spmd_types' type on the storage mesh's tp dim, DTensor
  parameters beside plain ones or not ``Replicate()`` on a dp dim.
- DTensor parameters over the storage mesh (torchtitan's ``full_dtensor``), with
  the root's own parameters among them (their grads wait on the parameters until
  the reduction): two SGD steps equal one process on the global batch, so the
  ``Partial()`` dp grads were reduced once, by the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import batch, global_batch_run, make_model, reference_run

STEPS = 3


def _wrapped(mesh, seed: int):
    model = make_model(seed)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _split_world(unflattened: bool):
    """World 4 as ``(rest, dp)`` = ``(2, 2)``: built 2-D, or unflattened from 1-D."""
    if not unflattened:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rest", "dp"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    return world._unflatten(0, (2, 2), ("rest", "dp"))


def _rank_part(rank: int, world: int, unflattened: bool) -> None:
    mesh = _split_world(unflattened)
    dp = mesh["dp"]
    half = mesh.get_local_rank("rest")
    model = _wrapped(dp, seed=half)
    assert all(p.device_mesh is dp for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, 10 * half + dp_rank)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.get_group())
        losses.append(total.item() / dp_size)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}

    ref_losses, ref_params = _half_reference(half, dp_size)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _half_reference(half: int, dp_size: int):
    """One process on one half's global batch (its ranks' batches, averaged)."""
    model = make_model(half)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_of(model, step: int, dp_rank: int):
        return model(*batch(step, 10 * half + dp_rank))

    return global_batch_run(model, opt, STEPS, dp_size, loss_of)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("unflattened", [False, True], ids=["nd", "unflattened"])
def test_a_dp_mesh_over_part_of_the_ranks_trains_that_half_alone(unflattened: bool) -> None:
    run_on_ranks(_rank_part, 4, unflattened, timeout=180)


def _rank_unnamed(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = _wrapped(mesh, seed=0)
    assert all(p.device_mesh is mesh for p in model.parameters())
    assert mesh.mesh_dim_names is None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    ref_losses, _ = reference_run("sgd", world, STEPS)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_unnamed_mesh_is_the_parameters_mesh() -> None:
    run_on_ranks(_rank_unnamed, 2, timeout=100)


def _rank_bad_dims(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    with pytest.raises(TypeError, match=r"dp_mesh_dims must be a DataParallelMeshDims or None"):
        fsdp2.fully_shard(make_model(), mesh=mesh, dp_mesh_dims="dp_shard")
    dims = pytest.importorskip("torch.distributed.fsdp").__dict__.get("DataParallelMeshDims")
    if dims is None:  # torch 2.11 has no DataParallelMeshDims
        return
    with pytest.raises(ValueError, match=r"names dims of mesh, got mesh=None"):
        fsdp2.fully_shard(make_model(), dp_mesh_dims=dims(shard="dp_shard"))
    model = fsdp2.fully_shard(make_model(), mesh=mesh, dp_mesh_dims=dims(shard="nope"))
    with pytest.raises(ValueError, match=r"\['nope'\] not among the mesh's dims \('dp_shard',\)"):
        list(model.parameters())
    # A storage mesh with a tp dim needs each plain parameter typed on it (spmd_types).
    storage = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
    with pytest.raises(NotImplementedError, match=r"'.*' is typed None on the tp") as info:
        fsdp2.fully_shard(make_model(), mesh=storage, dp_mesh_dims=dims(shard="dp_shard"))
    assert "\n" not in str(info.value)
    # full_dtensor: every parameter a DTensor over the storage mesh, Replicate() on dp.
    for placement, bias, refused in [
        (Shard(0), Replicate(), r"'weight' is placed dp_shard=Shard\(dim=0\) on a data-parallel"),
        (Replicate(), None, r"'bias' is a plain tensor beside DTensor parameters"),
    ]:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [placement]))
        if bias is not None:
            lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [bias]))
        with pytest.raises(NotImplementedError, match=refused) as info:
            fsdp2.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims(shard="dp_shard"))
        assert "\n" not in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_dp_mesh_dims_bad_input_is_one_line() -> None:
    run_on_ranks(_rank_bad_dims, 2, timeout=100)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def _rank_storage_dtensors(rank: int, world: int) -> None:
    dims = pytest.importorskip("torch.distributed.fsdp").__dict__.get("DataParallelMeshDims")
    if dims is None:  # torch 2.11 has no DataParallelMeshDims
        return
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = _mlp()
    distribute_module(model, mesh)  # every parameter Replicate() over the storage mesh
    fsdp2.fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims(shard="dp_shard"))
    fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims(shard="dp_shard"))  # owns model[2]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = DTensor.from_local(_inputs(step, rank), mesh, [Shard(0)])
        model(x).to_local().pow(2).sum().backward()  # this rank's part: Partial() grads
        opt.step()
        opt.zero_grad()
    reference = _mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        whole = torch.cat([_inputs(step, r) for r in range(world)])
        (reference(whole).pow(2).sum() / world).backward()  # FSDP's mean over the dp ranks
        ref_opt.step()
        ref_opt.zero_grad()
    for name, param in model.named_parameters():
        assert param.device_mesh == mesh
        want = reference.get_parameter(name)
        torch.testing.assert_close(param.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_dtensor_parameters_over_the_storage_mesh_train_as_one_process() -> None:
    run_on_ranks(_rank_storage_dtensors, 2, timeout=100)

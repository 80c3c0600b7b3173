"""Checkpoints move between mf and PyTorch FSDP2 (``fully_shard``) and into a plain module.

The real neighbour in the same test: the tiny GPT trains 3 steps under mf
ZeRO-3 on 2 ranks and is saved through torch's DSD (``get_state_dict``) and
``dcp.save``; the same model wrapped by FSDP2 ``fully_shard`` (every ``Block``
and the root, an optimizer built after wrapping) loads it through DSD on 2
ranks and on 1: the parameters are bit-exact, the next step's loss is mf's,
and so is the loss after one more optimizer step (so Adam's state came along).
Then the other way round: FSDP2 trains and saves, mf loads. The same both ways
with mf's FSDP2 front end (``mf_fsdp.fsdp2.fully_shard``) in mf's place, which
also loads on 1 rank. Finally
``dcp_to_torch_save`` turns mf's checkpoint into one ``torch.save`` file whose
model part the plain module loads with ``strict=True``.

Tolerance: parameters bit-exact; losses 1e-6 (1 rank sums the global batch
in another order than 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mf.models import GPT
from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import CONFIG, make_model
from tests.fsdp.checkpoint.test_checkpoint import _local_batch, _optimizer, _train
from tests.fsdp.checkpoint.test_torch_contract import _recipe_pair

TOL = {"rtol": 1e-6, "atol": 1e-6}
TRAINED = 3


def _fsdp2_pair(world: int, seed: int, shard=fully_shard):
    """The tiny GPT under FSDP2 (every Block and the root), Adam built after wrapping.

    ``shard`` is torch's ``fully_shard`` or mf's FSDP2 front end (``mf_fsdp.fsdp2``).
    """
    module = make_model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for block in module.blocks:
        shard(block, mesh=mesh)
    shard(module, mesh=mesh)
    return module, _optimizer("adam", module.parameters())


def _pair(engine: str, world: int, seed: int):
    """The trained pair of ``engine``: mf's own interface, torch's FSDP2, or mf's FSDP2 one."""
    if engine == "mf":
        return _recipe_pair(3, "adam", seed=seed)
    return _fsdp2_pair(world, seed, fsdp2.fully_shard if engine == "mf-fsdp2" else fully_shard)


def _full(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in model.named_parameters()
    }


def _loss(model, rank: int, world: int, step: int) -> float:
    """The global-batch loss of ``step`` (mean over ranks), without a step."""
    with torch.no_grad():
        loss = model(*_local_batch(step, rank, world)).detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _after(model, opt, rank: int, world: int) -> dict:
    """What a loader must reproduce: the weights, the next loss, the loss after a step."""
    result = {"params": _full(model), "next": _loss(model, rank, world, TRAINED)}
    _train(model, opt, rank, world, range(TRAINED, TRAINED + 1))
    result["stepped"] = _loss(model, rank, world, TRAINED + 1)
    return result


def _save(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _compare(got: dict, expected: dict, label: str) -> None:
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), f"{label} {name}"
    for key in ("next", "stepped"):
        torch.testing.assert_close(got[key], expected[key], **TOL, msg=f"{label} {key}")


def _rank_save(rank: int, world: int, root: str, engine: str) -> None:
    model, opt = _pair(engine, world, seed=0)
    _train(model, opt, rank, world, range(TRAINED))
    _save(model, opt, f"{root}/{engine}")
    expected = _after(model, opt, rank, world)
    if rank == 0:
        torch.save(expected, Path(root) / f"{engine}.expected.pt")


def _rank_load(rank: int, world: int, root: str, engine: str, saved_by: str) -> None:
    model, opt = _pair(engine, world, seed=1)
    _load(model, opt, f"{root}/{saved_by}")
    expected = torch.load(Path(root) / f"{saved_by}.expected.pt")
    _compare(_after(model, opt, rank, world), expected, f"{saved_by} -> {engine} x{world}")


@pytest.mark.multiprocess
def test_mf_checkpoint_loads_into_fsdp2_and_back(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_on_ranks(_rank_save, 2, root, "mf", timeout=180)
    run_on_ranks(_rank_load, 2, root, "fsdp2", "mf", timeout=180)
    run_on_ranks(_rank_load, 1, root, "fsdp2", "mf", timeout=180)
    run_on_ranks(_rank_save, 2, root, "fsdp2", timeout=180)
    run_on_ranks(_rank_load, 2, root, "mf", "fsdp2", timeout=180)
    # dcp_to_torch_save: one plain file; its model part loads into the plain module.
    dcp_to_torch_save(f"{root}/mf", tmp_path / "mf.pt")
    saved = torch.load(tmp_path / "mf.pt", weights_only=False)
    plain = GPT(CONFIG)
    plain.load_state_dict(saved["model"], strict=True)
    expected = torch.load(tmp_path / "mf.expected.pt")
    for name, value in plain.named_parameters():
        assert torch.equal(value.detach(), expected["params"][name]), name


@pytest.mark.multiprocess
def test_mf_fsdp2_front_end_checkpoint_loads_into_fsdp2_and_back(tmp_path: Path) -> None:
    """mf's FSDP2 front end saves, torch's ``fully_shard`` loads; then the other way round."""
    root = str(tmp_path)
    run_on_ranks(_rank_save, 2, root, "mf-fsdp2", timeout=180)
    run_on_ranks(_rank_load, 2, root, "fsdp2", "mf-fsdp2", timeout=180)
    run_on_ranks(_rank_save, 2, root, "fsdp2", timeout=180)
    run_on_ranks(_rank_load, 2, root, "mf-fsdp2", "fsdp2", timeout=180)
    run_on_ranks(_rank_load, 1, root, "mf-fsdp2", "fsdp2", timeout=180)

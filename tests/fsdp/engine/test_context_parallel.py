"""FSDP over data x context parallelism (Megatron's ``dp_cp``), against one process.

Where to start: ``_train`` runs steps of the tiny GPT inside
``mf_tp.context_parallel``: every cp rank of a data-parallel rank gets that
rank's full batch, keeps its head-tail share of each sequence and passes its
positions. The engine shards and reduces over the flattened dp x cp group,
so the gradient is the mean over dp x cp of local mean losses: one process's
gradient on the global batch (each local loss averages the same number of
tokens). With ``calculate_per_token_loss`` the engine sums, and each rank
divides its local mean by cp: the per-token contract of the reference run.

Meshes, as users build them:

- ``mf_fsdp.fully_shard`` (Megatron's front end): a mesh with dims
  ``(dp, cp[, tp])`` or ``(dp_outer, dp_shard, cp)`` and the flattened
  ``dp_cp`` / ``dp_shard_cp`` given as ``dp_shard_dim``;
- ``mf_fsdp.fsdp2.fully_shard``: a mesh whose dim is the flattened group
  itself (``("dp_shard_cp",)`` or ``("dp_replicate", "dp_shard_cp")``), the
  cp mesh built beside it, as torch asks (no slicing by flattened names).

Tolerances: fp32 runs match at rtol 1e-5 (losses and every parameter after
3 steps): only the order of fp32 sums differs; SGD at lr 0.5 shows a wrong
scale at O(1). Adam runs with ``eps=1e-4``: the gradient of the attention's
key bias is zero in exact arithmetic (a constant added to every score of a
row leaves its softmax unchanged), so both runs hold rounding noise there,
which Adam at its default eps (1e-8) turns into steps of about ``lr``, a
different one for each order of sums (measured under cp 2: 5 of 192 qkv
biases up to 1.4e-4 apart); at 1e-4 noise moves a weight by 1e-7 of ``lr``.
bf16 compute: losses within 2% of the fp32 run, and every parameter within
10% of its fp32 update (||p_bf16 - p_fp32|| <= 0.1
||p_fp32 - p_init||), so a run that never updates fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import mf_fsdp
import mf_tp
from mf.models import Block, GPTTensorParallel
from mf.models.gpt_tp import TensorParallelBlock
from mf_fsdp.fsdp2 import fully_shard as fsdp2_fully_shard
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    BF16_LOSS_RTOL,
    CONFIG,
    assert_losses_close,
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    make_optimizer,
    reference_run,
)

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
ADAM_EPS = 1e-4
BF16_UPDATE_FRACTION = 0.1


@dataclass(frozen=True)
class Case:
    """One training run: the front end, the mesh, the ZeRO strategy and the optimizer."""

    front: str  # "mf" (mf_fsdp.fully_shard) or "fsdp2"
    mesh: str  # a key of _MESHES
    strategy: int = 3
    opt: str = "sgd"
    per_token: bool = False
    bf16: bool = False

    def __str__(self) -> str:
        extra = (" per-token" if self.per_token else "") + (" bf16" if self.bf16 else "")
        return f"{self.front} {self.mesh} ZeRO-{self.strategy} {self.opt}{extra}"


@dataclass(frozen=True)
class Meshes:
    """What a case's rank needs: the engine's mesh and dims, the cp mesh, its dp rank."""

    fsdp: DeviceMesh
    dims: dict[str, str]
    cp: DeviceMesh
    dp_rank: int
    dp_size: int
    tp: bool = False


def _megatron(shape: tuple[int, ...], names: tuple[str, ...], flat: tuple[str, ...]) -> Meshes:
    """A mesh with the cp dim and the flattened data-parallel dim named in dp_shard_dim."""
    mesh = cpu_mesh(shape, names)
    flat_name = "_".join(flat)
    mesh[flat]._flatten(flat_name)
    dims = {"dp_shard_dim": flat_name}
    outer = "dp_outer" in names
    if outer:
        dims["dp_outer_dim"] = "dp_outer"
    if "tp" in names:
        dims["tp_dim"] = "tp"
    dp_rank = mesh.get_local_rank("dp_outer" if outer else "dp")
    dp_size = mesh.size(names.index("dp_outer" if outer else "dp"))
    return Meshes(mesh, dims, mesh["cp"], dp_rank, dp_size, tp="tp" in names)


def _fsdp2(fsdp_shape: tuple[int, ...], fsdp_names: tuple[str, ...], dp: int) -> Meshes:
    """FSDP2's mesh over the flattened group itself; the (dp, cp) mesh beside it."""
    world = dist.get_world_size()
    beside = cpu_mesh((dp, world // dp), ("dp", "cp"))
    fsdp = cpu_mesh(fsdp_shape, fsdp_names)
    return Meshes(fsdp, {}, beside["cp"], beside.get_local_rank("dp"), dp)


_MESHES: dict[str, Callable[[], Meshes]] = {
    "cp2": lambda: _megatron((1, 2), ("dp", "cp"), ("dp", "cp")),
    "dp2xcp2": lambda: _megatron((2, 2), ("dp", "cp"), ("dp", "cp")),
    "hsdp2x(1xcp2)": lambda: _megatron(
        (2, 1, 2), ("dp_outer", "dp_shard", "cp"), ("dp_shard", "cp")
    ),
    "tp2xcp2": lambda: _megatron((1, 2, 2), ("dp", "cp", "tp"), ("dp", "cp")),
    "fsdp2-cp2": lambda: _fsdp2((2,), ("dp_shard_cp",), 1),
    "fsdp2-dp2xcp2": lambda: _fsdp2((4,), ("dp_shard_cp",), 2),
    "fsdp2-hsdp2x(1xcp2)": lambda: _fsdp2((2, 2), ("dp_replicate", "dp_shard_cp"), 2),
}


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    """``make_optimizer``'s, with Adam's eps at ADAM_EPS (see the module docstring)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=ADAM_EPS)
    return make_optimizer(name, params)


def _wrap(case: Case, meshes: Meshes) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case.bf16 else None
    if case.front == "fsdp2":
        module = make_model()
        for block in module.blocks:
            fsdp2_fully_shard(block, mesh=meshes.fsdp)
        fsdp2_fully_shard(module, mesh=meshes.fsdp)
        return module, _optimizer(case.opt, module.parameters())
    module: torch.nn.Module = make_model()
    units: list[type] = [Block]
    if meshes.tp:
        plain = module
        module = GPTTensorParallel(CONFIG, meshes.fsdp.get_group("tp"))
        module.load_full_weights(plain.state_dict())
        units = [TensorParallelBlock]
    opt = _optimizer(case.opt, module.parameters())
    # torch deprecates slicing a root mesh by a flattened name (it warns): mf must not.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = mf_fsdp.fully_shard(
            module,
            opt,
            device_mesh=meshes.fsdp,
            fsdp_unit_modules=units,
            zero_dp_strategy=case.strategy,
            calculate_per_token_loss=case.per_token,
            mixed_precision_policy=policy,
            **meshes.dims,
        )
    # dp and cp lie inside the flattened dim: no other dim a norm must sum over.
    assert model.get_distributed_index().expert_parallel_groups == ()
    return model, opt


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, meshes: Meshes, per_token: bool
) -> list[float]:
    """STEPS steps under context parallelism; each step's loss as the reference counts it."""
    cp = meshes.cp.size()
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.clone() for t in batch(step, meshes.dp_rank))
        positions = torch.arange(tokens.shape[1])
        with mf_tp.context_parallel(
            meshes.cp, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 0]
        ):
            loss = model(tokens, targets, positions=positions)
            if per_token:
                loss = loss / cp  # summed over dp x cp by the engine: per dp rank, its mean
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / (1 if per_token else dist.get_world_size()))
    return losses


def _rank_cases(rank: int, world: int, cases: list[Case]) -> None:
    built: dict[str, Meshes] = {}
    for case in cases:
        meshes = built.get(case.mesh) or built.setdefault(case.mesh, _MESHES[case.mesh]())
        model, opt = _wrap(case, meshes)
        losses = _train(model, opt, meshes, case.per_token)
        params = full_params(model)
        ref_losses, ref_params = reference_run(
            case.opt, meshes.dp_size, STEPS, per_token=case.per_token, optimizer=_optimizer
        )
        if not case.bf16:
            assert_matches_reference(losses, params, ref_losses, ref_params, str(case), RTOL, ATOL)
            continue
        assert_losses_close(losses, ref_losses, str(case), BF16_LOSS_RTOL)
        initial = dict(make_model().named_parameters())
        off = torch.cat([(params[n] - ref_params[n]).flatten() for n in ref_params]).norm()
        update = torch.cat([(ref_params[n] - initial[n]).flatten() for n in ref_params]).norm()
        assert off <= BF16_UPDATE_FRACTION * update, (
            f"{case}: the bf16 parameters are {off:.3g} from the fp32 run's, whose update is "
            f"{update:.3g}"
        )


_WORLD2 = [
    *(Case("mf", "cp2", s, o) for s in (1, 2, 3) for o in ("sgd", "adam")),
    Case("mf", "cp2", 3, "sgd", per_token=True),
    Case("mf", "cp2", 3, "sgd", bf16=True),
    Case("fsdp2", "fsdp2-cp2", 3, "sgd"),
    Case("fsdp2", "fsdp2-cp2", 3, "adam"),
]
_WORLD4 = [
    Case("mf", "dp2xcp2", 3, "sgd"),
    Case("mf", "dp2xcp2", 3, "adam"),
    Case("mf", "dp2xcp2", 1, "sgd"),
    Case("mf", "dp2xcp2", 3, "sgd", per_token=True),
    Case("mf", "hsdp2x(1xcp2)", 3, "sgd"),
    Case("mf", "hsdp2x(1xcp2)", 2, "adam"),
    Case("mf", "tp2xcp2", 3, "sgd"),
    Case("mf", "tp2xcp2", 3, "adam"),
    Case("mf", "tp2xcp2", 1, "sgd"),
    Case("fsdp2", "fsdp2-dp2xcp2", 3, "sgd"),
    Case("fsdp2", "fsdp2-hsdp2x(1xcp2)", 3, "adam"),
]


@pytest.mark.multiprocess
def test_cp2_equals_one_process() -> None:
    run_on_ranks(_rank_cases, 2, _WORLD2, timeout=240)


@pytest.mark.multiprocess
def test_dp2_cp2_hsdp_and_tp2_cp2_equal_one_process() -> None:
    run_on_ranks(_rank_cases, 4, _WORLD4, timeout=280)


def _rank_refusal(rank: int, world: int) -> None:
    mesh = cpu_mesh((1, 1, 2), ("dp_outer", "dp_shard", "cp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    with pytest.raises(ValueError, match=r"needs dims of the mesh, got the flattened dp_shard_dim"):
        mf_fsdp.FSDPDistributedIndex(
            mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer", hsdp_outer_dp_shard=True
        )


@pytest.mark.multiprocess
def test_hybrid_sharded_hsdp_refuses_a_flattened_dim() -> None:
    run_on_ranks(_rank_refusal, 2, timeout=60)

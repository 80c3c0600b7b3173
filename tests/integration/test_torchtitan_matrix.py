"""torchtitan's parallelism matrix on ``mf_fsdp.fsdp2``, beside torch's FSDP2 in the same ranks.

A torchtitan user keeps torchtitan's own code (``ParallelDims.build_mesh``, the
Llama 3 sharding config and ``parallelize_llama``) and swaps the one name
``fully_shard`` where ``torchtitan.distributed.fsdp`` imports it. torchtitan
builds every mesh by unflattening one 1-D world mesh, so the ``fsdp`` mesh it
hands over is a slice over part of the ranks and the tp mesh a slice of another
view of the same root; its default backend (``spmd_types``) passes
``dp_mesh_dims`` instead, even for plain FSDP. Under TP that backend's
parameters are plain tp pieces annotated with spmd_types and its model runs its
own tp collectives on plain tensors, in the trainer's context (the current spmd
mesh, entered here too); its output is each tp rank's plain piece of the
vocabulary, gathered here. Under ``full_dtensor`` parameters, inputs and
activations are DTensors over the whole storage mesh and the loss is
torchtitan's own sum, ``Partial()`` over the dp dims; the module computes with
storage-mesh DTensors and the sharded parameters lie on the meshes, with the
placements, of torch's FSDP2.

Each configuration runs in the same ranks: torch's FSDP2 and mf through
torchtitan's code, from one process's initial weights, and one process on the
global batch. Three steps of SGD or AdamW; the per-step losses, the first
step's full gradients and the full weights after the steps are compared with
one process to 1e-5 (AdamW's first steps move a weight whose gradient is near
zero by about its learning rate whatever that gradient's rounding, so its rate
is 1e-3), and torchtitan's own ``clip_grad_norm_`` (the total grad norm, taken
each step) between the engines. (That norm over the sharded DTensor gradients
differs from one process's ``clip_grad_norm_`` by about 5e-5 relative under
both engines alike, while every gradient agrees to 1e-6.) The model is
torchtitan's Llama 3 debugmodel cut to two blocks (SDPA attention for the CPU);
the tp ranks of one dp rank read its batch, as torchtitan's dataloader gives
them.

Two loss scalings: torchtitan's own (FSDP's division off, each dp rank's loss
over the dp size), and FSDP's mean (torchtitan's ``disable_fsdp_gradient_division``
skipped), where the engine must divide by the data-parallel size, not the world.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mf_fsdp import fsdp2
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.integration.test_torchtitan_llama import _initialised  # skips where it does

try:
    import spmd_types as spmd
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, full_dtensor
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import clip_grad_norm_, get_spmd_context
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from tests.integration._torchtitan_llama_parts import (
        ENGINES,
        force_sum,
        full,
        model_config,
        one_process,
    )
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = [
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete"),
    pytest.mark.filterwarnings("ignore:While redistributing from"),
]
preload_in_ranks(__name__)

VOCAB, SEQ, BATCH, STEPS = 2048, 16, 2, 3
RTOL, ATOL = 1e-5, 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    """One torchtitan configuration: its degrees and backend."""

    dp_replicate: int
    dp_shard: int
    tp: int
    backend: str = "partial_dtensor"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def _parallelized(shard, case: Case, divide: bool):
    """torchtitan's mesh and ``parallelize_llama`` with ``fully_shard`` being ``shard``.

    Returns the model and torchtitan's ``ParallelDims``.
    """
    dims = ParallelDims(
        dp_replicate=case.dp_replicate,
        dp_shard=case.dp_shard,
        cp=1,
        tp=case.tp,
        pp=1,
        ep=1,
        world_size=case.world,
        spmd_backend=case.backend,
    )
    with torch.device("meta"):
        model = model_config(2).build()
    patches = [
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ]
    if divide:  # FSDP's own mean over the data-parallel ranks
        patches.append(mock.patch.object(titan_fsdp, "disable_fsdp_gradient_division", id))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        dims.build_mesh()
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend=case.backend),
            compile_config=CompileConfig(enable=False, components=["model"]),
            ac_config=None,
            dump_folder="unused",
        )
    force_sum(model, shard)
    return _initialised(model), dims


def _start_from(model, plain) -> None:
    """Give ``model`` one process's initial weights (torch's FSDP2 draws others under TP)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            whole = plain.get_parameter(name).detach()
            param.copy_(distribute_tensor(whole, param.device_mesh, param.placements))


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor, vocab_mesh=None) -> torch.Tensor:
    if vocab_mesh is not None:  # this tp rank's plain piece of the vocabulary
        logits = DTensor.from_local(logits, vocab_mesh, [Shard(2)])
    return F.cross_entropy(full(logits).flatten(0, 1).float(), targets.flatten())


def _train(model, dims, case: Case, optim: str, rank: int, divide: bool):
    """Three steps on this dp rank's batches; the global loss and grad norm per step.

    Forward and backward run in torchtitan's trainer context (the spmd_types
    backend's current mesh); under TP that backend gives each tp rank its plain
    piece of the vocabulary, gathered here.
    """
    context = get_spmd_context(parallel_dims=dims)
    vocab_mesh = dims.get_mesh("tp") if case.backend == "spmd_types" and case.tp > 1 else None
    opt = _optimizer(optim, model.parameters())
    dp_rank = rank // case.tp  # torchtitan's mesh order: (pp, dp_replicate, dp_shard, tp)
    scale = 1.0 if divide else 1.0 / case.dp
    losses, norms, grads = [], [], {}
    seen = []  # the column-parallel weight as the module computes with it
    feed_forward = model.layers["0"].feed_forward
    feed_forward.register_forward_pre_hook(lambda module, _: seen.append(module.w1.weight))
    for step in range(STEPS):
        tokens, targets = _batch(step, dp_rank)
        with context():
            if case.backend == "spmd_types":
                tokens, targets, _ = annotate_input_spmd_types(dims, tokens, targets, {})
            if case.backend == "full_dtensor":
                tokens, targets, _ = full_dtensor.parallelize_inputs(dims, tokens, targets, {})
            logits = model(tokens)
        if case.backend == "full_dtensor":  # torchtitan's sum: Partial() over the dp dims
            loss = cross_entropy_loss(logits, targets) * (scale / targets.to_local().numel())
        else:
            loss = _loss(logits, targets, vocab_mesh) * scale
        loss.backward()
        if case.backend == "full_dtensor":
            loss = loss.to_local()  # this dp rank's part
        if step == 0:
            grads = {name: full(param.grad).clone() for name, param in model.named_parameters()}
        norms.append(clip_grad_norm_(list(model.parameters()), 1e9).item())
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone() / case.tp  # each tp rank holds its dp rank's loss
        dist.all_reduce(total)
        losses.append(total.item() * (1.0 / case.dp if divide else 1.0))
    weights = {name: full(param).detach().clone() for name, param in model.named_parameters()}
    layouts = {}
    if case.backend == "full_dtensor":
        layouts = {name: _layout(param) for name, param in model.named_parameters()}
        if isinstance(model, fsdp2.FSDPModule):
            # A DTensor over the whole storage mesh, Replicate() on its dp dims and the
            # tp placement kept, as FSDP2's unsharded parameter.
            storage, _ = resolve_fsdp_mesh(dims)
            assert isinstance(seen[-1], DTensor)
            assert seen[-1].device_mesh == storage
            tp = (Shard(0),) if case.tp > 1 else ()
            assert seen[-1].placements == (Replicate(),) * (storage.ndim - len(tp)) + tp
            assert seen[-1].to_local().shape == (768 // case.tp, 256)
    if case.backend == "spmd_types" and case.tp > 1 and isinstance(model, fsdp2.FSDPModule):
        # A plain tp piece that keeps its spmd_types annotation (S(0) on tp), as FSDP2
        # restores it on its unsharded parameter.
        assert not isinstance(seen[-1], DTensor)
        assert seen[-1].shape == (384, 256)
        assert spmd.get_partition_spec(seen[-1]) is not None
        assert spmd.get_local_type(seen[-1])
    return losses, norms, weights, grads, layouts


def _layout(param: DTensor):
    """A sharded parameter's mesh and placements; a ``_StridedShard`` read as the ``Shard`` it is.

    (FSDP2 names a dp shard of a dim tp splits too ``_StridedShard``; mf's pieces
    say where each rank's rows lie, under ``Shard``.)
    """
    return param.device_mesh, tuple(
        Shard(p.dim) if hasattr(p, "dim") else p for p in param.placements
    )


def _reference(case: Case, optim: str):
    """One process on the global batch: each dp rank's part over the dp size."""
    model = one_process(2)
    opt = _optimizer(optim, model.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        total = 0.0
        for dp_rank in range(case.dp):
            tokens, targets = _batch(step, dp_rank)
            loss = _loss(model(tokens), targets) / case.dp
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, grads, dict(model.named_parameters())


def _rank_matrix(rank: int, world: int, case: Case, optim: str, divide: bool) -> None:
    plain = one_process(2)
    runs = {}
    for name, shard in ENGINES:
        model, dims = _parallelized(shard, case, divide)
        if name == "torch":
            _start_from(model, plain)
        else:  # mf's engine draws one process's initial weights itself
            for key, param in model.named_parameters():
                torch.testing.assert_close(full(param), plain.get_parameter(key), msg=key)
        runs[name] = _train(model, dims, case, optim, rank, divide)
    losses, grads, weights = _reference(case, optim)
    # Under TP the grads' rounding differs from one process's (4e-9 to 4e-8), and AdamW's
    # steps on near-zero grads take that to 1.1e-5 to 1.25e-5 in torch's FSDP2 and mf
    # alike, whose weights agree with each other to 1e-6.
    weight_atol = 2e-5 if case.tp > 1 and optim == "adamw" else 1e-5
    for name, (got_losses, _, got_weights, got_grads, _) in runs.items():
        torch.testing.assert_close(got_losses, losses, rtol=RTOL, atol=ATOL, msg=f"{name} loss")
        for key, value in got_grads.items():
            torch.testing.assert_close(value, grads[key], rtol=RTOL, atol=ATOL, msg=key)
        for key, value in got_weights.items():
            torch.testing.assert_close(value, weights[key], rtol=RTOL, atol=weight_atol, msg=key)
    torch.testing.assert_close(runs["mf"][1], runs["torch"][1], rtol=RTOL, atol=ATOL)  # norms
    torch.testing.assert_close(runs["mf"][2], runs["torch"][2], rtol=RTOL, atol=ATOL)
    if case.backend == "full_dtensor":
        assert runs["mf"][4] == runs["torch"][4]  # the sharded parameters' meshes and placements
    assert losses[0] != losses[-1]
    moved = [
        key for key in weights if not torch.equal(runs["mf"][2][key], plain.get_parameter(key))
    ]
    assert moved, "the model did not train"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "optim", "divide"),
    [
        pytest.param(Case(1, 2, 2), "sgd", False, id="fsdp2-tp2-sgd"),
        pytest.param(Case(1, 2, 2), "adamw", True, id="fsdp2-tp2-adamw-mean"),
        pytest.param(Case(2, 2, 2), "sgd", True, id="hsdp2x2-tp2-sgd-mean"),
        pytest.param(Case(1, 4, 1, "spmd_types"), "adamw", False, id="default-fsdp4-adamw"),
        pytest.param(Case(2, 2, 1, "spmd_types"), "sgd", True, id="default-hsdp2x2-sgd-mean"),
        pytest.param(Case(1, 2, 2, "spmd_types"), "sgd", False, id="default-fsdp2-tp2-sgd"),
        pytest.param(Case(1, 2, 2, "spmd_types"), "adamw", True, id="default-fsdp2-tp2-adamw-mean"),
        pytest.param(Case(1, 4, 1, "full_dtensor"), "adamw", False, id="fulldt-fsdp4-adamw"),
        pytest.param(Case(2, 2, 1, "full_dtensor"), "sgd", True, id="fulldt-hsdp2x2-sgd-mean"),
        pytest.param(Case(1, 2, 2, "full_dtensor"), "sgd", False, id="fulldt-fsdp2-tp2-sgd"),
        pytest.param(
            Case(1, 2, 2, "full_dtensor"), "adamw", True, id="fulldt-fsdp2-tp2-adamw-mean"
        ),
    ],
)
def test_torchtitan_configuration_trains_as_torch_fsdp2_and_one_process(
    case: Case, optim: str, divide: bool
) -> None:
    run_on_ranks(_rank_matrix, case.world, case, optim, divide, timeout=280)

"""torchtitan's pipeline parallelism on ``mf_fsdp.fsdp2``, beside torch's FSDP2 in the same ranks.

torchtitan's own ``pipeline_llm`` splits its Llama 3 debugmodel (cut to four
blocks, SDPA attention) into stages, applies ``parallelize_llama`` to each model
part with ``fully_shard`` swapped for mf's, and builds torch's schedule
(``torch.distributed.pipelining``: mf writes none). Each stage's part is its own
root; the looped schedule (Interleaved1F1B) puts two roots on one rank. torch's
stages drive the FSDP modules themselves: gradient sync off for each
micro-batch's backward, ``set_manual_backward_finalization`` and one
``finalize_backward`` at the end.

Both engines start from one process's initial weights (loaded into mf's parts
through ``load_state_dict``, copied into torch's as DTensors). Three steps: each
step's loss (torchtitan's global token normalisation, a sum over every
micro-batch and dp rank) and the full weights after the steps equal one process
on the global batch (1e-5); torchtitan's pp-aware ``clip_grad_norm_`` gives the
same norm under both engines. PP 2 x FSDP 2 runs on torchtitan's default
``spmd_types`` backend too (each stage's storage mesh, ``dp_mesh_dims``), its
steps in the trainer's context, and with 1F1B on ``full_dtensor``, whose
micro-batches are wrapped over the storage mesh as torchtitan's trainer wraps
them and whose losses are torchtitan's sums, ``Partial()`` over dp (planted:
the dp grads all-reduced before mf's reduction fail mf's losses). A DCP
checkpoint of the PP x FSDP x TP run loads into FSDP-only runs of the same
model on mf and on torch's FSDP2, whose next loss is the pipeline's.

The PP x FSDP 1F1B row takes FSDP's own mean over the dp ranks (torchtitan's
``disable_fsdp_gradient_division`` skipped, each dp rank's loss over its own
tokens): a division by the world (4) instead of the dp size (2) fails it, while
the rows with torchtitan's division off cannot see one. Under Interleaved1F1B
the two roots on a rank have their own engines, whose buckets share no storage,
and one step of four micro-batches issues one reduce-scatter per bucket and no
all-reduce (``count_collectives``): numbers cannot tell a reduction per
micro-batch from one per step, as the sums are the same. It also issues one
all-gather per bucket: units left gathered for their backward
(``reshard_after_forward=False``) stay gathered across the micro-batches'
forwards (planted: released at each forward's start, 11 and 7 gathers).

The zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble, DualPipeV)
split each backward into an input pass and a weight pass that adds the
weights' grads to ``.grad`` of ``module.parameters()`` itself: mf's gathered
units then hold their compute forms, whose grads are its buffers ([Note:
forms in a pipeline]); they train as the others do (planted: the sharded forms
registered between passes fail with torch's shape error in ``view_as``).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.records import record_of
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp.engine.test_accumulation import count_collectives
from tests.integration.test_torchtitan_llama import _initialised  # skips where it does

try:
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, full_dtensor
    from torchtitan.distributed.utils import clip_grad_norm_, get_spmd_context
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from tests.integration._torchtitan_llama_parts import (
        ENGINES,
        force_sum,
        full,
        model_config,
        one_process,
        pipelined,
    )
    from tests.integration._torchtitan_llama_parts import PipelineCase as Case
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

LAYERS, SEQ, LOCAL_BATCH = Case.layers, Case.seq, Case.local_batch
VOCAB, STEPS = 2048, 3
RTOL, ATOL = 1e-5, 1e-6


def _start_from(parts, plain, shard) -> None:
    """One process's initial weights in every part (mf: its own load path)."""
    state = plain.state_dict()
    for part in parts:
        if shard is torch_fully_shard:
            with torch.no_grad():
                for name, param in part.named_parameters():
                    whole = plain.get_parameter(name).detach()
                    param.copy_(distribute_tensor(whole, param.device_mesh, param.placements))
        else:
            keys = part.state_dict().keys()
            part.load_state_dict({key: state[key] for key in keys}, strict=True)
        for name, param in part.named_parameters():
            assert torch.equal(full(param), plain.get_parameter(name)), name


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ + 1), generator=g)


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _train(shard, case: Case, optim: str, plain):
    dims, schedule, parts, has_first, has_last = pipelined(shard, case)
    _start_from(parts, plain, shard)
    params = [param for part in parts for param in part.parameters()]
    opt = _optimizer(optim, params)
    dp_rank = dims.get_mesh("batch").get_local_rank() if case.dp_shard > 1 else 0
    losses, norms = [], []
    context = get_spmd_context(parallel_dims=dims)  # the trainer's (spmd_types' current mesh)
    for step in range(STEPS):
        with context():
            tokens = _batch(step, dp_rank)
            losses.append(_pp_step(schedule, tokens, has_first, has_last, case, dims))
        norms.append(clip_grad_norm_(params, 1e9, pp_mesh=dims.get_mesh("pp")).item())
        opt.step()
        opt.zero_grad()
    weights = {
        name: full(param).detach().clone()
        for part in parts
        for name, param in part.named_parameters()
    }
    return losses, norms, weights


def _pp_step(
    schedule, tokens: torch.Tensor, has_first: bool, has_last: bool, case: Case, dims=None
) -> float:
    """One schedule step (forward and backward of every micro-batch); the global loss.

    Under ``full_dtensor`` each micro-batch is wrapped over the storage mesh, as
    torchtitan's trainer splits and wraps them (``dims``: torchtitan's ``ParallelDims``),
    and a loss is ``Partial()`` over dp.
    """
    stage_losses: list[torch.Tensor] | None = [] if has_last else None
    if case.backend == "full_dtensor":
        wrapped = [
            full_dtensor.parallelize_inputs(dims, mb[:, :-1], mb[:, 1:], {})[:2]
            for mb in tokens.split(1)
        ]
        schedule.step(
            arg_mbs=[(inputs,) for inputs, _ in wrapped] if has_first else None,
            kwarg_mbs=[{} for _ in wrapped],
            target_mbs=[targets for _, targets in wrapped] if has_last else None,
            losses=stage_losses,
        )
    else:
        schedule.step(
            tokens[:, :-1] if has_first else None,
            target=tokens[:, 1:] if has_last else None,
            losses=stage_losses,
        )
    total = torch.tensor(float(sum(_local(loss).item() for loss in stage_losses or [])))
    dist.all_reduce(total)  # the last stage's tp ranks each hold their dp rank's sum
    return total.item() / case.tp * case.loss_tokens / case.tokens


def _local(loss: torch.Tensor) -> torch.Tensor:
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _reference(case: Case, optim: str):
    model = one_process(LAYERS)
    opt = _optimizer(optim, model.parameters())
    losses = []
    for step in range(STEPS):
        total = 0.0
        for dp_rank in range(case.dp_shard):
            tokens = _batch(step, dp_rank)
            logits = model(tokens[:, :-1]).flatten(0, 1).float()
            loss = F.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="sum") / case.tokens
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, dict(model.named_parameters())


def _rank_pipeline(rank: int, world: int, case: Case, optim: str) -> None:
    plain = one_process(LAYERS)
    runs = {name: _train(shard, case, optim, plain) for name, shard in ENGINES}
    losses, weights = _reference(case, optim)
    for name, (got_losses, _, got_weights) in runs.items():
        torch.testing.assert_close(got_losses, losses, rtol=RTOL, atol=ATOL, msg=f"{name} loss")
        for key, value in got_weights.items():
            torch.testing.assert_close(value, weights[key], rtol=RTOL, atol=1e-5, msg=key)
    torch.testing.assert_close(runs["mf"][1], runs["torch"][1], rtol=RTOL, atol=ATOL)
    assert losses[0] != losses[-1]
    moved = [
        key for key in runs["mf"][2] if not torch.equal(weights[key], plain.get_parameter(key))
    ]
    assert moved, "the model did not train"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("case", "optim"),
    [
        pytest.param(Case(2, 2, 1, "1F1B", mean=True), "sgd", id="pp2-fsdp2-1f1b-sgd-mean"),
        pytest.param(Case(2, 2, 1, "Interleaved1F1B"), "adamw", id="pp2-fsdp2-interleaved-adamw"),
        pytest.param(Case(2, 1, 2, "GPipe"), "sgd", id="pp2-tp2-gpipe-sgd"),
        pytest.param(Case(2, 2, 2, "1F1B"), "sgd", id="pp2-fsdp2-tp2-1f1b-sgd"),
        pytest.param(
            Case(2, 2, 1, "1F1B", backend="spmd_types"), "adamw", id="default-pp2-fsdp2-1f1b-adamw"
        ),
        pytest.param(
            Case(2, 2, 1, "1F1B", backend="full_dtensor"), "sgd", id="fulldt-pp2-fsdp2-1f1b-sgd"
        ),
        pytest.param(Case(2, 2, 1, "ZBVZeroBubble"), "sgd", id="pp2-fsdp2-zbv-sgd"),
        pytest.param(
            Case(2, 2, 1, "InterleavedZeroBubble"), "adamw", id="pp2-fsdp2-interleaved-zb-adamw"
        ),
        pytest.param(Case(2, 2, 1, "DualPipeV"), "sgd", id="pp2-fsdp2-dualpipev-sgd"),
    ],
)
def test_torchtitan_pipeline_trains_as_torch_fsdp2_and_one_process(case: Case, optim: str) -> None:
    run_on_ranks(_rank_pipeline, case.world, case, optim, timeout=380)


def _fsdp_only(shard, world: int):
    """The same model through torchtitan's ``parallelize_llama`` alone: FSDP over every rank."""
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    with torch.device("meta"):
        model = model_config(LAYERS).build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ):
        dims.build_mesh()
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(enable=False, components=["model"]),
            ac_config=None,
            dump_folder="unused",
        )
    force_sum(model, shard)
    return _initialised(model, seed=1)  # other weights than the checkpoint's


def _rank_dcp(rank: int, world: int, path: str) -> None:
    """PP x FSDP x TP saves with DCP; FSDP-only runs on mf and torch's FSDP2 load it."""
    case = Case(2, 2, 2, "1F1B")
    dims, schedule, parts, has_first, has_last = pipelined(fsdp2.fully_shard, case)
    _start_from(parts, one_process(LAYERS), fsdp2.fully_shard)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.5)
    dp_rank = dims.get_mesh("batch").get_local_rank()
    _pp_step(schedule, _batch(0, dp_rank), has_first, has_last, case)
    opt.step()
    opt.zero_grad()
    dcp.save({k: v for part in parts for k, v in part.state_dict().items()}, checkpoint_id=path)
    expected = _pp_step(schedule, _batch(1, dp_rank), has_first, has_last, case)

    tokens = torch.cat([_batch(1, r) for r in range(case.dp_shard)])  # the global batch
    mine = tokens[rank * len(tokens) // world : (rank + 1) * len(tokens) // world]
    for name, shard in ENGINES:
        model = _fsdp_only(shard, world)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)
        logits = full(model(mine[:, :-1])).flatten(0, 1).float()
        loss = F.cross_entropy(logits, mine[:, 1:].flatten(), reduction="sum") / case.tokens
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total.item(), expected, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_pipeline_checkpoint_loads_into_fsdp_only_runs(tmp_path) -> None:
    """DCP across pipeline configurations: the next step's loss is the pipeline's."""
    run_on_ranks(_rank_dcp, 8, str(tmp_path / "ckpt"), timeout=380)


def _bucket_storages(engine) -> set[int]:
    """Every storage held by ``engine``'s buckets: weights (shard, gathered, main) and grads."""
    return {
        value.untyped_storage()._cdata
        for bucket in engine.groups
        for holder in (bucket.weights, bucket.buffers)
        for value in vars(holder).values()
        if isinstance(value, torch.Tensor)
    }


def _rank_once_per_step(rank: int, world: int) -> None:
    """Two stage roots per rank: distinct engines and buckets, one reduction per bucket a step."""
    case = Case(2, 2, 1, "Interleaved1F1B")
    dims, schedule, parts, has_first, has_last = pipelined(fsdp2.fully_shard, case)
    _start_from(parts, one_process(LAYERS), fsdp2.fully_shard)
    engines = [record_of(part).engine for part in parts]  # built by the load
    assert len(parts) == 2
    assert engines[0] is not engines[1], "the stage roots share an engine"
    storages = [_bucket_storages(engine) for engine in engines]
    assert not storages[0] & storages[1], "the stage roots share bucket storage"
    dp_rank = dims.get_mesh("batch").get_local_rank()
    _pp_step(schedule, _batch(0, dp_rank), has_first, has_last, case)  # torch's shape inference
    with count_collectives() as counts:
        _pp_step(schedule, _batch(1, dp_rank), has_first, has_last, case)
    buckets = sum(len(engine.groups) for engine in engines)
    microbatches = LOCAL_BATCH  # one sequence each
    assert counts == {
        "reduce_scatter_into": buckets,
        "all_reduce": 0,
        "all_gather_into": buckets,
    }, f"one step of {microbatches} micro-batches over {buckets} buckets: {counts}"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_looped_stages_own_their_buckets_and_reduce_once_per_step() -> None:
    """Interleaved1F1B's two roots per rank: their own buckets; no reduction per micro-batch."""
    run_on_ranks(_rank_once_per_step, 4, timeout=180)

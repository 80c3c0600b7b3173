"""Tensor parallelism x FSDP on a (dp=2, tp=2) mesh of 4 ranks, against one process.

Two TP flavours of the same tiny LM (embedding -> 2 x [LayerNorm, column
linear, GeLU, row linear, residual] -> LayerNorm -> LM head -> cross entropy):

- mf-tp layers (VocabParallelEmbedding, Column/RowParallelLinear,
  vocab_parallel_cross_entropy), recognised by the engine through the
  attribute protocol;
- the plain model parallelised by torch's ``parallelize_module``
  (ColwiseParallel / RowwiseParallel), whose parameters are DTensors.

Both load their TP shards from one plain model; the reference trains that
plain model in one process on the global batch (each dp rank's batch, both TP
ranks of a dp rank see the same one). Every rank compares the losses and its
own TP shard of every parameter (duplicated ones included, so they are equal
on all TP ranks) at 1e-5 relative after 10 steps, with SGD (a wrong gradient
scale shows at O(1)) and Adam, with 1 and 4 accumulated micro-batches.
``get_grad_norm`` / ``clip_grad_norm_`` are checked against
``torch.nn.utils`` on the reference (norm 2 and inf), with one all-reduce
per mesh dim. Also covered: sequence parallelism (norm weights marked
``sequence_parallel``; ZeRO-0/1 accumulating on top of reduced grads), an
HSDP-shaped (dp_outer=1, dp, tp) mesh, bf16 compute with DTensor TP, the
sharded parameters' full shapes and tp placements, and the bad inputs the
engine refuses. Parameters are compared through ``full_tensor()`` of the
sharded, tp-gathered parameters.

Per-rank CPU time (4 ranks): about 2.5 s, 6 s and 6 s for the three tests.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import mf_fsdp
import mf_tp
from mf_dtensor import UnevenDTensor
from mf_utils import get_mcore_tensor_parallel_partition_dim
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import full_params, make_optimizer
from tests.fsdp.engine.test_accumulation import count_collectives

V, H, FFN, LAYERS = 32, 16, 32, 2
BATCH, SEQ = 2, 8
DP, TP = 2, 2
STEPS, MICRO = 10, 4
RTOL, ATOL = 1e-5, 1e-6
CLIP = 0.5


class Block(nn.Module):
    """Pre-norm MLP block with a residual (the FSDP unit of the plain / DTensor model)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks, final norm, LM head; returns the mean token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


class TPBlock(nn.Module):
    """``Block`` with mf-tp column/row-parallel linears."""

    def __init__(self, config: mf_tp.ModelParallelConfig, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.norm = _norm(config.sequence_parallel)
        self.fc1 = mf_tp.ColumnParallelLinear(
            H, FFN, config=config, init_method=nn.init.zeros_, tp_group=group
        )
        self.fc2 = mf_tp.RowParallelLinear(
            FFN,
            H,
            config=config,
            init_method=nn.init.zeros_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))[0]))[0]


class TPLM(nn.Module):
    """``TinyLM`` with a vocab-parallel embedding, LM head and cross entropy.

    With ``sequence_parallel`` activations between the TP layers are ``[S/t, B, H]``
    and the norms' parameters are marked ``sequence_parallel=True`` (their grads
    cover this rank's rows only), as Megatron marks them.
    """

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool = False) -> None:
        super().__init__()
        config = mf_tp.ModelParallelConfig(
            tensor_model_parallel_size=dist.get_world_size(group),
            sequence_parallel=sequence_parallel,
            use_cpu_initialization=True,
        )
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.embed = mf_tp.VocabParallelEmbedding(
            V,
            H,
            init_method=nn.init.zeros_,
            config=config,
            reduce_scatter_embeddings=sequence_parallel,
            tp_group=group,
        )
        self.blocks = nn.ModuleList(TPBlock(config, group) for _ in range(LAYERS))
        self.norm = _norm(sequence_parallel)
        self.head = mf_tp.ColumnParallelLinear(
            H, V, config=config, init_method=nn.init.zeros_, bias=False, tp_group=group
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits, _ = self.head(self.norm(x))
        if self.sequence_parallel:
            targets = targets.t()  # logits are [S, B, V/t]
        return mf_tp.vocab_parallel_cross_entropy(logits, targets, group=self.group).mean()


def _norm(sequence_parallel: bool) -> nn.LayerNorm:
    norm = nn.LayerNorm(H)
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel
    return norm


def reference_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def mf_tp_model(tp_mesh, sequence_parallel: bool = False) -> TPLM:
    """The mf-tp model holding this TP rank's shards of ``reference_model()``."""
    model = TPLM(tp_mesh.get_group(), sequence_parallel)
    full = dict(reference_model().named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_tp_slice(full[name], param, tp_mesh))
    return model


def dtensor_model(tp_mesh) -> TinyLM:
    """``reference_model()`` parallelised by torch's DTensor TP on ``tp_mesh``."""
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return parallelize_module(reference_model(), tp_mesh, plan)


def _tp_slice(full: torch.Tensor, param: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's part of ``full`` for a parameter laid out like ``param``."""
    if isinstance(param, DTensor):
        placement = param.placements[0]
        dim = placement.dim if isinstance(placement, Shard) else None
    else:
        dim = get_mcore_tensor_parallel_partition_dim(param)
    if dim is None:
        return full
    return full.chunk(tp_mesh.size(), dim)[tp_mesh.get_local_rank()]


def batch(step: int, dp_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + micro)
    tokens = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_run(opt_name: str, micro: int, clip: float | None = None):
    """Losses, final parameters and the step-0 grad norms (2, inf) of one process."""
    model = reference_model()
    opt = make_optimizer(opt_name, model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for m in range(micro):
            for r in range(DP):
                loss = model(*batch(step, r, m)) / (DP * micro)
                loss.backward()
                total += loss.item()
        if step == 0:
            grads = [p.grad for p in model.parameters()]
            norms = [torch.nn.utils.get_total_norm(grads, n).item() for n in (2.0, math.inf)]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _train(
    model,
    opt,
    mesh,
    micro: int,
    clip: float | None = None,
    no_sync: bool = True,
    steps: range = range(STEPS),
):
    """Train ``steps``; return the losses and the step-0 grad norms (2, inf; [] without step 0)."""
    # Grad norm: one all-reduce per norm and group the grads are sharded over (tp; dp
    # unless ZeRO-0; dp_outer too under hybrid-sharded HSDP).
    hybrid = model.ddp_config.outer_dp_sharding_strategy is mf_fsdp.ZeroDPStrategy.OPTIM
    expected = 2 * (1 if model.strategy.level == 0 else 2 + hybrid)
    dp_rank = mesh.get_local_rank("dp")
    losses, norms = [], []
    for step in steps:
        total = torch.zeros(())
        for m in range(micro):
            quiet = no_sync and m < micro - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = model(*batch(step, dp_rank, m)) / micro
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        if step == 0:
            with count_collectives() as counts:
                norms = [mf_fsdp.get_grad_norm(model, n).item() for n in (2.0, math.inf)]
            assert counts["all_reduce"] == expected, counts
        if clip is not None:
            mf_fsdp.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / DP)
    return losses, norms


def _check(model, mesh, result, ref, label: str) -> None:
    losses, norms = result
    ref_losses, ref_params, ref_norms = ref
    close = dict(rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), **close, msg=lambda m: f"{label} loss {m}"
    )
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(ref_norms), **close, msg=lambda m: f"{label} norm {m}"
    )
    params = full_params(model)  # the sharded parameters' full_tensor(): tp-gathered
    for name, value in ref_params.items():
        torch.testing.assert_close(
            params[name], value, **close, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


def _parity(mesh, build, unit, strategies, optimizers, micros, clip=3, no_sync=True) -> None:
    """Every (optimizer, micro, strategy) against one process; then a clipped SGD run.

    ``clip``: the strategy of the clipped run (None: no clipped run).
    """
    for opt_name in optimizers:
        for micro in micros:
            ref = reference_run(opt_name, micro)
            for strategy in strategies:
                model, opt = _wrap(build, mesh, unit, opt_name, zero_dp_strategy=strategy)
                label = f"{_name(build)} z{strategy} {opt_name} micro={micro} no_sync={no_sync}"
                result = _train(model, opt, mesh, micro, no_sync=no_sync)
                _check(model, mesh, result, ref, label)
    if clip is not None:  # SGD exposes a wrong clipping coefficient
        ref = reference_run("sgd", 1, clip=CLIP)
        model, opt = _wrap(build, mesh, unit, "sgd", zero_dp_strategy=clip)
        _check(model, mesh, _train(model, opt, mesh, 1, clip=CLIP), ref, f"{_name(build)} clip")
        _check_tp_placements(model)


def _name(build) -> str:
    return getattr(build, "__name__", "mf_tp_model(sequence_parallel=True)")


def _wrap(build, mesh, unit, opt_name: str, **kwargs):
    module = build(mesh["tp"])
    opt = make_optimizer(opt_name, module.parameters())
    return mf_fsdp.fully_shard(
        module,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp",
        tp_dim="tp",
        fsdp_unit_modules=[unit],
        **kwargs,
    )


def _check_tp_placements(model) -> None:
    """Sharded parameters have the full (tp-gathered) shape and carry their tp placement."""
    params = dict(model.named_parameters())
    dp = Replicate() if model.strategy.level == 0 else Shard(0)
    for name, shape, tp in (
        ("blocks.0.fc1.weight", (FFN, H), Shard(0)),
        ("blocks.0.fc2.weight", (H, FFN), Shard(1)),
        ("blocks.0.fc2.bias", (H,), Replicate()),
        ("blocks.0.norm.weight", (H,), Replicate()),
    ):
        param = params[name]
        assert isinstance(param, UnevenDTensor), name
        assert param.shape == shape, (name, param.shape)
        assert param.placements == (dp, tp), (name, param.placements)


def _rank_mf_tp(rank: int, world: int, micros: list[int]) -> None:
    mesh = cpu_mesh((DP, TP), ("dp", "tp"))
    _parity(mesh, mf_tp_model, TPBlock, [0, 1, 2, 3], ["sgd", "adam"], micros)
    if micros == [1]:  # an HSDP-shaped (dp_outer=1, dp, tp) mesh trains the same
        hsdp = cpu_mesh((1, DP, TP), ("dp_outer", "dp", "tp"))
        model, opt = _wrap(mf_tp_model, hsdp, TPBlock, "sgd", dp_outer_dim="dp_outer")
        result = _train(model, opt, hsdp, 1)
        _check(model, hsdp, result, reference_run("sgd", 1), "dp_outer x dp x tp")
    # Sequence parallelism; without no_sync ZeRO-0/1 accumulate on top of reduced grads.
    sequence_parallel = functools.partial(mf_tp_model, sequence_parallel=True)
    _parity(mesh, sequence_parallel, TPBlock, [0, 1, 2, 3], ["sgd"], micros, None, False)


def _rank_dtensor(rank: int, world: int) -> None:
    mesh = cpu_mesh((DP, TP), ("dp", "tp"))
    _bad_input(mesh)
    # Without FSDP: a DTensor TP model's own params (Shard, Replicate and plain grads).
    reference, model = reference_model(), dtensor_model(mesh["tp"])
    for module in (reference, model):
        module(*batch(0, 0, 0)).backward()
    for norm_type in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters()], norm_type
        )
        with count_collectives() as counts:
            norm = mf_fsdp.get_grad_norm(model.parameters(), norm_type)
        torch.testing.assert_close(norm, expected, rtol=RTOL, atol=ATOL)
        assert counts["all_reduce"] == 1
    # The clipped run uses ZeRO-0: DTensor params are sharded over tp only there.
    _parity(mesh, dtensor_model, Block, [3, 1], ["sgd", "adam"], [1, MICRO], clip=0)
    # bf16 compute, fp32 main weights: DTensor params turn bf16 with their buffers.
    fp32_losses = reference_run("adam", 1)[0]
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy in (3, 0):
        model, opt = _wrap(
            dtensor_model,
            mesh,
            Block,
            "adam",
            zero_dp_strategy=strategy,
            mixed_precision_policy=policy,
        )
        # Between passes the module holds the fp32 sharded parameter; forward runs on
        # the bf16 compute parameter (a DTensor over the gathered buffer).
        (fc1,) = (fp for fp in model.fsdp_params if fp.fqn == "blocks.0.fc1.weight")
        assert model.module.blocks[0].fc1.weight is fc1.sharded
        assert fc1.sharded.dtype is torch.float32
        assert fc1.compute.dtype is torch.bfloat16
        assert fc1.compute.to_local().dtype is torch.bfloat16
        losses, _ = _train(model, opt, mesh, 1)
        # As in test_features: within 2% of fp32 over 10 Adam steps.
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(fp32_losses), rtol=2e-2, atol=0
        )


def _bad_input(mesh) -> None:
    def wrap(module, **kwargs):
        kwargs = {"device_mesh": mesh, "dp_shard_dim": "dp", "tp_dim": "tp", **kwargs}
        return mf_fsdp.fully_shard_model(module, **kwargs)

    with pytest.raises(ValueError, match=r"tp_dim='model' is not a dim of the mesh"):
        wrap(reference_model(), tp_dim="model")
    with pytest.raises(ValueError, match=r"tp_dim='dp' is also a data-parallel dim"):
        wrap(reference_model(), tp_dim="dp")
    with pytest.raises(ValueError, match=r"tp_dim=None but parameter 'embed.weight'"):
        wrap(dtensor_model(mesh["tp"]), tp_dim=None)
    with pytest.raises(ValueError, match=r"'embed.weight' .* lives on a mesh over ranks"):
        wrap(dtensor_model(mesh["dp"]))
    marked = reference_model()
    marked.norm.weight.sequence_parallel = True
    with pytest.raises(ValueError, match=r"tp_dim=None but parameter 'norm.weight' is marked"):
        wrap(marked, tp_dim=None)
    two_d = reference_model()
    two_d.head.weight = nn.Parameter(
        distribute_tensor(two_d.head.weight, mesh, [Shard(0), Shard(1)])
    )
    with pytest.raises(ValueError, match=r"'head.weight' .* expected one placement"):
        wrap(two_d)
    partial = reference_model()
    weight = partial.head.weight.detach()
    partial.head.weight = nn.Parameter(DTensor.from_local(weight, mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match=r"'head.weight' .* expected a Shard\(dim\) or Replicate"):
        wrap(partial)
    with torch.device("meta"):
        meta = TinyLM()
    parallelize_module(meta, mesh["tp"], {"head": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"init_model_with_meta_device: parameter 'head.weight'"):
        wrap(meta, init_model_with_meta_device=True)


@pytest.mark.multiprocess
def test_mf_tp_layers_no_accumulation() -> None:
    run_on_ranks(_rank_mf_tp, DP * TP, [1], timeout=240)


@pytest.mark.multiprocess
def test_mf_tp_layers_accumulation() -> None:
    run_on_ranks(_rank_mf_tp, DP * TP, [MICRO], timeout=240)


@pytest.mark.multiprocess
def test_dtensor_tp_and_bad_input() -> None:
    run_on_ranks(_rank_dtensor, DP * TP, timeout=240)

"""Ranks that take different paths (issue 31): a unit skipped on some ranks trains exactly.

Each rank skips the blocks (FSDP units) and the root's position embedding its
plan names for a step and micro-batch; one process trains the same plan on
the global batch, where a skipped unit adds nothing from that rank and a
parameter no rank used keeps ``grad=None`` (Adam then leaves it alone). Every
ZeRO strategy, HSDP and TP x FSDP (tp 2 x dp_shard 2: the plan is per dp rank,
both TP ranks of a dp rank compute one batch) must match it at fp32 rounding,
and every rank must issue the same engine collectives in the same order, sizes
included, whatever it skipped (under TP the ranks of a TP group too: the tiny
GPT splits evenly). Ranks that run units in orders the engine cannot
reconcile stop on every rank with one ``UnitOrderError`` naming the rank, the
unit and the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import mf_fsdp
import mf_tp
from mf.models import GPT, GPTTensorParallel, TensorParallelBlock
from mf.models.gpt import Block
from mf_fsdp.buckets import collectives
from mf_fsdp.engine.unit_order import merge_chains
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    assert_matches_reference,
    batch,
    full_params,
    make_optimizer,
    reference_run,
    unit_classes,
)

RTOL, ATOL = 1e-7, 1e-9
STEPS = 4
BLOCKS = 3
Plan = dict[tuple[int, int, int], frozenset]
"""(step, rank, micro-batch) -> what that rank skips: block indices, ``("mlp", i)`` (block
i's MLP; plain GPT only) and "wpe" (a root parameter); or runs more often: ``("twice", i)``
(block i twice in a row), ``("again", i)`` (block i once more after the last block); or
calls the blocks in another order: ``("order", (2, 0, 1))``. Absent keys change nothing.
Under TP the rank is the dp rank."""


class SkippingBlock(Block):
    """A block that can leave out its MLP (its parameters then get no gradient from it)."""

    def forward(self, x: torch.Tensor, mlp: bool = True) -> torch.Tensor:  # type: ignore[override]
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)))) if mlp else x


class _Skipping:
    """A GPT forward that skips blocks, a block's MLP or the position embedding on request.

    Mixed into the plain GPT and the tensor-parallel one, which differ only in
    ``loss`` (their LM head and cross entropy).
    """

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        skip: frozenset = frozenset(),
        order: tuple[int, ...] | None = None,
        recompute: bool = False,
    ) -> torch.Tensor:
        x = self.wte(tokens)
        if order is None:
            order = next((e[1] for e in skip if isinstance(e, tuple) and e[0] == "order"), None)
        if "wpe" not in skip:
            x = x + self.wpe(torch.arange(tokens.shape[1]))
        for index in range(len(self.blocks)) if order is None else order:
            if index in skip:
                continue
            if recompute:  # activation checkpointing: the block runs again in backward
                x = checkpoint(self.blocks[index], x, use_reentrant=False)
            elif ("mlp", index) in skip:
                x = self.blocks[index](x, mlp=False)
            else:
                x = self.blocks[index](x)
            if ("twice", index) in skip:  # applied twice in a row (shared weights)
                x = self.blocks[index](x)
        for index in sorted(
            i for kind, i in (e for e in skip if isinstance(e, tuple)) if kind == "again"
        ):
            x = self.blocks[index](x)  # once more after the others (ZeRO-0/1 only)
        return self.loss(self.ln_f(x), targets)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SkippingGPT(_Skipping, GPT):
    """The tiny GPT whose forward skips blocks (or their MLPs, or the position embedding)."""

    def __init__(self, config) -> None:
        super().__init__(config, block=SkippingBlock)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _cross_entropy(self.lm_head(x), targets)


class SkippingGPTTensorParallel(_Skipping, GPTTensorParallel):
    """``SkippingGPT`` split over a TP group.

    The loss gathers the vocab-parallel logits into the plain cross entropy:
    ``vocab_parallel_cross_entropy`` computes in fp32 (as Megatron's), which
    rounds this file's fp64 runs off by more than its tolerance.
    """

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head_weight = self.wte.weight if self.config.tie_embeddings else None
        logits, _ = self.lm_head(x, weight=head_weight)
        return _cross_entropy(
            mf_tp.gather_from_tensor_model_parallel_region(logits, self.tp_group), targets
        )


def make_skipping(tp_group: dist.ProcessGroup | None = None, blocks: int = BLOCKS) -> nn.Module:
    """The skipping GPT; with ``tp_group`` split over it, holding the same weights."""
    torch.manual_seed(0)
    plain = SkippingGPT(dataclasses.replace(CONFIG, n_layers=blocks))
    if tp_group is None:
        return plain
    # mf-tp layers allocate fp32: follow the default dtype (fp64 here) before loading.
    model = SkippingGPTTensorParallel(plain.config, tp_group).to(torch.get_default_dtype())
    model.load_full_weights(plain.state_dict())
    return model


def reference(plan: Plan, opt: str, world: int, micro: int = 1, blocks: int = BLOCKS):
    """One process on the global batch, each rank's share skipping what ``plan`` says."""
    return reference_run(
        opt,
        world,
        STEPS,
        micro=micro,
        make=lambda: make_skipping(blocks=blocks),
        call_kwargs=lambda step, rank, m: {"skip": plan.get((step, rank, m), frozenset())},
    )


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, int, str]]]:
    """Record every engine collective call on this rank: (name, elements, dtype)."""
    calls: list[tuple[str, int, str]] = []
    names = ("all_reduce", "reduce_scatter_into", "all_gather_into")
    originals = {name: getattr(collectives, name) for name in names}

    def wrap(name):
        signature = inspect.signature(originals[name])

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensor = next(v for v in bound.values() if isinstance(v, torch.Tensor))
            calls.append((name, tensor.numel(), str(tensor.dtype)))
            return originals[name](*args, **kwargs)

        return recorded

    for name in names:
        setattr(collectives, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def _train(
    model, opt, data_rank: int, world: int, plan: Plan, micro: int = 1, recompute: bool = False
) -> list[float]:
    """Train on ``data_rank``'s batches and skips; return the losses averaged over ranks.

    The average is over all ``world`` ranks: the TP ranks of a data rank hold its loss.
    """
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(micro):
            tokens, targets = batch(step, data_rank, m)
            quiet = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with quiet:
                skip = plan.get((step, data_rank, m), frozenset())
                loss = model(tokens, targets, skip=skip, recompute=recompute) / micro
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    return losses


def _same_on_every_rank(calls: list[tuple[str, int, str]], label: str) -> None:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, calls)
    for rank, theirs in enumerate(everyone):
        assert theirs == everyone[0], f"{label}: rank {rank} issued other collectives than rank 0"


def _check_runs(rank: int, world: int, runs: list[tuple[str, dict, str, Plan, int]]) -> None:
    """Train each run (label, fully_shard kwargs, optimizer, plan, micro) against one process.

    A kwargs entry ``recompute=True`` runs the blocks under activation checkpointing;
    ``blocks=N`` gives the GPT N blocks (``BLOCKS`` by default);
    ``mesh=(shape, names)`` builds the device mesh. With a ``tp_dim`` the model is the
    tensor-parallel GPT on that dim, and the plan's ranks are the ``dp_shard_dim`` ranks
    (both TP ranks of a dp rank compute one batch, so they take one path).
    """
    # fp64: Adam divides by the grads' magnitude, so the rounding noise of a grad that is
    # zero in exact arithmetic (the key bias's) would decide the result in fp32.
    torch.set_default_dtype(torch.float64)
    fp64 = mf_fsdp.MixedPrecisionPolicy(main_params_dtype=None)
    refs: dict[str, tuple] = {}
    for label, kwargs, opt_name, plan, micro in runs:
        kwargs = dict(kwargs)
        recompute = kwargs.pop("recompute", False)
        blocks = kwargs.pop("blocks", BLOCKS)
        data_rank, data_world, tp_group, units = rank, world, None, unit_classes()
        if "mesh" in kwargs:
            mesh = kwargs["device_mesh"] = cpu_mesh(*kwargs.pop("mesh"))
            if "tp_dim" in kwargs:
                data_rank = mesh.get_local_rank(kwargs["dp_shard_dim"])
                data_world = mesh.size(mesh.mesh_dim_names.index(kwargs["dp_shard_dim"]))
                tp_group, units = mesh.get_group(kwargs["tp_dim"]), [TensorParallelBlock]
        key = repr((sorted(plan.items(), key=repr), opt_name, data_world, micro, blocks))
        if key not in refs:
            refs[key] = reference(plan, opt_name, data_world, micro, blocks)
        ref = refs[key]
        module = make_skipping(tp_group, blocks)
        model, opt = mf_fsdp.fully_shard(
            module,
            make_optimizer(opt_name, module.parameters()),
            fsdp_unit_modules=units,
            mixed_precision_policy=fp64,
            **kwargs,
        )
        with record_collectives() as calls:
            losses = _train(model, opt, data_rank, world, plan, micro, recompute)
        _same_on_every_rank(calls, label)
        assert_matches_reference(losses, full_params(model), *ref, label, RTOL, ATOL)


ONE_SKIP: Plan = {(1, 1, 0): frozenset({1})}
DIFFERENT: Plan = {
    (1, 0, 0): frozenset({0}),
    (1, 1, 0): frozenset({2}),
    (2, 0, 0): frozenset({1, 2}),
    (2, 1, 0): frozenset({0}),
}
ROOT_UNUSED: Plan = {(1, 1, 0): frozenset({"wpe"}), (2, 0, 0): frozenset({"wpe", 0})}
EVERY_RANK: Plan = {  # block 1 in step 1 and block 2 in step 2 run nowhere: Adam skips them
    (1, 0, 0): frozenset({1}),
    (1, 1, 0): frozenset({1}),
    (2, 0, 0): frozenset({0, 2}),
    (2, 1, 0): frozenset({2}),
    (3, 0, 0): frozenset({0, 1, 2}),
    (3, 1, 0): frozenset({0, 1, 2}),
}
NO_SYNC: Plan = {  # micro-batch 0 runs under no_sync
    (1, 1, 0): frozenset({1}),
    (2, 0, 0): frozenset({0}),
    (2, 1, 1): frozenset({2}),
    (3, 0, 0): frozenset({1, 2}),  # block 1: skipped by all in micro-batch 0, used in 1
    (3, 1, 0): frozenset({1, 2}),
    (3, 0, 1): frozenset({2}),  # block 2: run nowhere in step 3
    (3, 1, 1): frozenset({2}),
}
CASES = {"one": ONE_SKIP, "different": DIFFERENT, "root": ROOT_UNUSED, "every": EVERY_RANK}


@pytest.mark.multiprocess
def test_skipped_units_train_exactly_at_world_2() -> None:
    runs = []
    for name, plan in CASES.items():
        for opt_name in ("sgd", "adam"):
            for strategy in range(4):
                kwargs = {"zero_dp_strategy": strategy}
                runs.append((f"{name} {opt_name} z{strategy}", kwargs, opt_name, plan, 1))
    for strategy in (0, 3):  # activation checkpointing: the recomputation reuses the gather
        kwargs = {"zero_dp_strategy": strategy, "recompute": True}
        runs.append((f"recompute z{strategy}", kwargs, "adam", DIFFERENT, 1))
    run_on_ranks(_check_runs, 2, runs, timeout=240)


# 8 blocks, a window of about 4: ZeRO-3 prefetches in chunks of half a window (see
# [Note: communication window]), deciding from which units are released, which the
# skipped units' stand-ins keep equal on every rank.
CHUNKED: Plan = {
    (1, 0, 0): frozenset({2, 5}),
    (1, 1, 0): frozenset({3}),
    (2, 0, 0): frozenset({0, 1, 6, 7}),
    (2, 1, 0): frozenset({4}),
    (3, 1, 0): frozenset({"wpe", 5, 6, 7}),
}


@pytest.mark.multiprocess
def test_skipped_units_prefetched_in_chunks_train_exactly() -> None:
    block = sum(p.numel() for p in make_skipping(blocks=8).blocks[0].parameters())
    window = 4 * block + 512  # room for each block's alignment padding
    runs = [
        (
            f"chunked {opt_name}{' recompute' * recompute}",
            {
                "zero_dp_strategy": 3,
                "blocks": 8,
                "suggested_communication_unit_size": window,
                "recompute": recompute,
            },
            opt_name,
            CHUNKED,
            1,
        )
        for opt_name, recompute in (("sgd", False), ("adam", False), ("adam", True))
    ]
    run_on_ranks(_check_runs, 2, runs, timeout=240)


@pytest.mark.multiprocess
def test_skips_inside_no_sync_accumulation() -> None:
    runs = []
    for opt_name in ("sgd", "adam"):
        for strategy in range(4):
            kwargs = {"zero_dp_strategy": strategy}
            runs.append((f"no_sync {opt_name} z{strategy}", kwargs, opt_name, NO_SYNC, 2))
    run_on_ranks(_check_runs, 2, runs, timeout=180)


UNUSED_PARAMS: Plan = {  # parameters inside units that ran, and in the root, used nowhere
    (1, 0, 0): frozenset({"wpe"}),
    (1, 1, 0): frozenset({"wpe", ("mlp", 1)}),
    (2, 0, 0): frozenset({("mlp", 1), ("mlp", 2)}),
    (2, 1, 0): frozenset({0, ("mlp", 1)}),
    (3, 1, 0): frozenset({("mlp", 0)}),  # used on rank 0: a gradient from there alone
}
UNUSED_IN_NO_SYNC: Plan = {  # micro-batch 0 runs under no_sync
    (1, 0, 0): frozenset({("mlp", 1)}),
    (1, 1, 0): frozenset({("mlp", 1)}),  # used in micro-batch 1 only
    (2, 0, 0): frozenset({"wpe"}),
    (2, 1, 0): frozenset({"wpe"}),
    (2, 0, 1): frozenset({"wpe"}),
    (2, 1, 1): frozenset({"wpe"}),  # used nowhere in step 2
}


@pytest.mark.multiprocess
def test_parameters_no_rank_used_get_no_grad() -> None:
    """``find_unused_parameters``: per parameter, as DDP's option and one process."""
    runs = []
    for opt_name in ("sgd", "adam"):
        for strategy in range(4):
            kwargs = {"zero_dp_strategy": strategy, "find_unused_parameters": True}
            runs.append((f"unused {opt_name} z{strategy}", kwargs, opt_name, UNUSED_PARAMS, 1))
    for strategy in (0, 3):
        kwargs = {"zero_dp_strategy": strategy, "find_unused_parameters": True}
        runs.append((f"unused no_sync z{strategy}", kwargs, "adam", UNUSED_IN_NO_SYNC, 2))
    run_on_ranks(_check_runs, 2, runs, timeout=240)


@pytest.mark.multiprocess
def test_parameters_unused_at_world_1_get_no_grad() -> None:
    """World 1, where ZeRO-2/3 reduce the grads where autograd put them (one buffer):
    a parameter the backward did not reach still gets no grad, within and across
    micro-batches (the plans' rank-0 entries)."""
    runs = []
    for strategy in (1, 2, 3):
        kwargs = {"zero_dp_strategy": strategy, "find_unused_parameters": True}
        runs.append((f"unused adam z{strategy}", kwargs, "adam", UNUSED_PARAMS, 1))
        runs.append((f"unused no_sync z{strategy}", kwargs, "adam", UNUSED_IN_NO_SYNC, 2))
    run_on_ranks(_check_runs, 1, runs, timeout=240)


HSDP_PLAN: Plan = {  # one rank, different ranks, root, every rank, across both replicas
    (1, 3, 0): frozenset({1}),
    (2, 0, 0): frozenset({0, "wpe"}),
    (2, 2, 0): frozenset({2}),
    (3, 0, 0): frozenset({1}),
    (3, 1, 0): frozenset({1}),
    (3, 2, 0): frozenset({1, 0}),
    (3, 3, 0): frozenset({1}),
}

HSDP_UNUSED: Plan = {
    **{(1, rank, 0): frozenset({"wpe"}) for rank in range(4)},
    **{(2, rank, 0): frozenset({("mlp", 1), rank % 3}) for rank in range(4)},
}


@pytest.mark.multiprocess
def test_skipped_units_under_hsdp_at_world_4() -> None:
    mesh = ((2, 2), ("dp_outer", "dp_shard"))
    hsdp = {"mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    runs = []
    for opt_name in ("sgd", "adam"):
        for inner, outer in ((0, 0), (1, 0), (2, 0), (3, 0), (3, 1)):
            kwargs = {**hsdp, "zero_dp_strategy": inner, "outer_dp_sharding_strategy": outer}
            label = f"hsdp {opt_name} z{inner}/{outer}"
            runs.append((label, kwargs, opt_name, HSDP_PLAN, 1))
    for inner, outer in ((0, 0), (3, 1)):
        kwargs = {**hsdp, "zero_dp_strategy": inner, "outer_dp_sharding_strategy": outer}
        label = f"hsdp unused z{inner}/{outer}"
        unused = {**kwargs, "find_unused_parameters": True}
        runs.append((label, unused, "adam", HSDP_UNUSED, 1))
    run_on_ranks(_check_runs, 4, runs, timeout=300)


TP_PLAN: Plan = {  # per dp rank: different blocks, the root's wpe, block 1 nowhere in step 2
    (1, 0, 0): frozenset({0}),
    (1, 1, 0): frozenset({2, "wpe"}),
    (2, 0, 0): frozenset({1}),
    (2, 1, 0): frozenset({0, 1}),
    (3, 0, 0): frozenset({0, 1, 2}),
}


@pytest.mark.multiprocess
def test_skipped_units_with_tensor_parallelism_at_world_4() -> None:
    tp = {"mesh": ((2, 2), ("dp_shard", "tp")), "dp_shard_dim": "dp_shard", "tp_dim": "tp"}
    runs = []
    for opt_name in ("sgd", "adam"):
        for strategy in range(4):
            kwargs = {**tp, "zero_dp_strategy": strategy}
            runs.append((f"tp {opt_name} z{strategy}", kwargs, opt_name, TP_PLAN, 1))
    run_on_ranks(_check_runs, 4, runs, timeout=180)


_BLOCKS = st.frozensets(st.integers(0, BLOCKS - 1))
# The root's parameters always get a gradient (zero where no rank used them): "wpe"
# is skipped by rank 1 only, so some rank always uses it.
_PLANS = st.fixed_dictionaries(
    {},
    optional={
        **{(step, 0, 0): _BLOCKS for step in range(STEPS)},
        **{
            (step, 1, 0): _BLOCKS | st.just(frozenset({"wpe"})) | _BLOCKS.map(lambda b: b | {"wpe"})
            for step in range(STEPS)
        },
    },
)


@pytest.mark.multiprocess
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=_PLANS)
def test_any_skips_train_exactly(plan: Plan) -> None:
    runs = [(f"z{s}", {"zero_dp_strategy": s}, "adam", plan, 1) for s in (0, 3)]
    run_on_ranks(_check_runs, 2, runs, timeout=120)


def _skipping_model(strategy: int) -> tuple[mf_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    """The skipping model wrapped at ``strategy``, its blocks as units, with Adam."""
    module = make_skipping()
    return mf_fsdp.fully_shard(
        module,
        make_optimizer("adam", module.parameters()),
        fsdp_unit_modules=unit_classes(),
        zero_dp_strategy=strategy,
    )


def _rank_out_of_order(
    rank: int,
    world: int,
    strategy: int,
    order: tuple[int, ...],
    order0: tuple[int, ...] | None = None,
    expected: str = "rank 1, step 1: unit 'blocks.",
) -> None:
    """Rank 1 (and rank 0, given ``order0``) calls the blocks in ``order`` in step 1."""
    model, opt = _skipping_model(strategy)

    def train() -> None:
        for step in range(STEPS):
            tokens, targets = batch(step, rank, 0)
            path = {(1, 1): order, (1, 0): order0}.get((step, rank))
            model(tokens, targets, order=path).backward()
            opt.step()
            opt.zero_grad()

    with pytest.raises(mf_fsdp.UnitOrderError) as caught:
        train()
    message = str(caught.value)
    assert expected in message, message
    assert "\n" not in message


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "order"),
    [(0, (2, 1, 0)), (3, (2, 1, 0)), (2, (0, 1, 0, 2)), (3, (0, 1, 0, 2))],
    ids=["reversed-z0", "reversed-z3", "again-z2", "again-z3"],
)
def test_irreconcilable_orders_stop_every_rank(strategy: int, order: tuple[int, ...]) -> None:
    run_on_ranks(_rank_out_of_order, 2, strategy, order, timeout=60)


REPEATS: Plan = {  # ranks run a unit more often than others, with no collective of its own
    (1, 1, 0): frozenset({("twice", 1)}),
    (2, 0, 0): frozenset({("twice", 0), 2}),
    (3, 0, 0): frozenset({("twice", 2)}),
    (3, 1, 0): frozenset({("twice", 2), ("twice", 0)}),
}
AGAIN: Plan = {  # a unit run again after others: only where grads reduce at the end (ZeRO-0/1)
    (1, 1, 0): frozenset({("again", 0)}),
    (2, 0, 0): frozenset({("again", 1), 2}),
}


@pytest.mark.multiprocess
def test_units_run_again_while_gathered_train_exactly() -> None:
    """A unit may run again while it is gathered: at once (ZeRO 0-3), or after other units
    under ZeRO-0/1; the ranks may differ in how often."""
    runs = []
    for opt_name in ("sgd", "adam"):
        for strategy in range(4):
            kwargs = {"zero_dp_strategy": strategy}
            runs.append((f"twice {opt_name} z{strategy}", kwargs, opt_name, REPEATS, 1))
    for strategy in (0, 1):
        kwargs = {"zero_dp_strategy": strategy}
        runs.append((f"again z{strategy}", kwargs, "adam", AGAIN, 1))
    run_on_ranks(_check_runs, 2, runs, timeout=180)


def _ordered(order: tuple[int, ...], *skips) -> frozenset:
    return frozenset({("order", order), *skips})


REORDERED: Plan = {  # one order on every rank, not the registration order, changing
    **{(0, rank, 0): _ordered((2, 0, 1)) for rank in range(2)},  # learnt at the first step
    (1, 0, 0): _ordered((2, 0, 1), 2),  # skips in the learnt order
    (1, 1, 0): _ordered((2, 0, 1), 0, 1),
    **{(2, rank, 0): _ordered((1, 2, 0)) for rank in range(2)},  # changed on every rank
    (3, 0, 0): _ordered((0, 1, 2), 2),  # changed again, a rank skipping
    (3, 1, 0): _ordered((0, 1, 2)),
}
REORDERED_APART: Plan = {  # a change met at different units: rank 0 skips block 2
    **{(0, rank, 0): _ordered((2, 0, 1)) for rank in range(2)},
    (1, 0, 0): _ordered((1, 2, 0), 2),  # 1, then 0 (behind the walk): chain (1, 0)
    (1, 1, 0): _ordered((1, 2, 0)),  # 1, then 2 (behind the walk): chain (1, 2)
    (2, 0, 0): _ordered((1, 2, 0), 1),
    (2, 1, 0): _ordered((1, 2, 0)),
    **{(3, rank, 0): _ordered((1, 2, 0)) for rank in range(2)},
}


@pytest.mark.multiprocess
def test_one_order_on_every_rank_trains_exactly() -> None:
    """Units called in another order than registered, the same on every rank (also when it
    changes, and with ranks skipping different units of it): the ranks agree on it."""
    runs = []
    for opt_name in ("sgd", "adam"):
        for strategy in range(4):
            kwargs = {"zero_dp_strategy": strategy}
            runs.append((f"reordered {opt_name} z{strategy}", kwargs, opt_name, REORDERED, 1))
    for strategy in (2, 3):
        kwargs = {"zero_dp_strategy": strategy}
        runs.append((f"apart z{strategy}", kwargs, "adam", REORDERED_APART, 1))
    kwargs = {"zero_dp_strategy": 3, "recompute": True}
    runs.append(("reordered recompute z3", kwargs, "adam", REORDERED, 1))
    run_on_ranks(_check_runs, 2, runs, timeout=240)


@pytest.mark.multiprocess
def test_one_order_on_every_rank_at_world_4() -> None:
    """HSDP (one agreement of 4 ranks) and TP x FSDP (one per TP rank, of its dp group)."""
    mesh = ((2, 2), ("dp_outer", "dp_shard"))
    hsdp = {"mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    plan: Plan = {
        **{(0, rank, 0): _ordered((2, 0, 1)) for rank in range(4)},
        **{(1, rank, 0): _ordered((2, 0, 1), rank % 3) for rank in range(4)},
        **{(2, rank, 0): _ordered((1, 2, 0)) for rank in range(4)},
    }
    runs = []
    for inner, outer in ((2, 0), (3, 1)):
        kwargs = {**hsdp, "zero_dp_strategy": inner, "outer_dp_sharding_strategy": outer}
        runs.append((f"hsdp reordered z{inner}/{outer}", kwargs, "adam", plan, 1))
    tp = {"mesh": ((2, 2), ("dp_shard", "tp")), "dp_shard_dim": "dp_shard", "tp_dim": "tp"}
    runs.append(("tp reordered z3", {**tp, "zero_dp_strategy": 3}, "adam", REORDERED, 1))
    run_on_ranks(_check_runs, 4, runs, timeout=240)


@pytest.mark.multiprocess
def test_contradicting_changes_stop_every_rank() -> None:
    """Both ranks change the order, in ways that contradict: they stop at the agreement."""
    run_on_ranks(
        _rank_out_of_order,
        2,
        3,
        (0, 2, 1),
        (2, 0, 1),
        "had already run on another rank",
        timeout=60,
    )


def _rank_extra_forward(rank: int, world: int, strategy: int) -> None:
    """In step 1 rank 0 runs two root forwards before its backward, rank 1 one."""
    model, opt = _skipping_model(strategy)

    def train() -> None:
        for step in range(STEPS):
            tokens, targets = batch(step, rank, 0)
            loss = model(tokens, targets)
            if step == 1 and rank == 0:
                loss = loss + model(*batch(step, rank, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()

    with pytest.raises(mf_fsdp.UnitOrderError) as caught:
        train()
    message = str(caught.value)
    assert "step 1: unit '' (the root) ran a forward again before its backward" in message, message
    assert "\n" not in message


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [3])
def test_a_rank_with_another_number_of_forwards_stops_every_rank(strategy: int) -> None:
    """Each root forward after the first before one backward is agreed on: a rank alone
    there would gather while its peers reduce (collectives paired wrongly, or a hang)."""
    run_on_ranks(_rank_extra_forward, 2, strategy, timeout=90)


def test_merge_chains() -> None:
    old = ["a", "b", "c", "d"]
    assert merge_chains(old, {0: (3, ("c", "a")), 1: (3, ("c", "a"))}) == (["c", "a", "b", "d"], 1)
    # Different units met early (rank 0 skipped "a"): both chains hold.
    assert merge_chains(old, {0: (3, ("c", "b")), 1: (3, ("c", "a"))}) == (["c", "a", "b", "d"], 1)
    assert merge_chains(old, {0: (2, ("b", "a"))}) == (["b", "a", "c", "d"], 1)
    # The unit that came early goes right after the units run: "a" may still come later.
    assert merge_chains(old, {0: (3, ("c", "b"))}) == (["c", "b", "a", "d"], 1)
    # Opposite orders: "b" came early on rank 0 after rank 1 ran it before "d".
    opposite = merge_chains(old, {0: (3, ("c", "d", "b")), 1: (3, ("c", "b", "d"))})
    assert "'b', early on rank 0, had already run" in opposite
    assert "different units" in merge_chains(old, {0: (3, ("c", "a")), 1: (4, ("d", "a"))})
    assert "already run" in merge_chains(old, {0: (3, ("c", "a")), 1: (3, ("a", "c", "b"))})

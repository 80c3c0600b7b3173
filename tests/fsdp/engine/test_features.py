"""Bad input, memory per rank, meta-device init, clipping, bf16, tied weights, recompute."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

import mf_fsdp
from mf.models import GPT, Block, GPTConfig
from mf_fsdp.buckets.buffer_pool import KEEP_BELOW_BYTES
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    assert_bf16_trained,
    batch,
    full_params,
    initial_params,
    make_model,
    make_optimizer,
    reference_run,
    unit_classes,
)
from tests.fsdp.engine.test_accumulation import count_collectives


def test_unknown_strategy_fails_before_any_communication() -> None:
    with pytest.raises(ValueError, match=r"zero_dp_strategy: unknown strategy 'zero9'"):
        mf_fsdp.fully_shard(nn.Linear(2, 2), None, zero_dp_strategy="zero9")


def _rank_bad_input(rank: int, world: int) -> None:
    module = make_model()
    with pytest.raises(ValueError, match=r"fsdp_unit_modules: \['Conv2d'\] match no submodule"):
        mf_fsdp.fully_shard_model(module, fsdp_unit_modules=[Block, nn.Conv2d])
    with pytest.raises(ValueError, match="fsdp_unit_modules: cannot import 'no.such.Class'"):
        mf_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=["no.such.Class"])
    with pytest.raises(ValueError, match="module: ReLU has no parameters"):
        mf_fsdp.fully_shard_model(nn.ReLU())
    lone = DeviceMesh("cpu", [rank], mesh_dim_names=("dp",), _init_backend=False)
    with pytest.raises(ValueError, match=r"device_mesh: covers 1 ranks .* the world has 2"):
        mf_fsdp.fully_shard_model(make_model(), device_mesh=lone)
    # An optimizer built on the original parameters and never rebound: a clear error.
    module = make_model()
    stale = torch.optim.SGD(module.parameters(), lr=0.1)
    model = mf_fsdp.fully_shard_model(module, fsdp_unit_modules=unit_classes())
    model(*batch(0, rank)).backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): this optimizer holds the original"):
        stale.step()
    # An optimizer that already stepped cannot be rebound.
    module = make_model()
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    module(*batch(0, rank)).backward()
    opt.step()
    with pytest.raises(ValueError, match="optimizer already has state"):
        mf_fsdp.fully_shard(module, opt)
    _rank_wrap_twice_and_type_slips(rank)


def _rank_wrap_twice_and_type_slips(rank: int) -> None:
    """Each raises on every rank before any communication, so the group stays usable."""
    module = make_model()
    model = mf_fsdp.fully_shard_model(module, fsdp_unit_modules=unit_classes())
    with pytest.raises(ValueError, match=r"module: got a MegatronFSDP \(wrapping GPT, managing"):
        mf_fsdp.fully_shard_model(model)
    with pytest.raises(ValueError, match=r"module: GPT is already wrapped: its parameter 'wte"):
        mf_fsdp.fully_shard(module, None)
    with pytest.raises(ValueError, match=r"module: Block is already wrapped: its parameter '"):
        mf_fsdp.fully_shard_model(module.blocks[0])
    with pytest.raises(ValueError, match=r"module: Sequential is already wrapped"):
        mf_fsdp.fully_shard_model(nn.Sequential(module.blocks[1], nn.Linear(2, 2)))
    slips = [
        ({"mixed_precision_policy": "bf16"}, TypeError, "mixed_precision_policy: expected a Mix"),
        ({"gradient_scaling_factor": "x"}, TypeError, "gradient_scaling_factor: expected a real"),
        ({"gradient_scaling_factor": 0.0}, ValueError, "gradient_scaling_factor: expected a fin"),
        ({"gradient_scaling_factor": float("inf")}, ValueError, "gradient_scaling_factor: exp"),
        ({"fsdp_unit_modules": 3}, TypeError, "fsdp_unit_modules: expected a list of nn.Module"),
    ]
    for kwargs, error, match in slips:
        with pytest.raises(error, match=match):
            mf_fsdp.fully_shard_model(make_model(), **kwargs)
    # Gradient clipping: a norm that is not a p-norm, or a max_norm that would flip signs.
    model(*batch(0, rank)).backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    clip_errors = [
        ({"max_norm": -1.0}, ValueError, r"max_norm: expected a positive number .* got -1.0; a "),
        ({"max_norm": 0}, ValueError, r"max_norm: expected a positive number \(inf: never clip"),
        ({"max_norm": float("nan")}, ValueError, r"max_norm: expected a positive number"),
        ({"max_norm": "1"}, TypeError, r"max_norm: expected a positive number, got '1'"),
        ({"max_norm": 1.0, "norm_type": "fro"}, ValueError, r"norm_type: expected a positive"),
        ({"max_norm": 1.0, "norm_type": -2}, ValueError, r"norm_type: .* got -2"),
        ({"max_norm": 1.0, "norm_type": None}, TypeError, r"norm_type: .* got None"),
    ]
    for kwargs, error, match in clip_errors:
        with pytest.raises(error, match=match):
            mf_fsdp.clip_grad_norm_(model, **kwargs)
    with pytest.raises(TypeError, match=r"parameters: expected a MegatronFSDP, .* got int 3 at"):
        mf_fsdp.clip_grad_norm_([model.wte.weight, 3], 1.0)
    for name, p in model.named_parameters():  # nothing was scaled by the refused calls
        assert torch.equal(p.grad.to_local(), grads[name]), name
    norm = mf_fsdp.clip_grad_norm_(model, float("inf"), norm_type="inf")  # as torch accepts
    assert torch.isfinite(norm)


@pytest.mark.multiprocess
def test_bad_input() -> None:
    run_on_ranks(_rank_bad_input, 2, timeout=120)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _rank_memory(rank: int, world: int) -> None:
    total = sum(p.numel() for p in make_model().parameters()) * 4  # fp32 bytes, tied once
    for strategy in range(4):
        module = make_model()
        opt = make_optimizer("adam", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
        )
        model(*batch(0, rank)).backward()
        opt.step()
        stats = model.bucket_stats()
        assert all(s.padding_fraction < 0.01 for s in stats), stats
        owned = torch.tensor(sum(s.rank_numel for s in stats))
        dist.all_reduce(owned)
        assert owned.item() * 4 == total  # the ranks' real pieces tile the model exactly
        held = model.memory_footprint(opt)
        scalars = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if v.dim() == 0
        )
        assert held["optimizer_state"] == _state_bytes(opt) + scalars
        shard = total / world
        expected = {
            0: (total, total, 2 * total),
            1: (total, total, 2 * shard),
            2: (total, shard, 2 * shard),
            3: (shard, shard, 2 * shard),
        }[strategy]
        got = (held["params"], held["grads"], _state_bytes(opt))
        for name, value, want in zip(("params", "grads", "adam"), got, expected, strict=True):
            assert want <= value * (1 + 1e-9) or name == "adam", (strategy, name, value, want)
            assert value <= want * 1.01, (strategy, name, value, want)
        assert held["main_params"] == 0  # fp32 model + fp32 main: one copy of the weights


def _local_grad_bytes(model: mf_fsdp.MegatronFSDP) -> int:
    """Bytes of grad buffers held now: the groups' (local ones while out) and the pool's."""
    held = model.memory_footprint()
    return held["grads"] + held["pool"]


def _sample_before_each_reduction(model: mf_fsdp.MegatronFSDP, samples: list[int]) -> None:
    """Append ``_local_grad_bytes(model)`` to ``samples`` whenever a group starts reducing."""
    for group in model.groups:
        start = group.start_reduce

        def sampled(async_op: bool, start=start) -> None:
            samples.append(_local_grad_bytes(model))
            start(async_op)

        group.start_reduce = sampled


def _rank_grad_buffers_are_bounded(rank: int, world: int) -> None:
    # Eight equal blocks: if every unit's whole-bucket grad buffer lived until the end of
    # backward, eight would be held at once. Each unit reduced alone, and two units per
    # communication window (one window is reduced while the next fills): the same
    # bound, sampled whenever a reduction starts. (The default window
    # holds this whole model: all may be in flight.)
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=8, n_heads=4)
    block_numel = sum(p.numel() for p in GPT(config).blocks[0].parameters())
    for window in (0, 2 * block_numel + 1):
        torch.manual_seed(0)
        module = GPT(config)
        opt = make_optimizer("sgd", module.parameters())
        samples: list[int] = []
        model, opt = mf_fsdp.fully_shard(
            module,
            opt,
            fsdp_unit_modules=unit_classes(),
            suggested_communication_unit_size=window,
        )
        _sample_before_each_reduction(model, samples)
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            assert model.memory_footprint()["pool"] == 0  # dropped grads: nothing pooled
        stores = sum(g.main_layout.shard_size for g in model.groups) * 4  # reduced grads
        assert samples
        assert 0 < max(samples) - stores <= 4 * block_numel * 4 * 1.01, (window, max(samples))


def _rank_idle_grad_memory_is_freed(rank: int, world: int) -> None:
    # What would sit under a forward's activations: sharded grads after
    # zero_grad(set_to_none=True) (FSDP2 frees them too) and the pool's large idle
    # buffers. A 4096-token vocabulary makes the root bucket larger than what the pool
    # keeps across forwards (KEEP_BELOW_BYTES).
    config = GPTConfig(vocab_size=4096, seq_len=16, d_model=64, n_layers=2, n_heads=4)
    for strategy in (2, 3):
        torch.manual_seed(0)
        module = GPT(config)  # tied head: the root bucket's first grad comes at the loss
        opt = make_optimizer("sgd", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
        )
        root = [g for g in model.groups if g.late_grads]
        assert root
        assert all(g.strategy.level == strategy for g in root)
        root_bytes = sum(g.layout.padded_numel for g in root) * 4
        assert root_bytes >= KEEP_BELOW_BYTES
        assert model.memory_footprint()["grads"] == 0  # nothing reduced yet
        for step in range(2):
            loss = model(*batch(step, rank))
            assert model.memory_footprint()["pool"] < root_bytes, "idle buffers under the forward"
            with model.no_sync():
                loss.backward()
            # The root's grads stay autograd's own until its reduction: no bucket buffer.
            assert all(g.grad_local is None for g in root)
            assert all(p.grad is not None for g in root for p in g.params)
            model(*batch(step + 10, rank)).backward()
            opt.step()
            assert model.memory_footprint()["grads"] > 0
            opt.zero_grad(set_to_none=True)
            assert model.memory_footprint()["grads"] == 0, strategy
            assert all(p.grad is None for p in opt.param_groups[0]["params"])
        # zero_grad(set_to_none=False) keeps readable zeros.
        model(*batch(0, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert all(not p.grad.to_local().any() for p in opt.param_groups[0]["params"])


def _rank_memory_and_buffers(rank: int, world: int) -> None:
    _rank_memory(rank, world)
    _rank_grad_buffers_are_bounded(rank, world)
    _rank_idle_grad_memory_is_freed(rank, world)


@pytest.mark.multiprocess
def test_memory_per_rank() -> None:
    run_on_ranks(_rank_memory_and_buffers, 2, timeout=120)


def _storage_bytes(module: nn.Module) -> int:
    storages = {}
    for p in module.parameters():
        if not p.is_meta:
            storage = p.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _rank_meta_init(rank: int, world: int) -> None:
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=6, n_heads=4)
    with torch.device("meta"):
        module = GPT(config)
    whole = sum(p.numel() for p in module.parameters()) * 4
    largest_unit = max(sum(p.numel() for p in b.parameters()) for b in module.blocks) * 4
    root = whole - largest_unit * config.n_layers
    peak = [0]
    original = nn.Linear.reset_parameters

    def spy(self: nn.Linear) -> None:
        original(self)
        peak[0] = max(peak[0], _storage_bytes(module))

    nn.Linear.reset_parameters = spy  # type: ignore[method-assign]
    says = r"GPT's meta parameters are initialised unit by unit with each module's reset_param"
    try:
        with pytest.warns(UserWarning, match=says):  # which initialiser, once
            model = mf_fsdp.fully_shard_model(
                module, fsdp_unit_modules=unit_classes(), init_model_with_meta_device=True
            )
    finally:
        nn.Linear.reset_parameters = original  # type: ignore[method-assign]
    assert 0 < peak[0] <= max(largest_unit, root) < whole / 2, (peak[0], largest_unit, whole)
    assert not any(p.is_meta for p in module.parameters())
    params = full_params(model)
    for value in params.values():
        gathered = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(gathered, value)
        assert all(torch.equal(g, gathered[0]) for g in gathered)  # same init everywhere
    assert float(params["blocks.0.fc.weight"].std()) > 0


@pytest.mark.multiprocess
def test_meta_device_init_is_unit_by_unit() -> None:
    run_on_ranks(_rank_meta_init, 2, timeout=120)


class _Recomputed(nn.Module):
    """Runs a Block under activation recomputation (the Block stays the FSDP unit)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _rank_features(rank: int, world: int) -> None:
    steps = 3
    # clip_grad_norm_ equals torch's on the unsharded model, and training with it matches.
    ref_losses, ref_params = reference_run("sgd", world, steps, clip=0.05)
    for strategy in (0, 3):
        module = make_model()
        opt = make_optimizer("sgd", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
        )
        assert module.lm_head.weight is module.wte.weight  # tied weights stay tied
        reference = make_model()
        ref_opt = make_optimizer("sgd", reference.parameters())
        for step in range(steps):
            model(*batch(step, rank)).backward()
            norm = mf_fsdp.clip_grad_norm_(model, 0.05)
            for r in range(world):
                (reference(*batch(step, r)) / world).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
            inf = mf_fsdp.get_grad_norm(model, float("inf"))
            ref_inf = max(p.grad.abs().max() for p in reference.parameters())
            torch.testing.assert_close(inf, ref_inf, rtol=1e-5, atol=1e-8)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        params = full_params(model)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
        assert module.lm_head.weight is module.wte.weight
    del ref_losses

    # Recomputing a whole unit gathers its weights once for recompute + backward.
    # Each unit communicates alone here (window 0), so every gather is counted.
    counts_by_mode, params_by_mode = {}, {}
    for recompute in (False, True):
        module = make_model()
        if recompute:
            module.blocks = nn.ModuleList(_Recomputed(b) for b in module.blocks)
        opt = make_optimizer("sgd", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), suggested_communication_unit_size=0
        )
        for step in range(steps):
            with count_collectives() as counts:
                model(*batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        counts_by_mode[recompute] = counts["all_gather_into"]
        params_by_mode[recompute] = {
            k.replace("block.", ""): v for k, v in full_params(model).items()
        }
    for name, value in params_by_mode[False].items():
        torch.testing.assert_close(params_by_mode[True][name], value, rtol=1e-5, atol=1e-6)
    # The root once, every block in forward and again in backward, except the last:
    # the backward starts with it, so it stays gathered from its forward on.
    assert counts_by_mode[True] == counts_by_mode[False] == 1 + 2 * CONFIG.n_layers - 1

    # bf16 compute with fp32 main weights trains as the fp32 run does, in every strategy:
    # SGD, whose step is the gradient itself, shows a wrong gradient scale; Adam the
    # usual recipe, fp32 state included.
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    initial = initial_params()
    for opt_name in ("sgd", "adam"):
        fp32_losses, fp32_params = reference_run(opt_name, world, 10)
        for strategy in range(4):
            module = make_model()
            opt = make_optimizer(opt_name, module.parameters())
            model, opt = mf_fsdp.fully_shard(
                module,
                opt,
                fsdp_unit_modules=unit_classes(),
                zero_dp_strategy=strategy,
                mixed_precision_policy=policy,
            )
            assert model.memory_footprint()["main_params"] > 0  # fp32 main + bf16 compute
            losses = []
            for step in range(10):
                loss = model(*batch(step, rank))
                assert loss.dtype is torch.bfloat16
                loss.backward()
                total = loss.detach().float()
                dist.all_reduce(total)
                opt.step()
                opt.zero_grad()
                losses.append(total.item() / world)
            if opt_name == "adam":
                assert next(iter(opt.state.values()))["exp_avg"].dtype is torch.float32
            label = f"bf16 z{strategy} {opt_name}"
            params = full_params(model)
            assert_bf16_trained(losses, params, fp32_losses, fp32_params, initial, label, opt_name)


@pytest.mark.multiprocess
def test_clip_recompute_bf16_tied() -> None:
    run_on_ranks(_rank_features, 2, timeout=240)


def _rank_index_and_state(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_outer", "dp_shard"))
    index = mf_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    assert dist.get_world_size(index.get_fsdp_group()) == world
    assert dist.get_world_size(index.get_outer_fsdp_group()) == 1
    assert dist.get_world_size(index.get_dp_group()) == world
    assert index.get_logical_hybrid_fsdp_rank() == rank
    assert index.get_submesh("dp_shard").size() == world
    with pytest.raises(ValueError, match=r"tp_dim='tp' is not a dim of the mesh"):
        mf_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    with pytest.raises(ValueError, match="dp_shard_dim is required for a 2-D mesh"):
        mf_fsdp.FSDPDistributedIndex(mesh)
    tp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    tp_index = mf_fsdp.FSDPDistributedIndex(tp_mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    assert tp_index.get_outer_fsdp_group() is None
    with pytest.raises(RuntimeError, match="needs a dp_outer_dim"):
        tp_index.get_logical_hybrid_fsdp_rank()

    # HSDP-shaped mesh (one replica) and a (dp_shard, tp) mesh train like a 1-D mesh.
    _, ref_params = reference_run("sgd", world, 2)
    for mesh_kwargs in (
        {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"},
        {"device_mesh": tp_mesh, "dp_shard_dim": "dp_shard", "tp_dim": "tp"},
    ):
        module = make_model()
        opt = make_optimizer("sgd", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), **mesh_kwargs
        )
        for step in range(2):
            model(*batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        params = full_params(model)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)

        # state_dict round trip: sharded values keyed like the module's own state dict
        # (tied names included), shaped like its parameters.
        state = {k: v.clone() for k, v in model.state_dict().items()}
        plain = make_model().state_dict()
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in plain.items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(state)
        after = full_params(model)
        for name, value in params.items():
            torch.testing.assert_close(after[name], value)
        # model.zero_grad() clears the engine's buffers too (no stale accumulation).
        model(*batch(0, rank)).backward()
        assert float(mf_fsdp.get_grad_norm(model)) > 0
        model.zero_grad()
        assert float(mf_fsdp.get_grad_norm(model)) == 0.0
        # The module's own loader: torch's message, as for the plain module.
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "wte.weight"'):
            model.load_state_dict({k: v for k, v in state.items() if k != "wte.weight"})

    # broadcast_params: replicas that started different agree with dp rank 0 afterwards.
    for strategy in (0, 1, 2):
        module = make_model(seed=rank)
        model = mf_fsdp.fully_shard_model(
            module, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
        )
        model.broadcast_params()
        expected = make_model(seed=0)
        params = full_params(model)
        for name, value in expected.named_parameters():
            torch.testing.assert_close(params[name], value.detach())


@pytest.mark.multiprocess
def test_index_meshes_and_state_dict() -> None:
    run_on_ranks(_rank_index_and_state, 2, timeout=120)

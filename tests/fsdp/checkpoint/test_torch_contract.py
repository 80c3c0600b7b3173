"""The torch contract: what torch's own tools see of a wrapped model is right.

Start here for the contract as a user meets it:

- ``test_dtensors_match_one_process_*``: every tensor in ``model.state_dict()``
  and ``optimizer.state_dict()`` has its parameter's global shape; every DTensor
  mf hands out (the sharded parameters, their grads, the optimizer state, the
  state-dict entries) gives the single-process value under DTensor's own
  ``full_tensor()`` and ``redistribute(Replicate())``, on every rank: ZeRO-0..3
  on 2 ranks; HSDP, hybrid-sharded HSDP and mf-tp layers x FSDP (dp=2, tp=2)
  on 4.
- ``test_reference_recipe_resumes_exactly``: Megatron-FSDP's documented recipe
  (``dcp.save`` of ``model.state_dict()`` and ``optimizer.state_dict()``, then in
  fresh processes ``dcp.load`` into a freshly wrapped pair that took no step,
  ``model.load_state_dict(..., strict=False)`` and
  ``optimizer.load_state_dict(...)``) continues exactly like an uninterrupted
  run, for ZeRO-1..3, Adam and SGD-momentum, on 2 -> 2, 2 -> 1 and 1 -> 2 ranks.
- ``test_dsd_*``: torch's DSD (``get_state_dict`` / ``set_state_dict``, full
  and sharded) on the wrapped model and optimizer.
- ``test_param_groups_by_ndim_after_wrapping``: optimizers that read shapes
  see the parameters' shapes.

Tolerances: 1e-5 where a sharded run is compared with one process (sums in
another order), 1e-6 for a resumed run against the uninterrupted one (the
same arithmetic; another world size reorders sums). Adam runs with
``eps=1e-4`` (see test_checkpoint: the attention key bias has a zero gradient
whose rounding noise Adam would otherwise normalise into lr-sized steps).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

import mf_fsdp
from mf.models import GPT
from mf_dtensor import UnevenDTensor
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    batch,
    full_params,
    make_model,
    make_optimizer,
    unit_classes,
)
from tests.fsdp.buckets import test_tensor_parallel as tp
from tests.fsdp.checkpoint.test_checkpoint import _check, _global_batch, _optimizer, _train, _wrap

CLOSE = {"rtol": 1e-5, "atol": 1e-6}
EXACT = {"rtol": 1e-6, "atol": 1e-6}


# ---------------------------------------------------------------- DTensor semantics
def _check_dtensor(value: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``value`` has ``expected``'s shape; as a DTensor it gathers to it in both ways."""
    assert tuple(value.shape) == tuple(expected.shape), f"{what}: shape {tuple(value.shape)}"
    if not isinstance(value, DTensor):
        torch.testing.assert_close(value.detach(), expected, **CLOSE, msg=lambda m: f"{what}: {m}")
        return
    assert isinstance(value, UnevenDTensor), f"{what}: {type(value).__name__}"
    full = value.full_tensor()
    torch.testing.assert_close(full, expected, **CLOSE, msg=lambda m: f"{what} full_tensor: {m}")
    replicated = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
    torch.testing.assert_close(
        replicated.to_local(), expected, **CLOSE, msg=lambda m: f"{what} redistribute: {m}"
    )


def _check_all(model, opt, ref_model, ref_opt, label: str) -> None:
    """Every tensor torch sees of ``model`` and ``opt`` against the single-process pair."""
    ref_params = dict(ref_model.named_parameters())
    params = dict(model.named_parameters())
    assert list(params) == list(ref_params), label
    for name, param in params.items():
        ref = ref_params[name]
        _check_dtensor(param, ref.detach(), f"{label} param {name}")
        _check_dtensor(param.grad, ref.grad, f"{label} grad {name}")
        state, ref_state = opt.state[param], ref_opt.state[ref]
        assert sorted(state) == sorted(ref_state), name
        for key, value in state.items():
            if value.dim():
                _check_dtensor(value, ref_state[key], f"{label} {key} {name}")
            else:
                assert float(value) == float(ref_state[key]), f"{label} {key} {name}"
    ref_sd = ref_model.state_dict()
    # mf-tp layers add a None ``_extra_state`` entry (for TE-style checkpoints).
    sd = {k: v for k, v in model.state_dict().items() if v is not None}
    assert list(sd) == list(ref_sd), label
    for key, value in sd.items():
        _check_dtensor(value, ref_sd[key], f"{label} state_dict[{key!r}]")
    shapes = [p.shape for g in opt.param_groups for p in g["params"]]
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            if value.dim():
                assert value.shape == shapes[index], f"{label} optimizer {index} {key}"


def _ref_pair(build=make_model, optimizer=_optimizer):
    model = build()
    return model, optimizer("adam", model.parameters())


def _ref_steps(model, opt, world: int, steps: int, data=batch) -> None:
    """``steps`` steps on the global batch, then one more backward (grads kept)."""
    for step in range(steps + 1):
        for r in range(world):
            (model(*data(step, r, 0)) / world).backward()
        if step < steps:
            opt.step()
            opt.zero_grad()


def _steps(model, opt, data_rank: int, steps: int, data=batch) -> None:
    for step in range(steps + 1):
        model(*data(step, data_rank, 0)).backward()
        if step < steps:
            opt.step()
            opt.zero_grad()
    # What optimizer.step() would do first: HSDP's dp_outer reduction runs once per step.
    model.finish_grad_sync()


def _rank_semantics_1d(rank: int, world: int) -> None:
    ref_model, ref_opt = _ref_pair()
    _ref_steps(ref_model, ref_opt, world, 2)
    for strategy in (0, 1, 2, 3):
        module = make_model()
        model, opt = mf_fsdp.fully_shard(
            module,
            _optimizer("adam", module.parameters()),
            fsdp_unit_modules=unit_classes(),
            zero_dp_strategy=strategy,
        )
        _steps(model, opt, rank, 2)
        _check_all(model, opt, ref_model, ref_opt, f"z{strategy}")


@pytest.mark.multiprocess
def test_dtensors_match_one_process_zero0_to_3() -> None:
    run_on_ranks(_rank_semantics_1d, 2, timeout=180)


def _rank_semantics_2d(rank: int, world: int) -> None:
    hsdp_mesh = cpu_mesh((2, 2), ("dp_outer", "dp_shard"))
    ref_model, ref_opt = _ref_pair()
    _ref_steps(ref_model, ref_opt, world, 2)
    for outer in (0, "optim"):
        module = make_model()
        model, opt = mf_fsdp.fully_shard(
            module,
            _optimizer("adam", module.parameters()),
            device_mesh=hsdp_mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            outer_dp_sharding_strategy=outer,
            fsdp_unit_modules=unit_classes(),
        )
        _steps(model, opt, rank, 2)
        _check_all(model, opt, ref_model, ref_opt, f"hsdp outer={outer}")
    # mf-tp layers x FSDP: every parameter in its full (tp-gathered) shape.
    mesh = cpu_mesh((tp.DP, tp.TP), ("dp", "tp"))
    ref_model, ref_opt = _ref_pair(tp.reference_model, make_optimizer)  # tp._wrap's Adam
    _ref_steps(ref_model, ref_opt, tp.DP, 2, data=tp.batch)
    for strategy in (0, 3):
        model, opt = tp._wrap(tp.mf_tp_model, mesh, tp.TPBlock, "adam", zero_dp_strategy=strategy)
        _steps(model, opt, mesh.get_local_rank("dp"), 2, data=tp.batch)
        _check_all(model, opt, ref_model, ref_opt, f"mf-tp z{strategy}")


@pytest.mark.multiprocess
def test_dtensors_match_one_process_hsdp_and_tp() -> None:
    run_on_ranks(_rank_semantics_2d, 4, timeout=240)


# ---------------------------------------------------------------- the reference recipe
RECIPE_SAVE_AT, RECIPE_MORE = 3, 3
RECIPE_CASES = [(s, o) for s in (1, 2, 3) for o in ("sgd", "adam")]


def _recipe_pair(strategy: int, opt_name: str, seed: int = 0):
    return _wrap(opt_name, strategy, seed)


def _rank_recipe_save(rank: int, world: int, root: str) -> None:
    for strategy, opt_name in RECIPE_CASES:
        where = Path(root) / f"w{world}-z{strategy}-{opt_name}"
        model, opt = _recipe_pair(strategy, opt_name)
        _train(model, opt, rank, world, range(RECIPE_SAVE_AT))
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=where)
        more = range(RECIPE_SAVE_AT, RECIPE_SAVE_AT + RECIPE_MORE)
        expected = (_train(model, opt, rank, world, more), full_params(model))
        if rank == 0:
            torch.save(expected, where.with_suffix(".expected.pt"))


def _rank_recipe_load(rank: int, world: int, root: str, saved_world: int) -> None:
    for strategy, opt_name in RECIPE_CASES:
        where = Path(root) / f"w{saved_world}-z{strategy}-{opt_name}"
        losses, params = torch.load(where.with_suffix(".expected.pt"))
        model, opt = _recipe_pair(strategy, opt_name, seed=1)  # other weights; no step taken
        assert all(float(s.get("step", 0)) == 0 for s in opt.state.values())
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(state, checkpoint_id=where)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        more = range(RECIPE_SAVE_AT, RECIPE_SAVE_AT + RECIPE_MORE)
        got = _train(model, opt, rank, world, more), full_params(model)
        _check(got, (losses, params), f"z{strategy} {opt_name} {saved_world} -> {world} ranks")


@pytest.mark.multiprocess
def test_reference_recipe_resumes_exactly(tmp_path: Path) -> None:
    run_on_ranks(_rank_recipe_save, 2, str(tmp_path), timeout=240)
    run_on_ranks(_rank_recipe_save, 1, str(tmp_path), timeout=240)
    run_on_ranks(_rank_recipe_load, 2, str(tmp_path), 2, timeout=240)
    run_on_ranks(_rank_recipe_load, 1, str(tmp_path), 2, timeout=240)
    run_on_ranks(_rank_recipe_load, 2, str(tmp_path), 1, timeout=240)


# ---------------------------------------------------------------- DSD
def _rank_dsd(rank: int, world: int, root: str) -> None:
    # get_state_dict / set_state_dict through DCP reproduce training exactly.
    model, opt = _recipe_pair(3, "adam")
    _train(model, opt, rank, world, range(RECIPE_SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, opt)
    assert sorted(optim_sd["state"]) == sorted(n for n, _ in model.named_parameters())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dsd")
    # Full state dicts, offloaded: rank 0 holds the plain module's state dict.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=options)
    full_optim = get_optimizer_state_dict(model, opt, options=options)
    # Every rank gets a copy (DSD hands out Adam's live step counters, which go on).
    full = copy.deepcopy([full_model, full_optim]) if rank == 0 else [None, None]
    dist.broadcast_object_list(full, src=0)
    more = range(RECIPE_SAVE_AT, RECIPE_SAVE_AT + RECIPE_MORE)
    expected = _train(model, opt, rank, world, more), full_params(model)
    if rank == 0:
        plain = GPT(CONFIG)
        plain.load_state_dict(full_model, strict=True)
        reference = make_model()
        ref_opt = _optimizer("adam", reference.parameters())
        for step in range(RECIPE_SAVE_AT):
            reference(*_global_batch(step)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full_model[name], value, **CLOSE, msg=name)
            assert full_model[name].device.type == "cpu"
    else:
        assert full_model == {}
    for load in ("sharded", "full"):
        fresh, fresh_opt = _recipe_pair(3, "adam", seed=1)
        if load == "sharded":
            model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dsd")
            set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        else:  # every rank passes the full state dicts
            set_state_dict(
                fresh,
                fresh_opt,
                model_state_dict=full[0],
                optim_state_dict=full[1],
                options=StateDictOptions(full_state_dict=True),
            )
        got = _train(fresh, fresh_opt, rank, world, more), full_params(fresh)
        torch.testing.assert_close(
            torch.tensor(got[0]),
            torch.tensor(expected[0]),
            **EXACT,
            msg=lambda m, w=load: f"{w}: {m}",
        )
        for name, value in got[1].items():
            torch.testing.assert_close(value, expected[1][name], **EXACT, msg=f"{load} {name}")


@pytest.mark.multiprocess
def test_dsd_get_set_state_dict_round_trip_and_full_state_dict(tmp_path: Path) -> None:
    run_on_ranks(_rank_dsd, 2, str(tmp_path), timeout=240)


# ---------------------------------------------------------------- optimizers that read shapes
def _by_ndim(params) -> list[list[tuple[int, ...]]]:
    params = list(params)
    return [
        [tuple(p.shape) for p in params if p.ndim >= 2],
        [tuple(p.shape) for p in params if p.ndim < 2],
    ]


def _rank_ndim_groups(rank: int, world: int) -> None:
    before = _by_ndim(make_model().parameters())
    for strategy in (0, 3):
        model = mf_fsdp.fully_shard_model(
            make_model(), fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
        )
        assert _by_ndim(model.parameters()) == before
        # An optimizer built after wrapping, on groups split by ndim, trains exactly like
        # the same groups built before wrapping and passed through fully_shard.
        decay = [p for p in model.parameters() if p.ndim >= 2]
        other = [p for p in model.parameters() if p.ndim < 2]
        after = torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}])
        module = make_model()
        groups = [
            {"params": [p for p in module.parameters() if p.ndim >= 2]},
            {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
        twin, twin_opt = mf_fsdp.fully_shard(
            module,
            torch.optim.AdamW(groups),
            fsdp_unit_modules=unit_classes(),
            zero_dp_strategy=strategy,
        )
        for step in range(3):
            for net, net_opt in ((model, after), (twin, twin_opt)):
                net(*batch(step, rank)).backward()
                net_opt.step()
                net_opt.zero_grad()
        mine, theirs = full_params(model), full_params(twin)
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.multiprocess
def test_param_groups_by_ndim_after_wrapping() -> None:
    run_on_ranks(_rank_ndim_groups, 2, timeout=120)


def _rank_inner_module_calls(rank: int, world: int) -> None:
    # What HF ``generate`` does: it calls the wrapped module itself, not the wrapper.
    from mf.train.exports.export import sample_text
    from tests.fsdp._helpers import (
        batch,
        make_model,
        make_optimizer,
        optimizer_step,
        reference_run,
        unit_classes,
    )

    plain = make_model()
    module = make_model()
    opt = make_optimizer("sgd", module.parameters())
    model, opt = mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=unit_classes())
    tokens, targets = batch(0, 0)
    with torch.no_grad():
        for _ in range(3):  # repeatedly: every call gathers and releases
            torch.testing.assert_close(model.module(tokens), plain(tokens))
            assert all(not g.gathered for g in model.groups)
        prompt = tokens[0, :4]
        sampled = sample_text(model.module, prompt, 6, 16, seed=3)
        assert torch.equal(sampled, sample_text(plain, prompt, 6, 16, seed=3))
    assert all(not g.gathered for g in model.groups)
    # Training goes on as if nothing had happened.
    ref_losses, _ = reference_run("sgd", world, 3)
    losses = []
    for step in range(3):
        tokens, targets = batch(step, rank)
        loss = model.module(tokens, targets)  # the inner module trains too
        losses.append(optimizer_step(loss, opt, world))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_calling_the_wrapped_module_itself_gathers_releases_and_trains() -> None:
    run_on_ranks(_rank_inner_module_calls, 2)

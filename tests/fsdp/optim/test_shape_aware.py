"""Shape-aware optimizers on sharded parameters: torch's Muon and Adafactor against one process.

Start with ``test_muon_and_adamw_zero0_to_3``: the tiny GPT with torch's recipe,
``torch.optim.Muon`` for the blocks' weight matrices and ``AdamW`` for the rest,
passed to ``fully_shard`` as a list; 5 steps under ZeRO-0 (torch's own step on
the full parameters), -1, -2 and -3 on 2 and 3 ranks. The same under mf-tp TP 2
x DP 2 (fused qkv of stride 3: Muon sees the full matrix, gathered from 4
ranks), under HSDP 2 x 2 (replicas orthogonalise their own copies) and
hybrid-sharded HSDP, and ``torch.optim.Adafactor`` under ZeRO-3. Also: an
optimizer the engine cannot serve is refused by name.

Two checks per run:

- Every step against torch's own optimizers (``_Shadow``): one process holds
  the gathered parameters, gets the engine's reduced gradients, and steps
  torch's optimizers; the engine's step must give the same parameters (1e-6
  relative). This is the served step's parity, free of the chaos below.
- The 5 losses against a single-process run on the global batch, 1e-4
  relative. Muon's Newton-Schulz runs in bf16: a rounding-level difference of
  the fp32 gradient (ranks' sums in another order) rounds some input element
  to the neighbouring bf16 value, and training amplifies it. One process
  against itself with the ranks' losses accumulated in reverse order drifts
  as much (3 ranks: losses 4.4e-6 relative, parameters 1.4e-2 in relative
  norm after 5 steps; mf: 1.3e-5 and 1.8e-2), so parameters after 5 steps
  are not compared, and a wrong step (a gradient zeroed early, a matrix
  assembled wrongly) moves the losses by 1e-3 and more.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import mf_fsdp
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    assert_losses_close,
    batch,
    full_params,
    make_model,
    unit_classes,
)
from tests.fsdp.buckets import test_tensor_parallel as tp

STEPS = 5
LOSS_RTOL = 1e-4
STEP_RTOL = 1e-6


def muon_and_adamw(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's recipe: Muon for the hidden weight matrices, AdamW for everything else."""
    matrices = [p for n, p in module.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [
        p for n, p in module.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))
    ]
    return [
        torch.optim.Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.01),
        torch.optim.AdamW(rest, lr=1e-2, eps=1e-4),  # eps: see test_checkpoint (key bias)
    ]


def adafactor(module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adafactor(module.parameters(), lr=1e-2, weight_decay=0.01)]


def _reference_losses(build, optimizers, world: int, data=batch) -> list[float]:
    model = build()
    opts = optimizers(model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(world):
            loss = model(*data(step, r, 0)) / world
            loss.backward()
            total += loss.item()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(total)
    return losses


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm().clamp(min=1e-30)).item()


class _Shadow:
    """One process stepping torch's optimizers on the engine's gathered parameters and grads."""

    def __init__(self, build, optimizers) -> None:
        self.model = build()
        self.params = dict(self.model.named_parameters())
        self.opts = optimizers(self.model)

    def step(self, model: mf_fsdp.MegatronFSDP) -> None:
        """Take the engine's parameters and reduced grads (collective), step torch's optimizers."""
        model.finish_grad_sync()
        with torch.no_grad():
            for name, value in full_params(model).items():
                self.params[name].copy_(value)
        for name, param in model.named_parameters():
            self.params[name].grad = _copy(param.grad)
        for opt in self.opts:
            opt.step()
            opt.zero_grad()

    def load_state(self, state: dict[str, dict]) -> None:
        """Give torch's optimizers the state ``state`` (by FQN, full tensors)."""
        names = {id(p): n for n, p in self.params.items()}
        for opt in self.opts:
            for group in opt.param_groups:
                for param in group["params"]:
                    values = state[names[id(param)]]
                    opt.state[param] = {k: _copy(v) for k, v in values.items()}

    def check(self, model: mf_fsdp.MegatronFSDP, label: str) -> None:
        for name, value in full_params(model).items():
            error = _relative_error(value, self.params[name].detach())
            assert error <= STEP_RTOL, f"{label} {name}: step differs from torch's by {error:.2e}"


def _copy(value):
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _full_state(model, opts) -> dict:
    """Parameters and optimizer state, gathered, by FQN (collective)."""
    saved = mf_fsdp.get_optimizer_state_dict(model, opts)
    state = {
        fqn: {k: _copy(v) for k, v in values.items()} for fqn, values in saved["state"].items()
    }
    return {"params": full_params(model), "state": state}


def _train(model, opts, shadow: _Shadow, data_rank: int, label: str, data=batch) -> list[float]:
    """5 steps, each checked against ``shadow``; the losses averaged over the ranks."""
    losses = []
    for step in range(STEPS):
        loss = model(*data(step, data_rank, 0))
        loss.backward()
        shadow.step(model)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        shadow.check(model, f"{label} step {step}")
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _parity(
    recipe,
    reference: list[float],
    label: str,
    data_rank: int,
    *,
    build=make_model,
    reference_build=make_model,
    data=batch,
    **wrap,
) -> None:
    """Train ``build()`` wrapped by ``fully_shard(..., **wrap)`` with ``recipe``'s optimizers.

    Each step is checked against torch's optimizers (``_Shadow``), the losses
    against ``reference``.
    """
    wrap.setdefault("fsdp_unit_modules", unit_classes())
    module = build()
    model, opts = mf_fsdp.fully_shard(module, recipe(module), **wrap)
    shadow = _Shadow(reference_build, recipe)
    losses = _train(model, opts, shadow, data_rank, label, data)
    assert_losses_close(losses, reference, label, LOSS_RTOL)


def _rank_muon(rank: int, world: int, reference: list[float]) -> None:
    for strategy in (0, 1, 2, 3):  # ZeRO-0: full parameters, torch's own Muon step
        label = f"muon z{strategy} x{world}"
        _parity(muon_and_adamw, reference, label, rank, zero_dp_strategy=strategy)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_muon_and_adamw_zero0_to_3(world: int) -> None:
    reference = _reference_losses(make_model, muon_and_adamw, world)
    run_on_ranks(_rank_muon, world, reference, timeout=240)


def _rank_muon_4(rank: int, world: int, tp_reference: list[float], reference: list[float]) -> None:
    """TP 2 x DP 2, then HSDP 2 x 2 (replicated, and hybrid-sharded) on the same 4 ranks."""
    mesh = cpu_mesh((tp.DP, tp.TP), ("dp", "tp"))
    tp_wrap = {"device_mesh": mesh, "dp_shard_dim": "dp", "tp_dim": "tp"}
    _parity(
        muon_and_adamw,
        tp_reference,
        "muon tp2 x dp2",
        mesh.get_local_rank("dp"),
        build=lambda: tp.mf_tp_model(mesh["tp"]),
        reference_build=tp.reference_model,
        data=tp.batch,
        fsdp_unit_modules=[tp.TPBlock],
        **tp_wrap,
    )
    module = tp.mf_tp_model(mesh["tp"])
    with pytest.raises(ValueError, match=r"Adafactor cannot step a parameter .* split along dim 1"):
        mf_fsdp.fully_shard(module, adafactor(module), **tp_wrap)
    hsdp_mesh = cpu_mesh((2, 2), ("dp_outer", "dp_shard"))
    for outer in ("no_shard", "optim"):
        _parity(
            muon_and_adamw,
            reference,
            f"muon hsdp outer {outer}",
            rank,
            device_mesh=hsdp_mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            outer_dp_sharding_strategy=outer,
        )


@pytest.mark.multiprocess
def test_muon_tensor_parallel_and_hsdp() -> None:
    tp_reference = _reference_losses(tp.reference_model, muon_and_adamw, tp.DP, data=tp.batch)
    reference = _reference_losses(make_model, muon_and_adamw, 4)
    run_on_ranks(_rank_muon_4, 4, tp_reference, reference, timeout=300)


class _Mixer(torch.nn.Module):
    """A 3-D weight (Adafactor's column statistic then has rows too) on a tiny regression."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(5, 4, 3))
        self.bias = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("bhi,hij->bj", x, self.weight) + self.bias
        return torch.nn.functional.mse_loss(out, y)


def _regression(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 5, 4, generator=generator), torch.randn(8, 3, generator=generator)


def _rank_adafactor(rank: int, world: int, reference: list[float], reference_3d) -> None:
    _parity(adafactor, reference, "adafactor z3", rank, zero_dp_strategy=3)
    _parity(
        adafactor,
        reference_3d,
        "adafactor 3-d z3",
        rank,
        build=_Mixer,
        reference_build=_Mixer,
        data=_regression,
        fsdp_unit_modules=None,
        zero_dp_strategy=3,
    )


@pytest.mark.multiprocess
def test_adafactor_zero3() -> None:
    reference = _reference_losses(make_model, adafactor, 2)
    reference_3d = _reference_losses(_Mixer, adafactor, 2, data=_regression)
    run_on_ranks(_rank_adafactor, 2, reference, reference_3d, timeout=240)


class _RowMixer(torch.optim.Optimizer):
    """An optimizer mf knows nothing about (its step could mix rows)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


def _wrap(module, optimizers):
    return mf_fsdp.fully_shard(module, optimizers, fsdp_unit_modules=unit_classes())


def _rank_refusals(rank: int, world: int) -> None:
    for optimizer, name in (
        (lambda m: torch.optim.LBFGS(m.parameters()), "torch.optim.lbfgs.LBFGS"),
        (lambda m: _RowMixer(m.parameters()), "tests.fsdp.optim.test_shape_aware._RowMixer"),
    ):
        module = make_model()
        with pytest.raises(ValueError, match=rf"optimizer: {name} is not known to work"):
            _wrap(module, optimizer(module))
    # Built after wrapping: refused at its first step, before it touches a parameter.
    model, _ = _wrap(make_model(), [])
    late = _RowMixer(model.parameters())
    model(*batch(0, rank)).backward()
    with pytest.raises(ValueError, match="_RowMixer is not known to work"):
        late.step()
    mf_fsdp.register_elementwise_optimizer(_RowMixer)
    module = make_model()
    _wrap(module, _RowMixer(module.parameters()))
    with pytest.raises(TypeError, match="cls: expected a torch.optim.Optimizer subclass"):
        mf_fsdp.register_elementwise_optimizer(len)


def _rank_partial_zero_grad(rank: int, world: int) -> None:
    module = make_model()
    params = list(module.parameters())
    model, (first, second) = _wrap(
        module, [torch.optim.SGD(params[:3], lr=0.1), torch.optim.SGD(params[3:], lr=0.1)]
    )
    model(*batch(0, rank)).backward()
    first.step()
    second.step()
    first.zero_grad()
    with pytest.warns(UserWarning, match=r"optimizers \['SGD'\] did not call zero_grad"):
        model(*batch(1, rank)).backward()


class _Container(torch.optim.Optimizer):
    """An optimizer over the same parameters whose step steps inner ones (torchtitan's
    ``OptimizersContainer`` is built so)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure=None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _rank_container(rank: int, world: int) -> None:
    """A container's step passes mf's hooks; its inner optimizers take them: as if alone."""
    runs = []
    for contained in (False, True):
        model, _ = _wrap(make_model(), [])
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer = _Container([adamw]) if contained else adamw
        for step in range(2):
            model(*batch(step, rank)).backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(full_params(model))
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.multiprocess
def test_refusals_and_zero_grad_of_one_optimizer() -> None:
    run_on_ranks(_rank_refusals, 2, timeout=120)
    run_on_ranks(_rank_partial_zero_grad, 2, timeout=120)
    run_on_ranks(_rank_container, 2, timeout=120)


RECIPES = {"muon": muon_and_adamw, "adafactor": adafactor}


def _step(model, opts, rank: int, step: int) -> None:
    model(*batch(step, rank)).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _rank_save(rank: int, world: int, root: str) -> None:
    for name, recipe in RECIPES.items():
        module = make_model()
        model, opts = _wrap(module, recipe(module))
        for step in range(2):
            _step(model, opts, rank, step)
        mf_fsdp.save_checkpoint(Path(root) / name, model, opts, step=2)
        model_sd, optim_sd = get_state_dict(model, opts)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(root) / f"{name}-dsd")
        expected = _full_state(model, opts)
        if rank == 0:
            torch.save(expected, Path(root) / f"{name}.pt")


def _load_mf(model, opts, root: Path, name: str) -> None:
    mf_fsdp.load_checkpoint(mf_fsdp.latest_checkpoint(root / name), model, opts)


def _load_dsd(model, opts, root: Path, name: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opts)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / f"{name}-dsd")
    set_state_dict(model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _rank_resume(rank: int, world: int, root: str) -> None:
    """Load into another world size (mf's checkpoint, and torch's DSD + DCP): the same
    state, then a step as torch's would be."""
    for (name, recipe), load in itertools.product(RECIPES.items(), (_load_mf, _load_dsd)):
        module = make_model(seed=1)
        model, opts = _wrap(module, recipe(module))
        load(model, opts, Path(root), name)
        expected = torch.load(Path(root) / f"{name}.pt", weights_only=True)
        label = f"{name} {load.__name__} x{world}"
        loaded = _full_state(model, opts)
        torch.testing.assert_close(
            loaded, expected, rtol=0, atol=0, msg=lambda m, label=label: f"{label}: {m}"
        )
        shadow = _Shadow(make_model, recipe)
        shadow.load_state(expected["state"])
        model(*batch(2, rank)).backward()
        shadow.step(model)
        for opt in opts:
            opt.step()
        shadow.check(model, label)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_resume_across_world_sizes(tmp_path: Path, saved: int, resumed: int) -> None:
    run_on_ranks(_rank_save, saved, str(tmp_path), timeout=180)
    run_on_ranks(_rank_resume, resumed, str(tmp_path), timeout=180)

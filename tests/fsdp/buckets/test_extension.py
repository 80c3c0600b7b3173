"""FSDP2's all-gather extension on mf's flat buckets (``buckets/extension.py``), against FSDP2.

Each test runs torch's FSDP2 on the same script in the same process:
- torchao float8 training with FP8 gathering under mf (both front ends, ZeRO-2 and
  ZeRO-3) equals FSDP2 with high-precision gathering (which is what FSDP2 can do
  on gloo) to 1e-5, with SGD and AdamW: the scale comes from the amax over the
  whole mesh, so the fp8 bits are the same. A no-grad forward gathers at most
  0.3x the bytes of fp32 for those weights, counted at the collective;
  ``precompute_float8_dynamic_scale_for_fsdp`` (one all-reduce for every scale)
  gives the same run;
- torchao NF4 bases with bf16 LoRA adapters (QLoRA) under mf equal FSDP2 (rtol
  2e-3); the frozen bases have no gradient buffer nor optimizer state and gather
  at most 0.3x the bytes of bf16;
- torch's own extension test subclasses, rebuilt here: a two-tensor subclass (both
  hook signatures) trains as one process, and a subclass that gathers in bf16
  and pads its uneven pieces itself trains as FSDP2;
- a checkpoint of a float8 model moves from mf to FSDP2 and back through DSD/DCP,
  and resumes exactly;
- a subclass whose hooks break the protocol on one rank stops every rank in one
  line instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.testing._internal.two_tensor import TwoTensor

import mf_fsdp
from mf_fsdp import fsdp2
from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.extension import plain_tensors
from tests._multiprocess import run_on_ranks

try:
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )
    from torchao.float8.float8_linear import Float8Linear
except ImportError:  # torchao is an optional extra
    Float8Linear = None


def _float8_skip_reason() -> str | None:
    if Float8Linear is None:
        return "needs torchao (the float8 extra)"
    try:  # torchao's float8 matmul: torch._scaled_mm on the CPU
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.ones(()), torch.ones(()), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        return f"torch {torch.__version__} has no CPU torch._scaled_mm ({error})"
    return None


needs_float8 = pytest.mark.skipif(
    _float8_skip_reason() is not None, reason=str(_float8_skip_reason())
)

STEPS = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------------- helpers
def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The values of ``tensor`` as a plain tensor (a subclass's first inner tensor)."""
    return next(plain_tensors(tensor))


def _full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole value, plain, whatever engine holds it (packed NF4 left out)."""
    values = {}
    for name, param in model.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if _plain(local).shape != local.shape:
            continue
        if isinstance(param, DTensor) and local is not _plain(local):  # a subclass's pieces
            param = DTensor.from_local(
                _plain(local),
                param.device_mesh,
                param.placements,
                shape=param.shape,
                stride=param.stride(),
            )
        if isinstance(param, DTensor):
            param = param.full_tensor()
        values[name] = _plain(param).detach().clone()
    return values


@contextlib.contextmanager
def _gathered_bytes() -> Iterator[list[int]]:
    """Sum the bytes the engine's all-gathers receive while the block runs."""
    seen = [0]
    original = collectives.all_gather_into

    def counted(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen[0] += output.numel() * output.element_size()
        return original(output, *args, **kwargs)

    collectives.all_gather_into = counted
    try:
        yield seen
    finally:
        collectives.all_gather_into = original


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------- float8
def _float8_model(fp8_gather: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64, bias=False),
        nn.ReLU(),
        nn.Linear(64, 48, bias=False),
        nn.ReLU(),
        nn.Linear(48, 32, bias=False),
    )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather)
    return convert_to_float8_training(model, config=config)


def _shard_float8(engine: str, model: nn.Module, world: int, zero: int = 3) -> nn.Module:
    """``model`` under torch's FSDP2, mf's FSDP2 front end, or mf's own interface."""
    if engine == "mf":
        return mf_fsdp.fully_shard_model(
            model, fsdp_unit_modules=[Float8Linear], zero_dp_strategy=zero
        )
    mesh = init_device_mesh("cpu", (world,))
    shard = torch_fully_shard if engine == "torch" else fsdp2.fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _float8_run(
    rank: int,
    world: int,
    engine: str,
    fp8_gather: bool,
    opt_name: str,
    zero: int = 3,
    precompute: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _shard_float8(engine, _float8_model(fp8_gather), world, zero)
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = model(torch.randn(16, 32, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(_mean_over_ranks(loss, world))
    return losses, _full_values(model)


def _rank_float8_parity(rank: int, world: int, opt_name: str) -> None:
    expected, values = _float8_run(rank, world, "torch", False, opt_name)
    initial = _full_values(_float8_model(False))
    for name in initial:
        assert (values[name] - initial[name]).abs().max() > 1e-3, f"{name} did not train"
    runs = {
        "mf fsdp2 front end, FP8 gathering": _float8_run(rank, world, "mf-fsdp2", True, opt_name),
        "mf ZeRO-3, FP8 gathering": _float8_run(rank, world, "mf", True, opt_name, 3),
        "mf ZeRO-2, FP8 gathering": _float8_run(rank, world, "mf", True, opt_name, 2),
        "mf ZeRO-3, precomputed scales": _float8_run(
            rank, world, "mf", True, opt_name, 3, precompute=True
        ),
    }
    for label, (losses, got) in runs.items():
        assert losses == pytest.approx(expected, rel=TOL["rtol"]), label
        for name, value in values.items():
            torch.testing.assert_close(got[name], value, **TOL, msg=f"{label}: {name}")


@needs_float8
@pytest.mark.multiprocess
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_float8_fp8_gathering_equals_fsdp2(opt_name: str) -> None:
    run_on_ranks(_rank_float8_parity, 2, opt_name)


def _rank_float8_bytes(rank: int, world: int) -> None:
    gathered = {}
    for fp8_gather in (False, True):
        model = _shard_float8("mf", _float8_model(fp8_gather), world)
        x = torch.randn(16, 32)
        with _gathered_bytes() as seen, torch.no_grad():
            model(x)
        gathered[fp8_gather] = seen[0]
        fsdp_weights = sum(
            isinstance(p, DTensor) and hasattr(p._local_tensor, "fsdp_pre_all_gather")
            for p in model.parameters()
        )
        assert fsdp_weights == (3 if fp8_gather else 0)
    # fp32 weights gather 4 bytes an element; FP8 gathering 1 byte (its scale stays local).
    assert gathered[True] <= 0.3 * gathered[False], gathered


@needs_float8
@pytest.mark.multiprocess
def test_float8_gathers_a_quarter_of_the_bytes() -> None:
    run_on_ranks(_rank_float8_bytes, 2)


# ---------------------------------------------------------------------- checkpoints
def _save_float8(engine: str, rank: int, world: int, path: str) -> tuple[float, dict]:
    """Train ``engine`` 2 steps and save through DSD; return the next loss and the weights."""
    model = _shard_float8(engine, _float8_model(engine != "torch"), world)
    opt = _optimizer("adamw", model.parameters())
    _steps(model, opt, rank, 0, 2)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    values = _full_values(model)
    return _steps(model, opt, rank, 2, 2), values


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, n: int) -> float:
    last = 0.0
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = model(torch.randn(16, 32, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        last = _mean_over_ranks(loss, dist.get_world_size())
    return last


def _load_float8(engine: str, rank: int, world: int, path: str) -> tuple[float, dict]:
    model = _shard_float8(engine, _float8_model(engine != "torch"), world)
    opt = _optimizer("adamw", model.parameters())
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    values = _full_values(model)
    return _steps(model, opt, rank, 2, 2), values


def _rank_float8_checkpoints(rank: int, world: int, root: str) -> None:
    for saver, loader in (("mf", "torch"), ("torch", "mf"), ("mf", "mf")):
        path = f"{root}/{saver}-to-{loader}"
        after_save, saved = _save_float8(saver, rank, world, path)
        after_load, loaded = _load_float8(loader, rank, world, path)
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
        assert after_load == pytest.approx(after_save, rel=TOL["rtol"]), (saver, loader)


@needs_float8
@pytest.mark.multiprocess
def test_float8_checkpoints_move_between_mf_and_fsdp2(tmp_path) -> None:
    run_on_ranks(_rank_float8_checkpoints, 2, str(tmp_path))


def _rank_float8_mf_checkpoint(rank: int, world: int, root: str) -> None:
    """mf's own checkpoints, with an optimizer built before wrapping (rebound by fully_shard)."""

    def wrapped() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _float8_model(True)
        optimizer = _optimizer("adamw", model.parameters())
        return mf_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Float8Linear])

    model, opt = wrapped()
    _steps(model, opt, rank, 0, 2)
    path = mf_fsdp.save_checkpoint(root, model, opt, step=2)
    expected = _steps(model, opt, rank, 2, 2)
    resumed, resumed_opt = wrapped()
    mf_fsdp.load_checkpoint(path, resumed, resumed_opt)
    assert _steps(resumed, resumed_opt, rank, 2, 2) == expected  # exact resume


@needs_float8
@pytest.mark.multiprocess
def test_float8_mf_checkpoint_resumes_exactly(tmp_path) -> None:
    run_on_ranks(_rank_float8_mf_checkpoint, 2, str(tmp_path))


def _meta_float8(engine: str, world: int, values: dict[str, torch.Tensor]) -> nn.Module:
    """FSDP2's (and torchtitan's) flow: build and shard on the meta device, then initialise."""
    with torch.device("meta"):
        model = _float8_model(engine != "torch")
    model = _shard_float8(engine, model, world)
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(values), options=options)  # DSD writes into the dict
    return model


def _rank_float8_meta_flow(rank: int, world: int) -> None:
    values = {name: v for name, v in _full_values(_float8_model(False)).items()}
    results = {}
    for engine in ("torch", "mf-fsdp2", "mf"):
        model = _meta_float8(engine, world, values)
        opt = _optimizer("adamw", model.parameters())
        results[engine] = [_steps(model, opt, rank, step, 1) for step in range(3)]
    assert results["mf-fsdp2"] == pytest.approx(results["torch"], rel=TOL["rtol"])
    assert results["mf"] == pytest.approx(results["torch"], rel=TOL["rtol"])


@needs_float8
@pytest.mark.multiprocess
def test_float8_built_on_the_meta_device_equals_fsdp2() -> None:
    run_on_ranks(_rank_float8_meta_flow, 2)


# ---------------------------------------------------------------------- NF4 QLoRA
def _nf4() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        pytest.skip("needs torchao (the float8 extra) with NF4 tensors")
    return nf4_tensor


class _QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable bf16 low-rank update (QLoRA's linear)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        nf4 = _nf4()
        base = torch.randn(dim, dim, dtype=torch.bfloat16) / math.sqrt(dim)
        self.weight = nn.Parameter(nf4.to_nf4(base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim, dtype=torch.bfloat16) / dim)
        self.lora_b = nn.Parameter(torch.randn(dim, rank, dtype=torch.bfloat16) / rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = _nf4().linear_nf4(x, self.weight)
        return base + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _qlora_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_QLoRALinear(256, 8), nn.GELU(), _QLoRALinear(256, 8))


def _qlora_run(rank: int, world: int, engine: str) -> tuple[list[float], dict, nn.Module, Any]:
    model = _qlora_model()
    mesh = init_device_mesh("cpu", (world,))
    shard = torch_fully_shard if engine == "torch" else fsdp2.fully_shard
    for layer in model:
        if isinstance(layer, _QLoRALinear):
            shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 256, generator=g).to(torch.bfloat16)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world))
    lora = {n: v for n, v in _full_values(model).items() if "lora" in n}
    return losses, lora, model, opt


def _rank_qlora(rank: int, world: int) -> None:
    expected, reference, _, _ = _qlora_run(rank, world, "torch")
    losses, lora, model, opt = _qlora_run(rank, world, "mf")
    assert losses == pytest.approx(expected, rel=2e-3)
    initial = {n: v for n, v in _full_values(_qlora_model()).items() if "lora" in n}
    for name, value in reference.items():
        torch.testing.assert_close(lora[name], value, rtol=2e-3, atol=2e-3, msg=name)
        assert (value.float() - initial[name].float()).abs().max() > 2e-2, f"{name} did not train"
    engine = mf_fsdp.MegatronFSDP.owner_of(model[0].weight)
    frozen = [g for g in engine.groups if g.extension and not g.requires_grad]
    assert len(frozen) == 2
    assert all(g.buffers is None for g in frozen)
    bases = {id(p) for n, p in model.named_parameters() if n.endswith(".weight")}
    assert not any(id(p) in bases for p in opt.state)
    # The frozen bases gather as NF4: half a byte an element and their scalers.
    with _gathered_bytes() as seen, torch.no_grad():
        model(torch.zeros(8, 256, dtype=torch.bfloat16))
    base_bytes = 2 * 256 * 256 * 2  # the two bases in bf16
    lora_bytes = 2 * 2 * (2 * 256 * 8)  # the adapters, gathered in bf16
    assert seen[0] - lora_bytes <= 0.3 * base_bytes, seen[0]


@pytest.mark.multiprocess
def test_nf4_qlora_equals_fsdp2() -> None:
    _nf4()
    run_on_ranks(_rank_qlora, 2)


# ---------------------------------------------------------------------- torch's extension tests
def _two_tensor_pre_v1(self: TwoTensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
    return (self.a, self.b), None


def _two_tensor_pre_v2(
    self: TwoTensor, mesh: Any, size: Any, stride: Any, module: Any, policy: Any
) -> tuple[tuple[torch.Tensor, ...], None]:
    return (self.a, self.b), None


def _two_tensor_post(
    self: TwoTensor, outputs: tuple[torch.Tensor, ...], metadata: Any, dtype: Any, *, out=None
) -> Any:
    a, b = outputs
    if out is None:
        return TwoTensor(a, b).to(dtype), (a, b)
    if a.dtype == dtype:  # refilled in place: the gathered tensors are its own
        assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
    else:  # cast into the parameter made by the first gather
        out.a.copy_(a)
        out.b.copy_(b)
    return None


@contextlib.contextmanager
def _two_tensor_extension(version: int) -> Iterator[None]:
    TwoTensor.fsdp_pre_all_gather = _two_tensor_pre_v1 if version == 1 else _two_tensor_pre_v2
    TwoTensor.fsdp_post_all_gather = _two_tensor_post
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


def _two_tensor_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[_MLP(8, 12) for _ in range(3)])
    for mlp in model:
        for layer in (mlp.in_proj, mlp.out_proj):
            layer.weight = nn.Parameter(
                TwoTensor(layer.weight.detach(), layer.weight.detach().clone())
            )
    return model


def _rank_two_tensor(rank: int, world: int, version: int, reshard: bool) -> None:
    with _two_tensor_extension(version):
        reference = _two_tensor_model()
        ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
        model = _two_tensor_model()
        mesh = init_device_mesh("cpu", (world,))
        for mlp in model:
            fsdp2.fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard)
        fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
        for step in range(6):
            loss = model(x).sum()
            loss.backward()
            ref_loss = reference(x).sum()
            ref_loss.backward()
            for param in reference.parameters():  # the mean over ranks, by hand
                dist.all_reduce(param.grad)
                param.grad.div_(world)
            torch.testing.assert_close(_plain(loss), _plain(ref_loss), **TOL)
            for _opt in (ref_opt, opt):
                _opt.step()
                _opt.zero_grad(set_to_none=step % 2 == 0)
        got, want = _full_values(model), _full_values(reference)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, **TOL, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("version", "reshard"), [(1, True), (2, True), (2, False)])
def test_two_tensor_extension_trains_as_one_process(version: int, reshard: bool) -> None:
    run_on_ranks(_rank_two_tensor, 2, version, reshard)


def _rank_two_tensor_meta_bf16(rank: int, world: int) -> None:
    """torch's end-to-end case: built on the meta device, bf16 compute, then initialised."""
    with _two_tensor_extension(2):
        values = {n: v.detach().clone() for n, v in _two_tensor_model().state_dict().items()}
        results = {}
        for engine in ("torch", "mf"):
            with torch.device("meta"):
                model = _two_tensor_model()
            shard = torch_fully_shard if engine == "torch" else fsdp2.fully_shard
            mesh = init_device_mesh("cpu", (world,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for mlp in model:
                shard(mlp, mesh=mesh, mp_policy=policy)
            shard(model, mesh=mesh, mp_policy=policy)
            model.to_empty(device="cpu")
            with torch.no_grad():  # each rank cuts its piece of the same values (DSD's full
                for name, param in model.named_parameters():  # state broadcasts one inner only)
                    value = distribute_tensor(
                        values[name], param.device_mesh, param.placements, src_data_rank=None
                    )
                    param.copy_(value)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
            losses = []
            for _ in range(3):
                loss = model(x).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(_mean_over_ranks(_plain(loss).float(), world))
            results[engine] = losses
        assert results["mf"] == pytest.approx(results["torch"], rel=1e-6), results


@pytest.mark.multiprocess
def test_two_tensor_built_on_the_meta_device_in_bf16_equals_fsdp2() -> None:
    run_on_ranks(_rank_two_tensor_meta_bf16, 2)


class _Bf16Gathered(torch.Tensor):
    """A tensor that travels in bf16 and pads its uneven pieces itself (torch's own test case)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> _Bf16Gathered:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        def unwrap(t: _Bf16Gathered) -> torch.Tensor:
            return t._data

        out = func(
            *pytree.tree_map_only(cls, unwrap, args),
            **pytree.tree_map_only(cls, unwrap, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> _Bf16Gathered:
        return _Bf16Gathered(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, size, stride, module, policy):
        rows = math.ceil(size[0] / mesh.size())
        padded = torch.zeros((rows, *size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, dtype, *, out=None):
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])  # the padding rows are not the parameter's
            return None
        whole = gathered.to(dtype)
        return whole, (gathered, whole)


def _bf16_model() -> nn.Module:
    torch.manual_seed(0)
    model = _MLP(3, 9)  # 9 and 3 rows over 2 ranks: uneven pieces, padded by the subclass
    for layer in (model.in_proj, model.out_proj):
        layer.weight = nn.Parameter(_Bf16Gathered(layer.weight.detach()))
    return model


def _rank_bf16_gather(rank: int, world: int) -> None:
    results = {}
    for engine in ("torch", "mf"):
        model = _bf16_model()
        shard = torch_fully_shard if engine == "torch" else fsdp2.fully_shard
        shard(model, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(3):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(_plain(loss), world))
        results[engine] = losses, _full_values(model)
    assert results["mf"][0] == pytest.approx(results["torch"][0], rel=1e-6)
    for name, value in results["torch"][1].items():
        torch.testing.assert_close(results["mf"][1][name], value, **TOL, msg=name)


@pytest.mark.multiprocess
def test_bf16_gathering_subclass_with_uneven_pieces_equals_fsdp2() -> None:
    run_on_ranks(_rank_bf16_gather, 2)


# ---------------------------------------------------------------------- broken hooks
class _Unpadded(_Bf16Gathered):
    """Breaks the protocol: an uneven piece comes back unpadded (only the short rank knows)."""

    def fsdp_pre_all_gather(self, mesh, size, stride, module, policy):
        return (self._data.to(torch.bfloat16),), None


class _FailsOnRankOne(_Bf16Gathered):
    """``pre`` raises on rank 1 only, after rank 0 is already in the gather."""

    def fsdp_pre_all_gather(self, mesh, size, stride, module, policy):
        if dist.get_rank() == 1:
            raise RuntimeError("the scale is not finite")
        return super().fsdp_pre_all_gather(mesh, size, stride, module, policy)


def _rank_broken_hooks(rank: int, world: int) -> None:
    model = nn.Linear(4, 3, bias=False)  # 3 rows over 2 ranks: rank 1's piece is short
    model.weight = nn.Parameter(_Unpadded(model.weight.detach()))
    with pytest.raises(RuntimeError, match=r"needs tensors of the padded piece's size \(2, 4\)"):
        mf_fsdp.fully_shard_model(model)


def _rank_failing_hook(rank: int, world: int) -> None:
    model = nn.Linear(4, 4, bias=False)
    model.weight = nn.Parameter(_FailsOnRankOne(model.weight.detach()))
    with pytest.raises(
        RuntimeError,
        match=r"_FailsOnRankOne.fsdp_pre_all_gather failed on rank 1: the scale is not finite",
    ):
        mf_fsdp.fully_shard_model(model)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["unpadded", "raises"])
def test_broken_hooks_stop_every_rank_in_one_line(case: str) -> None:
    body = _rank_broken_hooks if case == "unpadded" else _rank_failing_hook
    run_on_ranks(functools.partial(body), 2, timeout=60)

"""``mf_fsdp.fsdp2`` honours or refuses, in one line, what torch's FSDP2 interface offers.

Found tried as a new user would (issue 50, part 5), each now proven against torch's
FSDP2 on the same script, at world 2:

- ``MixedPrecisionPolicy.param_dtype_override_fn`` (torch 2.15): a unit whose weights
  keep fp32 computes in fp32 beside bf16 units, with FSDP2's losses; a call whose
  parameters would compute in two dtypes is refused naming both;
- ``fully_shard(..., dp_mesh_dims=...)``: accepted as a keyword; without the named
  storage mesh it names no dim, refused in one line;
- torch's ``register_fsdp_forward_method`` on a block's method called from the root's
  forward, and on a root method used for inference, and ``share_comm_ctx`` over two
  models: FSDP2's losses and outputs;
- ``load_state_dict(assign=True)`` into a model built on the meta device: FSDP2's
  losses; a state dict of another dtype is refused naming the key.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.torch_state import CALLER_STREAM
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import batch, make_model, make_optimizer, optimizer_step
from tests.fsdp.frontends.test_fsdp2_frontend import shard_like_torchtitan

WORLD = 2
ENGINES = (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard))
HAS_OVERRIDE = "param_dtype_override_fn" in inspect.signature(MixedPrecisionPolicy).parameters
needs_override = pytest.mark.skipif(
    not HAS_OVERRIDE,
    reason=f"torch {torch.__version__}'s MixedPrecisionPolicy has no param_dtype_override_fn "
    "(it came in torch 2.15)",
)


class _Gate(nn.Module):
    """A 4x4 gate that computes in its weight's dtype (fp32 when its weights keep fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class _Gated(nn.Module):
    """Two bf16-able layers and a gate whose 4x4 weight a policy keeps in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.body = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(F.relu(self.body(F.relu(self.inp(x)))))
        return (self.gate(h).float() * h.float()).square().mean()


def _keep_gate_fp32(param: nn.Parameter) -> torch.dtype | None:
    return torch.float32 if param.shape == (4, 4) else None


def _gate_dtype_into(seen: list[torch.dtype]):
    def hook(module: nn.Module, args: tuple) -> None:
        seen.append(module.proj.weight.dtype)

    return hook


def _rank_override(rank: int, world: int) -> None:
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=_keep_gate_fp32,
    )
    runs, seen = {}, {}
    for name, shard in ENGINES:
        torch.manual_seed(0)
        model = _Gated()
        shard(model.gate, mp_policy=policy)
        shard(model.body, mp_policy=policy)
        shard(model, mp_policy=policy)
        seen[name] = []
        model.gate.register_forward_pre_hook(_gate_dtype_into(seen[name]))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        runs[name] = []
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            runs[name].append(optimizer_step(model(x), opt, world))
    assert seen["mf"] == seen["torch"] == [torch.float32] * 4
    torch.testing.assert_close(
        torch.tensor(runs["mf"]), torch.tensor(runs["torch"]), rtol=1e-3, atol=0.0
    )
    # One call whose parameters would compute in bf16 and fp32: FSDP2 can, mf refuses.
    torch.manual_seed(0)
    mixed = _Gated()
    fsdp2.fully_shard(mixed, mp_policy=policy)
    with pytest.raises(NotImplementedError, match=r"gives inp\.weight torch\.bfloat16 but gate"):
        mixed(torch.randn(2, 4))
    for answer, error, match in (
        ("fp32", TypeError, "returned 'fp32' for inp.weight; expected a torch.dtype or None"),
        (torch.float16, ValueError, "returned torch.float16 for inp.weight"),
    ):
        model = _Gated()
        bad = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p, a=answer: a
        )
        fsdp2.fully_shard(model, mp_policy=bad)
        with pytest.raises(error, match=match):
            model(torch.randn(2, 4))


@needs_override
@pytest.mark.multiprocess
def test_param_dtype_override_keeps_a_unit_in_fp32_as_torch_fsdp2() -> None:
    run_on_ranks(_rank_override, WORLD, timeout=180)


def test_every_keyword_of_torchs_fully_shard_is_taken() -> None:
    torch_names = set(inspect.signature(torch_fully_shard).parameters)
    assert torch_names <= set(inspect.signature(fsdp2.fully_shard).parameters)


def test_dp_mesh_dims_without_the_storage_mesh_is_refused_in_one_line() -> None:
    """``dp_mesh_dims`` names dims of ``mesh``: without a named mesh it names nothing."""
    dims = pytest.importorskip("torch.distributed.fsdp").__dict__.get("DataParallelMeshDims")
    if dims is None:
        pytest.skip(f"torch {torch.__version__} has no DataParallelMeshDims (it came in 2.15)")
    dims = dims(shard="dp")
    with pytest.raises(ValueError, match=r"dp_mesh_dims=") as caught:
        fsdp2.fully_shard(make_model(), dp_mesh_dims=dims)
    message = str(caught.value)
    assert "\n" not in message
    assert "names dims of mesh, got mesh=None; expected the named SPMD storage mesh" in message


class _Stack(nn.Module):
    """Blocks whose ``run`` (not ``forward``) the root's forward calls; ``predict`` infers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_RunBlock() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.run(x)
        return self.head(x).square().mean()

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.run(x)
        return self.head(x)


class _RunBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model calls run, not forward")

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _stack(shard) -> _Stack:
    torch.manual_seed(0)
    model = _Stack()
    for block in model.blocks:
        shard(block)
        register_fsdp_forward_method(block, "run")
    shard(model)
    register_fsdp_forward_method(model, "predict")
    return model


def _rank_forward_methods(rank: int, world: int) -> None:
    runs, predictions = {}, {}
    for name, shard in ENGINES:
        models = [_stack(shard), _stack(shard)]  # two roots, as pipeline stages are
        share_comm_ctx(models)
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
        runs[name] = []
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            for model, opt in zip(models, opts, strict=True):
                runs[name].append(optimizer_step(model(x), opt, world))
        with torch.no_grad():
            predictions[name] = models[0].predict(torch.ones(2, 16))
        if name == "mf":
            ctx = [m._get_fsdp_state()._comm_ctx for m in models]
            assert ctx == [CALLER_STREAM, CALLER_STREAM]
            with pytest.raises(NotImplementedError, match="FSDPState._training_state of a"):
                _ = models[0]._get_fsdp_state()._training_state
    torch.testing.assert_close(torch.tensor(runs["mf"]), torch.tensor(runs["torch"]))
    torch.testing.assert_close(predictions["mf"], predictions["torch"])


@pytest.mark.multiprocess
def test_registered_forward_methods_and_a_shared_comm_context_as_torch_fsdp2() -> None:
    run_on_ranks(_rank_forward_methods, WORLD, timeout=180)


def _rank_assign(rank: int, world: int) -> None:
    source = make_model(seed=3)
    torch_fully_shard(source)
    values = {k: v.detach().clone() for k, v in source.state_dict().items()}
    runs = {}
    for name, shard in ENGINES:
        with torch.device("meta"):
            model = make_model()
        shard_like_torchtitan(model, shard, head_unit=False)
        model.load_state_dict(values, assign=True)
        opt = make_optimizer("adam", model.parameters())
        runs[name] = [optimizer_step(model(*batch(step, rank)), opt, world) for step in range(3)]
    torch.testing.assert_close(torch.tensor(runs["mf"]), torch.tensor(runs["torch"]))
    with torch.device("meta"):
        model = make_model()
    fsdp2.fully_shard(model)
    partial = {k: v for k, v in values.items() if k != "ln_f.bias"}
    with pytest.raises(KeyError, match="built on the meta device and the state dict has no 'ln_f"):
        model.load_state_dict(partial, assign=True)  # strict: every tensor at once
    model.load_state_dict(partial, assign=True, strict=False)  # a piece: FSDP2 takes it
    with pytest.raises(RuntimeError, match="has not given 'ln_f.bias' a value yet"):
        model(*batch(0, rank))
    model = make_model()
    fsdp2.fully_shard(model)
    doubles = {k: v.double() for k, v in values.items()}
    with pytest.raises(TypeError, match=r"assign=True\): wte.weight is torch.float64 in the"):
        model.load_state_dict(doubles, assign=True)


@pytest.mark.multiprocess
def test_load_state_dict_assign_gives_a_meta_model_its_values_as_torch_fsdp2() -> None:
    run_on_ranks(_rank_assign, WORLD, timeout=180)

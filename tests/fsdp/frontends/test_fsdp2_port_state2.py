"""More of torch's FSDP2 tests (training, comm, compose, autograd, extensions, state, logging).

Each scenario is a function of the ``fully_shard`` it is given and runs once per
engine in the same two gloo ranks (``on_both``): torch's FSDP2 first, then mf's,
each run making torch's assertions; where a scenario returns values (losses,
whole weights) the two engines' values are compared too. torch runs the
post-accumulate-grad hook tests on CUDA and the HSDP extension test at world 8
with two replicas: here the CPU, and a ``(2, 1)`` mesh (two replicas of one
shard each). The passing scenarios share one launch; each one mf does not serve
yet is a strict xfail with its own launch (``test_state2_not_yet``).
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint, replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.experimental import implicit_replication
from torch.testing._internal.common_dist_composable import CompositeModel, CompositeParamModel
from torch.testing._internal.common_distributed import SaveForwardInputsModel
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
from torch.testing._internal.two_tensor import TwoTensor

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, broadcast_params, torch_case
from tests.fsdp._fsdp2_port_common import on_both

preload_in_ranks(*RANK_MODULES)


def _root_move_forward_input_to_device(fully_shard, case: TestCase) -> torch.Tensor:
    """A root without parameters takes a tensor and a tuple of tensors; the CPU is its device."""

    class NoParams(nn.Module):
        def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return x + ys[0] + ys[1] + 1

    model = NoParams()
    fully_shard(model).to("cpu")
    torch.manual_seed(5)
    x, ys = torch.randn((3,)), (torch.randn((3,)), torch.randn((3,)))
    for tensor in (x, *ys):
        case.assertEqual(tensor.device, torch.device("cpu"))
    out = model(x, ys)
    case.assertEqual(out, x + ys[0] + ys[1] + 1)
    return out


def _post_acc_grad_hook_runs(fully_shard, case: TestCase) -> None:
    """A post-accumulate-grad hook on each sharded parameter runs once per backward."""
    counts: collections.Counter[str] = collections.Counter()

    def hook(name: str, param: torch.Tensor) -> None:
        counts[name] += 1

    model = MLP(8)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module)
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, name))
    model(torch.randn((2, 8))).sum().backward()
    case.assertEqual(set(counts), {name for name, _ in model.named_parameters()})
    case.assertEqual(set(counts.values()), {1})


def _post_acc_grad_hook_optim_parity(fully_shard, case: TestCase) -> list[torch.Tensor]:
    """An optimizer and LR scheduler per parameter, stepped in its hook: as one stepped after."""
    args = ModelArgs(n_layers=2, dropout_p=0.0)
    torch.manual_seed(42)
    model = Transformer(args)
    broadcast_params(model)
    ref_model = Transformer(args)
    ref_model.load_state_dict(model.state_dict())
    kwargs = {"lr": 1e-2, "foreach": False}
    for module in itertools.chain(ref_model.layers, [ref_model]):
        fully_shard(module)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_optim, step_size=2)
    for module in itertools.chain(model.layers, [model]):
        fully_shard(module)
    optims = {param: torch.optim.AdamW([param], **kwargs) for param in model.parameters()}
    scheds = {p: torch.optim.lr_scheduler.StepLR(o, step_size=2) for p, o in optims.items()}

    def step_in_hook(param: nn.Parameter) -> None:
        optims[param].step()
        optims[param].zero_grad()
        scheds[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_hook)
    torch.manual_seed(43 + dist.get_rank())
    inp = torch.randint(0, args.vocab_size, (2, 8))
    losses = []
    for _ in range(4):
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        ref_sched.step()
        loss = model(inp).sum()
        loss.backward()
        case.assertTrue(torch.equal(ref_loss, loss))
        for ref_param, param in zip(ref_model.parameters(), model.parameters(), strict=True):
            case.assertTrue(torch.equal(ref_param.to_local(), param.to_local()))
        losses.append(loss.detach())
    return losses


def _two_tensor_mlp() -> nn.Sequential:
    """torch's extension model: three bias-free MLPs whose weights are ``TwoTensor``s."""
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        for proj in (mlp.in_proj, mlp.out_proj):
            proj.weight = nn.Parameter(TwoTensor(proj.weight, proj.weight.clone()))
    return model


def _all_gather_extension_hsdp_mesh(fully_shard, case: TestCase) -> list[torch.Tensor]:
    """On an HSDP mesh the pre-all-gather extension is handed only the shard mesh.

    The hooks are set on each weight's sharded local tensor after ``fully_shard``
    (its class has none). Returns the output and the weights' whole gradients
    after one backward, for the cross-engine comparison.
    """
    meshes: list[DeviceMesh] = []
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(42)
    model = _two_tensor_mlp()
    for mlp in model:
        fully_shard(mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weights = [param for name, param in model.named_parameters() if "weight" in name]
    case.assertGreater(len(weights), 0)
    for param in weights:
        _plain_gather_hooks(param._local_tensor, meshes)
    torch.manual_seed(43 + dist.get_rank())
    out = model(torch.randn((2, 8)))
    case.assertGreater(len(meshes), 0)
    for seen in meshes:
        case.assertEqual(seen.ndim, 1)
        case.assertEqual(seen.size(), 1)
    out.sum().backward()
    return [out.detach(), *(param.grad.full_tensor() for param in weights)]


def _plain_gather_hooks(local: torch.Tensor, seen: list[DeviceMesh]) -> None:
    """Give ``local`` (a sharded weight's local tensor) hooks that gather it as a plain tensor."""

    def pre_all_gather(
        self: torch.Tensor,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        seen.append(mesh)
        return (self,), None

    @torch.no_grad()
    def post_all_gather(
        self: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        if out is not None:  # the outputs are the parameter's own storage: refilled already
            return None
        return outputs[0], (outputs[0],)

    local.fsdp_pre_all_gather = pre_all_gather.__get__(local)
    local.fsdp_post_all_gather = post_all_gather.__get__(local)


def _extension_set_after_wrap_trains(fully_shard, case: TestCase) -> list[torch.Tensor]:
    """Not torch's: hooks set on the local tensors after the wrap, sharded over 2 ranks.

    Three SGD steps; the losses and the whole weights go to the cross-engine comparison.
    """
    torch.manual_seed(42)
    model = _two_tensor_mlp()
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    weights = [param for name, param in model.named_parameters() if "weight" in name]
    for param in weights:
        _plain_gather_hooks(param._local_tensor, [])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(43 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn((2, 8))).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses + [param.full_tensor().a for param in weights]


def _unshard_no_param_group(fully_shard, case: TestCase) -> None:
    """``unshard(async_op=True)`` on a root that holds no parameter of its own returns a handle."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for lin in model:
        fully_shard(lin)
    fully_shard(model)
    handle = model.unshard(async_op=True)
    handle.wait()


def _unshard_without_lazy_init(fully_shard, case: TestCase) -> None:
    """``unshard()`` before the first forward leaves the whole weights registered."""
    torch.manual_seed(42)
    model = MLP(4)
    broadcast_params(model)
    ref_model = MLP(4)
    ref_model.load_state_dict(model.state_dict())
    fully_shard(model)
    model.unshard()
    for ref_param, param in zip(ref_model.parameters(), model.parameters(), strict=True):
        case.assertEqual(ref_param, param)


class _ReduceLayer(nn.Module):
    """A weight, then an all-reduce of the output left in flight (not differentiated)."""

    def __init__(self, dim: int, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        y = torch.relu(x @ self.weight)
        return y, dist.all_reduce(y, group=self.mesh.get_group(), async_op=True)


class _ThreeMLPs(nn.Module):
    """Three MLPs, each run once its input's all-reduce has been waited for."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp1, self.mlp2, self.mlp3 = MLP(dim), MLP(dim), MLP(dim)

    def forward(self, ys: list[torch.Tensor], works: list[Any]) -> torch.Tensor:
        out = []
        for mlp, y, work in zip((self.mlp1, self.mlp2, self.mlp3), ys, works, strict=True):
            work.wait()
            out.append(mlp(y))
        return out[0] + out[1] + out[2]


class _ReduceModel(nn.Module):
    """Each MLP's ``unshard(async_op=True)`` issued between the reduce layers, as torch's test."""

    def __init__(self, dim: int, mesh: DeviceMesh) -> None:
        super().__init__()
        self.reduces = nn.ModuleList(_ReduceLayer(dim, mesh) for _ in range(3))
        self.mlps = _ThreeMLPs(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys, works = [], []
        mlps = (self.mlps.mlp1, self.mlps.mlp2, self.mlps.mlp3)
        for reduce, mlp in zip(self.reduces, mlps, strict=True):
            y, work = reduce(x)
            ys.append(y)
            works.append(work)
            if hasattr(mlp, "unshard"):
                mlp.unshard(async_op=True)
        return self.mlps(ys, works)


def _unshard_async(fully_shard, case: TestCase) -> list[torch.Tensor]:
    """Explicit async unshards overlapping other all-reduces, under ``replicate``: DDP's losses."""
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(42)
    ref_model = replicate(_ReduceModel(8, mesh))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    torch.manual_seed(42)
    model = _ReduceModel(8, mesh)
    for mlp in (model.mlps.mlp1, model.mlps.mlp2, model.mlps.mlp3):
        fully_shard(mlp, reshard_after_forward=False)
    fully_shard(model.mlps)
    replicate(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(43 + dist.get_rank())
    inp = torch.randn((2, 8))
    out = []
    for _ in range(4):
        losses = []
        for each_model, each_optim in ((ref_model, ref_optim), (model, optim)):
            losses.append(each_model(inp).sum())
            losses[-1].backward()
            with implicit_replication():
                each_optim.step()
            each_optim.zero_grad()
        case.assertEqual(losses[0], losses[1])
        out.append(losses[1].detach())
    return out


def _replicate_and_fully_shard(fully_shard, case: TestCase, config: str) -> list[torch.Tensor]:
    """``replicate`` and ``fully_shard`` levels mixed (torch's config string, bottom-up levels).

    torch's test only runs the steps; here each step's loss also equals the all-``replicate``
    reference's.
    """
    torch.manual_seed(42)
    if config == "1fm,1r":
        model = CompositeModel(torch.device("cpu"))
        ref_model = copy.deepcopy(model)
        fully_shard(model.l1)
        replicate(model)
    elif config == "1r,1fm":
        model = CompositeParamModel(torch.device("cpu"))
        ref_model = copy.deepcopy(model)
        replicate(model.u1)
        fully_shard(model)
    elif config == "1r1fm,1fm":
        model = CompositeParamModel(torch.device("cpu"))
        ref_model = copy.deepcopy(model)
        replicate(model.u1)
        fully_shard(model.u2)
        fully_shard(model)
    else:
        raise ValueError(f"config={config!r}: expected one of torch's three kept configs")
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((2, 100))
    out = []
    for iter_idx in range(3):
        losses = []
        for each_model, each_optim in ((ref_model, ref_optim), (model, optim)):
            each_optim.zero_grad(set_to_none=iter_idx % 2 == 0)
            losses.append(each_model(inp).sum())
            losses[-1].backward()
            each_optim.step()
        case.assertEqual(losses[0], losses[1])
        out.append(losses[1].detach())
    return out


def _checkpoint_and_fully_shard(fully_shard, case: TestCase, strict: bool) -> None:
    """A checkpointed unit with an fp16 policy: its (recomputed) input is fp16, the rest fp32."""
    inputs: dict[nn.Module, torch.Tensor] = {}
    model = SaveForwardInputsModel(forward_inputs=inputs, cast_forward_inputs=False)
    checkpoint(model.c2.l if strict else model.c2)
    fully_shard(model.c2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    fully_shard(model)
    model(torch.zeros(2, 100)).sum().backward()
    case.assertEqual(inputs[model].dtype, torch.float32)
    case.assertEqual(inputs[model.c1].dtype, torch.float32)
    case.assertEqual(inputs[model.c2].dtype, torch.float16)


def _replicate_below_fully_shard(fully_shard, case: TestCase) -> None:
    """torch's configs with ``replicate`` on a child of a ``fully_shard`` root."""
    for config in ("1r,1fm", "1r1fm,1fm"):
        _replicate_and_fully_shard(fully_shard, case, config)


def _fully_shard_state(fully_shard, case: TestCase) -> None:
    """``fully_shard.state(module)``: one distinct state object per ``fully_shard`` call."""
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    states = [fully_shard.state(model)] + [fully_shard.state(mlp) for mlp in model]
    case.assertIsNotNone(states[0])
    case.assertEqual(len(set(states)), len(model) + 1)


class _Records(logging.Handler):
    """Keeps the text of every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fsdp_logging(fully_shard, case: TestCase) -> None:
    """With the ``fsdp`` log enabled (``TORCH_LOGS=fsdp``), each hook logs its step and unit."""
    records = _Records()
    names = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
    torch._logging.set_logs(fsdp=logging.DEBUG)
    for name in names:
        logging.getLogger(name).addHandler(records)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model(torch.randn((4, 4))).sum().backward()
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(records)
        torch._logging.set_logs()
    text = "\n".join(records.lines)
    for step in ("root_pre_forward", "root_post_backward"):
        case.assertIn(f"FSDP::{step}", text)
    for step in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        for unit in (0, 1):
            case.assertIn(f"FSDP::{step} ({unit})", text)


PASSING = (
    _root_move_forward_input_to_device,
    _all_gather_extension_hsdp_mesh,
    _extension_set_after_wrap_trains,
    _unshard_no_param_group,
    _unshard_without_lazy_init,
    _unshard_async,
    _replicate_below_fully_shard,
    _post_acc_grad_hook_runs,
    _post_acc_grad_hook_optim_parity,
    _fully_shard_state,
)
NOT_YET = {
    _fsdp_logging: "by design: mf logs nothing under TORCH_LOGS=fsdp (FSDP2's FSDP::<hook> "
    "(<unit>) lines): its hooks carry no logging call, and no value differs",
}


def _rank_scenarios(rank: int, world: int, names: tuple[str, ...]) -> None:
    case = torch_case()
    scenarios = {scenario.__name__: scenario for scenario in (*PASSING, *NOT_YET)}
    for name in names:
        on_both(case, scenarios[name], case)
    if not names or names[0] != PASSING[0].__name__:
        return
    on_both(case, _replicate_and_fully_shard, case, "1fm,1r")
    for strict in (False, True):
        on_both(case, _checkpoint_and_fully_shard, case, strict)


@pytest.mark.multiprocess
def test_state2_scenarios_match_torch() -> None:
    """The passing rows of docs/fsdp2.md's "more" table from this file, on both engines."""
    run_on_ranks(_rank_scenarios, WORLD, tuple(s.__name__ for s in PASSING))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(scenario.__name__, marks=pytest.mark.xfail(strict=True, reason=reason))
        for scenario, reason in NOT_YET.items()
    ],
)
def test_state2_not_yet(name: str) -> None:
    """A scenario mf does not serve yet, one launch each (strict xfail: fails once mf serves it)."""
    run_on_ranks(_rank_scenarios, WORLD, (name,))

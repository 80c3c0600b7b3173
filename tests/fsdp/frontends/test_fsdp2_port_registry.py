"""FSDP2 behaviours torch's own tools rely on: the composable registry, torch.func, roots.

torch's ``replicate()`` (DDP as a composable API) skips every submodule that
torch's composable registry lists under ``fully_shard``: those parameters are
the sharding engine's, and DDP's reducer must not take them (torch's FSDP2
suite runs ``replicate`` over sharded children, as in ``test_fully_shard_training``
and ``test_fully_shard_ignore_params``). The first call of a sharded model may
come inside ``torch.func.jvp``; a root with no parameters of its own is sharded
as FSDP2 shards it, and a model with no parameter at all runs as a plain module.
Each scenario runs with torch's ``fully_shard`` and with
``mf_fsdp.fsdp2.fully_shard`` in the same gloo ranks
(``tests.fsdp._fsdp2_port_common.on_both``), is checked against a single-process
or ``replicate`` reference, and the two engines' results are compared too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, replicated_reference, torch_case
from tests.fsdp._fsdp2_port_common import NEWER_FSDP2, full, on_both, train_pairs

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6), nn.Linear(6, 6))


def _replicate_over_sharded(shard, adam: bool) -> list:
    """``replicate`` on a parent whose first two linears are sharded; the last one is DDP's."""
    case = torch_case()
    torch.manual_seed(0)
    model = _mlp()
    ref_model = replicated_reference(model)
    shard(model[0])
    shard(model[2])
    replicate(model)
    opt_cls = torch.optim.Adam if adam else torch.optim.SGD
    ref_optim = opt_cls(ref_model.parameters(), lr=1e-2)
    optim = opt_cls(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    inputs = [torch.randn(4, 6) for _ in range(3)]
    losses = train_pairs(case, [(ref_model, ref_optim), (model, optim)], lambda i: (inputs[i],), 3)
    # DDP's reducer holds only the unsharded linear's two parameters.
    ddp = replicate.state(model)._ddp
    case.assertEqual(len(list(ddp.parameters())), 2)
    for ref_param, param in zip(ref_model.parameters(), model.parameters(), strict=True):
        case.assertEqual(full(param), ref_param.detach())
    return losses


def _registry(shard) -> None:
    """The registry lists a sharded module under ``fully_shard``; a second API is refused."""
    case = torch_case()
    model = _mlp()
    shard(model[0])
    shard(model)
    case.assertIn("fully_shard", _get_registry(model[0]) or {})
    case.assertIn("fully_shard", _get_registry(model) or {})
    case.assertIsNone(_get_registry(model[2]))
    case.assertIsInstance(model, FSDPModule)
    with case.assertRaisesRegex(RuntimeError, "already managed by `fully_shard`"):
        replicate(model)
    other = mf_fully_shard if shard is torch_fully_shard else torch_fully_shard
    with case.assertRaisesRegex(AssertionError, "can only be applied to a module once"):
        other(model[0])


def _jvp_first_call(shard) -> list:
    """The model's first call is inside ``torch.func.jvp``: the plain model's values."""
    case = torch_case()
    torch.manual_seed(0)
    model = _mlp()
    ref_model = copy.deepcopy(model)
    shard(model[0])
    shard(model)
    torch.manual_seed(1 + dist.get_rank())
    inp, tangent = torch.randn(4, 6), torch.randn(4, 6)
    out, jvp_out = torch.func.jvp(model, (inp,), (tangent,))
    ref_out, ref_jvp = torch.func.jvp(ref_model, (inp,), (tangent,))
    case.assertEqual(out, ref_out)
    case.assertEqual(jvp_out, ref_jvp)
    model(inp).sum().backward()  # and trains after it
    return [out, jvp_out]


class _NoOwnParams(nn.Module):
    """A root whose parameters are all its children's; one child not sharded on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def _root_without_params(shard, children: str) -> list:
    case = torch_case()
    torch.manual_seed(0)
    model = _NoOwnParams()
    ref_model = replicated_reference(model)
    if children in ("inner", "both"):
        shard(model.inner)
    if children == "both":
        shard(model.head)
    shard(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    inputs = [torch.randn(4, 6) for _ in range(3)]
    return train_pairs(case, [(ref_model, ref_optim), (model, optim)], lambda i: (inputs[i],), 3)


def _no_params_at_all(shard) -> list:
    """A model with nothing to shard (FSDP2 accepts it): it runs as the plain module."""
    case = torch_case()
    torch.manual_seed(1 + dist.get_rank())
    out = []
    for make in (lambda: nn.Sequential(nn.ReLU()), lambda: nn.BatchNorm1d(6, affine=False)):
        model, ref_model = make(), make()
        shard(model)
        inp = torch.randn(4, 6, requires_grad=True)
        ref_inp = inp.detach().clone().requires_grad_(True)
        model(inp).pow(2).sum().backward()
        ref_model(ref_inp).pow(2).sum().backward()
        case.assertEqual(list(model.parameters()), [])
        case.assertEqual(inp.grad, ref_inp.grad)
        case.assertEqual(model.state_dict(), ref_model.state_dict())
        out.append(inp.grad)
    return out


def _rank_registry(rank: int, world: int) -> None:
    case = torch_case()
    for adam in (False, True):
        on_both(case, _replicate_over_sharded, adam)
    on_both(case, _registry)
    on_both(case, _jvp_first_call, torch_runs=NEWER_FSDP2)
    for children in ("inner", "both"):
        on_both(case, _root_without_params, children)
    on_both(case, _no_params_at_all)


@pytest.mark.multiprocess
def test_registry_replicate_jvp_and_roots_match_torch() -> None:
    """replicate over sharded children (SGD, Adam), the registry, jvp, roots, no parameters."""
    run_on_ranks(_rank_registry, WORLD)

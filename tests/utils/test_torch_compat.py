"""mf_utils.torch_compat: what differs between the torch releases mf supports, bridged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from mf_utils import collective_name, ensure_subclass_torch_dispatch, is_torch_min_version
from tests._multiprocess import cpu_mesh, run_on_ranks


def test_collective_names_are_those_of_the_running_torch() -> None:
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast"):
        assert callable(getattr(dist, collective_name(name)))
    renamed = is_torch_min_version("2.15")
    assert collective_name("all_gather_single") == (
        "all_gather_single" if renamed else "all_gather_into_tensor"
    )
    assert collective_name("reduce_scatter_tensor") == "reduce_scatter_tensor"  # the alias
    with pytest.raises(ValueError, match="name: expected a torch.distributed collective, got 'x'"):
        collective_name("x")


@pytest.mark.parametrize("value", [3, torch.Tensor, DTensor.__torch_dispatch__])
def test_ensure_subclass_torch_dispatch_needs_a_class_with_its_own_classmethod(value) -> None:
    if value is torch.Tensor:
        value = type("NoDispatch", (), {})
    with pytest.raises(TypeError, match="subclass: expected a tensor subclass"):
        ensure_subclass_torch_dispatch(value)


class _Recording(DTensor):
    """A DTensor subclass that records the ops it sees and keeps its type in their results."""

    seen: list[str] = []  # noqa: RUF012

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func.__name__)

        def base(value):
            if type(value) is _Recording:
                return DTensor(value._local_tensor, value._spec, requires_grad=value.requires_grad)
            return value

        args = torch.utils._pytree.tree_map(base, args)
        kwargs = torch.utils._pytree.tree_map(base, kwargs or {})
        out = func(*args, **kwargs)
        if type(out) is DTensor:
            return _Recording(out._local_tensor, out._spec, requires_grad=out.requires_grad)
        return out


def _rank_dispatch(rank: int, world: int) -> None:
    ensure_subclass_torch_dispatch(_Recording)
    ensure_subclass_torch_dispatch(_Recording)  # idempotent
    mesh = cpu_mesh((world,), ("dp",))
    plain = DTensor.from_local(torch.arange(6.0).view(3, 2), mesh, [Shard(0)])
    x = _Recording(plain._local_tensor, plain._spec, requires_grad=False)
    y = x * 2 + 1
    assert type(y) is _Recording
    assert torch.equal(y.to_local(), torch.arange(6.0).view(3, 2) * 2 + 1)
    param = torch.nn.Parameter(x)  # needs detach() to keep the subclass
    assert type(param) is _Recording
    assert {"mul.Tensor", "add.Tensor", "detach.default"} <= set(_Recording.seen)


@pytest.mark.multiprocess
def test_a_dtensor_subclass_sees_its_ops_on_every_supported_torch() -> None:
    """On torch 2.11 DTensor's C++ dispatch would take these ops and lose the subclass."""
    run_on_ranks(_rank_dispatch, 1)

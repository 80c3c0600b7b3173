"""Every behaviour of torch that differs across the range mf supports (2.11 to 2.15), in one place.

mf is written against the newest torch. Where an older release in the
supported range behaves differently, the difference is bridged here, named
by the torch behaviour it covers and the release that changed it, so the
rest of mf has no version checks of its own. When the floor passes a
release, its entries here go.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from mf_utils.versions import is_torch_min_version

__all__ = ["collective_name", "ensure_subclass_torch_dispatch"]

# torch 2.15 renamed two collectives; the old names stay as aliases that call the new
# ones. Before it, only the old names exist.
_COLLECTIVE_ALIASES = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


def collective_name(name: str) -> str:
    """The name under which the running torch defines the ``torch.distributed`` collective ``name``.

    ``name`` is the newest torch's name. torch 2.15 renamed
    ``all_gather_into_tensor`` to ``all_gather_single`` and
    ``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old names
    became aliases calling the new ones); on an older torch this returns the
    old name. Code that wraps a collective (to count it) must wrap the
    function that does the work, not an alias, or it counts calls twice.

    Raises:
        ValueError: if no collective of that name exists in this torch.
    """
    if hasattr(dist, name):
        return name
    old = _COLLECTIVE_ALIASES.get(name)
    if old is None or not hasattr(dist, old):
        raise ValueError(
            f"name: expected a torch.distributed collective, got {name!r}, which torch "
            f"{torch.__version__} does not define"
        )
    return old


_routed: set[type] = set()
_routed_lock = threading.Lock()
_libraries_kept_alive: list[Any] = []  # a Library drops its registrations when collected


def ensure_subclass_torch_dispatch(subclass: type[torch.Tensor]) -> None:
    """Make torch call ``subclass.__torch_dispatch__`` for every op, on every supported torch.

    ``subclass`` is a subclass of ``torch.distributed.tensor.DTensor`` that
    overrides ``__torch_dispatch__``. From torch 2.12, torch's C++ DTensor
    dispatch takes only DTensors whose class keeps DTensor's own
    ``__torch_dispatch__``, and hands the others to their override. In
    torch 2.11 it takes every instance of a DTensor subclass and never calls
    the override: ``Parameter(x)`` then fails ("detach() returns ... DTensor")
    and every result silently loses the subclass. On 2.11 this registers the
    override as ``subclass``'s torch_dispatch rule (``torch.library.register_torch_dispatch``)
    for every operator torch has registered, which torch consults before its
    DTensor dispatch. On newer torch it does nothing. Idempotent; call it
    before the first instance is used.

    Operators registered later (custom ops of a library imported afterwards)
    are not covered on torch 2.11: DTensor handles them, and the result of
    such an op is a plain DTensor.

    Raises:
        TypeError: if ``subclass`` is not a class that overrides ``__torch_dispatch__``.
    """
    dispatch = getattr(subclass, "__torch_dispatch__", None)
    function = getattr(dispatch, "__func__", None)
    if not isinstance(subclass, type) or function is None:
        raise TypeError(
            f"subclass: expected a tensor subclass with a __torch_dispatch__ classmethod, got "
            f"{subclass!r}"
        )
    if is_torch_min_version("2.12"):
        return
    with _routed_lock:
        if subclass in _routed:
            return
        libraries: dict[str, Any] = {}
        for qualname in torch._C._dispatch_get_all_op_names():
            namespace = qualname.split("::", 1)[0]
            library = libraries.get(namespace)
            if library is None:
                library = libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
            torch.library.register_torch_dispatch(qualname, subclass, function, lib=library)
        _routed.add(subclass)
        _libraries_kept_alive.extend(libraries.values())

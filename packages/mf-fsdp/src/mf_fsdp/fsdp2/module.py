"""What a module becomes under ``mf_fsdp.fsdp2.fully_shard``: torch's ``FSDPModule`` on mf's engine.

``fully_shard`` swaps each module's class for ``FSDP<Class>`` (``fsdp_class``):
``FSDPModule`` first in the MRO, then the module's own class, one class per
original class, as FSDP2 does. ``FSDPModule`` subclasses torch's, so
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds, and adds two things:

- the module contract: the model's first use (a call, ``parameters()`` /
  ``named_parameters()``, ``state_dict()``, ``load_state_dict()``, an FSDPModule
  method) builds the engine (``records.ensure_built``); state dicts are keyed by
  the module's own names with sharded values; ``to_empty`` and ``.to()`` follow
  FSDP2's meta-device flow;
- torch's ``FSDPModule`` methods, each honoured through the engine's units (the
  record's ``unit``; the root's own unit is the engine's ``_root``) or refused by
  name (``UNSUPPORTED``, see [Note: what is honoured]).

Invariants: every public method of the installed torch's ``FSDPModule`` is either
defined here or raises ``NotImplementedError`` naming itself; nothing silently
does nothing. The one module-level mapping, ``_CLASSES``, caches the generated
classes (FSDP2 keeps the same cache); it holds no marks and no engine. This module
keeps no state of its own: it reads and writes the records ``fully_shard`` left on
the modules, and must not build buckets or run collectives except through the
engine's unit hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle

from mf_fsdp.engine.assemble import reduce_spec_for
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.engine.options import check_gradient_factor
from mf_fsdp.engine.unit import Unit
from mf_fsdp.fsdp2.handles import FinishedReduction, GatherHandle, GradientReductionHandle
from mf_fsdp.fsdp2.records import RECORD_ATTR, CallRecord, engine_or_none, ensure_built
from mf_fsdp.fsdp2.torch_state import TorchStateView

__all__ = ["UNSUPPORTED", "FSDPModule", "fsdp_class"]

_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``FSDPModule`` first in the MRO, then ``cls`` (one class per ``cls``)."""
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy}
        )
    return _CLASSES[cls]


def _no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    # FSDP2 raises AssertionError here; code that catches it keeps working.
    raise AssertionError(
        "FSDP does not support deepcopy of a module sharded by mf_fsdp.fsdp2 (as with FSDP2); "
        "expected a copy through its state_dict()"
    )


if TYPE_CHECKING:
    # For the type checker only: torch's FSDPModule is a mixin that does not derive from
    # nn.Module, but every FSDPModule is one, as fsdp_class puts the module's own class after
    # it; so the methods below may call nn.Module's (super() reaches the module's class).
    class _ModuleFSDPModule(TorchFSDPModule, nn.Module): ...

else:
    _ModuleFSDPModule = TorchFSDPModule


class FSDPModule(_ModuleFSDPModule):
    """What a module becomes under ``mf_fsdp.fsdp2.fully_shard``: torch's ``FSDPModule``, on mf.

    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds, as for FSDP2 (torch's
    DSD and DCP never look at it: DSD checks for FSDP1's wrapper class only; torch's
    pipelining schedules do, and then call these methods). Each method of torch's
    class is honoured through the engine or raises ``NotImplementedError`` naming
    itself (see [Note: what is honoured]).
    """

    _orig_cls_mro_index = 3  # [FSDP<Orig>, FSDPModule (mf), FSDPModule (torch), Orig, ...]

    # -- the module contract: the first use builds the engine
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build the engine on the first call, then run the module (with its hooks).

        The root's call first carries the user's ``requires_grad_`` on the sharded
        parameters over to their compute forms (``GradSync.follow_requires_grad``).
        """
        record = self.__dict__[RECORD_ATTR]
        engine = record.engine if record.engine is not None else engine_or_none(self)
        if engine is not None and record.is_root:
            engine._grads.follow_requires_grad()
        return super().__call__(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters, sharded (parameter-shaped DTensors) between passes."""
        if not self.__dict__[RECORD_ATTR].building:  # the engine's own walks while it is built
            engine_or_none(self)
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict: its own keys, sharded DTensor values."""
        engine = engine_or_none(self)
        if engine is None:  # no parameter to shard: a plain module's state dict
            return super().state_dict(*args, **kwargs)
        with engine._forms.sharded():
            return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load any layout (sharded, other world size, full) into the engine's storage.

        ``assign=True`` (FSDP2's way to give a meta-device model its values without
        ``to_empty``) loads the same values: mf keeps every parameter in its flat
        buffers, so they are copied there (the parameter objects stay). A model
        built on the meta device gets storage first (``to_empty`` on the engine's
        device) and must then find every tensor in ``state_dict``, or, with
        ``strict=False``, in this and later calls before its first forward (FSDP2
        leaves the rest on the meta device; mf's storage holds no values there, so
        a forward before they are all given stops in one line). What assigning
        would change beyond the values, a tensor's dtype, is refused.

        Raises:
            TypeError: with ``assign=True``, for an entry whose dtype is not its tensor's.
            KeyError: with ``assign=True`` and ``strict=True`` on a meta-device model, for
                a missing tensor.
        """
        engine = engine_or_none(self)
        if engine is None:  # no parameter to shard: a plain module's load
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            meta = engine._awaiting_to_empty or bool(engine._unassigned)
            missing = _check_assignable(self, state_dict, meta=meta and strict)
            if engine._awaiting_to_empty:
                engine.to_empty(device=engine.device)
                engine._unassigned = frozenset(missing)
            else:
                engine._unassigned &= missing
        with engine._forms.sharded():
            return super().load_state_dict(state_dict, strict=strict)

    # The override's ignore: torch types the result as FSDP2's own FSDPState; mf answers with a
    # view that has the attributes torch's callers read, over an engine that is not FSDP2's.
    def _get_fsdp_state(self) -> TorchStateView:  # type: ignore[override]
        """What torch's ``register_fsdp_forward_method`` and ``share_comm_ctx`` read.

        torch's free functions over FSDP2 modules reach for FSDP2's state through this
        method; mf answers with a view over its engine (see ``torch_state``).
        """
        ensure_built(self)  # mf's hooks on the module are known once the engine is built
        record = self.__dict__[RECORD_ATTR]
        if record.state_view is None:
            record.state_view = TorchStateView(ensure_built, record.hook_ids)
        return record.state_view

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Any:
        """FSDP2's meta-device flow: storage for meta tensors, before or after sharding."""
        record = self.__dict__[RECORD_ATTR]
        if record.engine is None:
            return super().to_empty(device=device, recurse=recurse)
        if not record.is_root:
            raise NotImplementedError(
                "to_empty on a block after the model was sharded: call it on the root"
            )
        record.engine.to_empty(device=device, recurse=recurse)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()`` / ``.float()`` and the like: any before the engine is built; after, a no-op.

        After the build (the model's first ``parameters()``, ``state_dict()`` or
        forward) a conversion that leaves every parameter as it is (a move to the
        device the buckets are on, a cast to the parameters' own dtype: what
        training scripts do after wrapping) converts the buffers, as ``nn.Module``
        would. One that changes a parameter is refused: the engine allocated each
        unit's flat buffers (shard, main weights, gather and gradient buffers) in
        the parameters' dtype on its device, and every sharded parameter is a view
        of them, so a new dtype or device would mean building them all again.

        Raises:
            NotImplementedError: after the build, for a conversion that changes a parameter.
        """
        engine = self.__dict__[RECORD_ATTR].engine
        if engine is None:
            return nn.Module._apply(self, fn, recurse)
        with engine._forms.sharded():  # as FSDP2's _apply reshards first
            params = nn.Module.named_parameters(self, recurse=recurse)
            changed = next((name for name, param in params if fn(param) is not param), None)
        if changed is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.to() / .double() / .cuda() after mf_fsdp.fsdp2 built "
                f"its buckets (the model's first parameters(), state_dict() or forward) would "
                f"change parameter {changed!r}, which mf cannot; call it right after "
                "fully_shard, before the first use (for a compute dtype: "
                "MixedPrecisionPolicy(param_dtype=...))"
            )
        for module in nn.Module.modules(self) if recurse else (self,):
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = fn(buffer)
        return self

    # -- FSDPModule's methods
    def _engine_and_record(self) -> tuple[MegatronFSDP, CallRecord]:
        engine = ensure_built(self)
        return engine, self.__dict__[RECORD_ATTR]

    def _records_below(self, recurse: bool) -> list[CallRecord]:
        """This call's record and, with ``recurse``, those of the FSDP modules inside it."""
        own = self.__dict__[RECORD_ATTR]
        if not recurse:
            return [own]
        found = {id(own): own}
        for sub in nn.Module.modules(self):
            record = sub.__dict__.get(RECORD_ATTR)
            if record is not None:
                found.setdefault(id(record), record)
        return list(found.values())

    def _units(self, recurse: bool) -> list[Unit]:
        """The engine's units of this call and, with ``recurse``, of those inside it.

        The root's own unit holds the parameters outside every other unit.
        """
        engine, _ = self._engine_and_record()
        units = [
            engine._root if record.is_root else record.unit
            for record in self._records_below(recurse)
        ]
        return [unit for unit in units if unit is not None]

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in backward (True) or accumulate them locally (False).

        On the root with ``recurse`` (the default) it applies to the whole model, as
        mf's ``no_sync``: every unit's own setting returns to True. Otherwise it
        applies to this module's unit (and, with ``recurse``, the units inside it):
        a unit whose sync is off keeps its grads local across backwards and reduces
        them with its first backward whose sync is on (or before the optimizer step).
        """
        engine, record = self._engine_and_record()
        policy = engine.sync_policy
        flag = bool(requires_gradient_sync)
        if record.is_root and recurse:
            for unit in (engine._root, *engine._units):
                unit.requires_gradient_sync = True
            policy.suppressed = not flag
            policy.last_microbatch = flag
            return
        if flag and policy.suppressed:
            raise NotImplementedError(
                f"{type(self).__name__}.set_requires_gradient_sync(True) on one module while "
                "the root turned sync off for the whole model: mf cannot sync one unit then; "
                "turn it on at the root (recurse=True) first"
            )
        for unit in self._units(recurse):
            unit.requires_gradient_sync = flag

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (True) or keep (False) each unit's gathered weights after its forward."""
        if not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"set_reshard_after_forward({reshard_after_forward!r}): only a bool is supported"
            )
        self._engine_and_record()
        for record in self._records_below(recurse):
            record.reshard_after_forward = reshard_after_forward
            if record.unit is not None:
                record.unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free (True) or keep (False) the unit's gathered weights after its backward.

        A kept unit is reused by its next forward or backward, until ``reshard()``
        or the optimizer step (which changes its shards) releases it.
        """
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(
                "set_reshard_after_backward: reshard_after_backward must be a bool, got "
                f"{reshard_after_backward!r}"
            )
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Gather (True, the default) or not (False) this module's unit for its backward.

        As FSDP2's: ``False`` is for a unit none of whose weights its backward reads
        (embeddings: their weight gradient needs only the indices), so the backward
        skips the unit's all-gather (and its prefetch); its gradients are accumulated
        and reduced as always. A unit still gathered then (``reshard_after_forward=
        False``) is used as it is. A weight the backward does read has no storage
        then, so autograd stops with an error, as with FSDP2.
        """
        if not isinstance(unshard_in_backward, bool):
            raise TypeError(
                "set_unshard_in_backward: unshard_in_backward must be a bool, got "
                f"{unshard_in_backward!r}"
            )
        record = self.__dict__[RECORD_ATTR]
        record.unshard_in_backward = unshard_in_backward  # the engine's build reads it
        if record.engine is not None:  # FSDP2's tests set it between the calls: no build here
            for unit in self._units(recurse=False):
                unit.unshard_in_backward = unshard_in_backward

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's unit now (not recursive), as FSDP2's ``unshard``.

        With ``async_op`` the gather is started and a handle returned whose
        ``wait()`` finishes it (the unit's next use waits too); else None once done.
        """
        hooks = self._engine_and_record()[0]._unit_hooks
        waits = [hooks.unshard(unit, bool(async_op)) for unit in self._units(recurse=False)]
        return GatherHandle(waits) if async_op else None

    def reshard(self) -> None:
        """Release this module's gathered weights now (not recursive), as FSDP2's ``reshard``."""
        hooks = self._engine_and_record()[0]._unit_hooks
        for unit in self._units(recurse=False):
            hooks.reshard(unit)

    def reset_iter_state(self) -> None:
        """Forget a forward or backward an exception cut short, as FSDP2's ``reset_iter_state``.

        Every unit of the model is released and back to IDLE, so the next forward
        starts a fresh pass (the next root forward would also release the units a
        forward left gathered; this covers a backward cut short too). Before the
        engine is built there is nothing to forget.
        """
        engine = self.__dict__[RECORD_ATTR].engine
        if engine is not None:
            engine._unit_hooks.reset_iteration()

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Accepted and checked, then a no-op: FSDP2's cap on reduce-scatter input buffers.

        mf reduces a unit's gradients in place in its flat bucket (no copy-in buffer
        per reduce-scatter) and its communication window bounds what is in flight,
        so there is no buffer count to raise. Bad values raise as FSDP2's do.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")

    def set_modules_to_forward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """Gather exactly ``modules``' units, coalesced, when this unit's forward gathers it.

        Replaces the default (the next units of the last forward's order that fit
        in the communication window); as FSDP2's, not on the root.
        """
        units = _prefetched_units(self, modules, "set_modules_to_forward_prefetch")
        for unit in self._units(recurse=False):
            unit.prefetch_forward = units

    def set_modules_to_backward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """Gather exactly ``modules``' units, coalesced, when this unit's backward gathers it.

        Replaces the default (the previous units of the forward's order that fit in
        the communication window); as FSDP2's, not on the root.
        """
        units = _prefetched_units(self, modules, "set_modules_to_backward_prefetch")
        for unit in self._units(recurse=False):
            unit.prefetch_backward = units

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backwards end the step's gradient work, as FSDP2's (any module).

        True (the default): a backward's end waits for its reductions and hands the
        grads out. False (micro-batches before the last, 1F1B schedules): the
        reductions are launched (per ``set_requires_gradient_sync``) and left in
        flight; the next backward, a later last one, or the optimizer step finishes
        them. Stays as set until set again.
        """
        if not isinstance(is_last_backward, bool):
            raise TypeError(
                f"set_is_last_backward: is_last_backward must be a bool, got {is_last_backward!r}"
            )
        self._engine_and_record()[0].sync_policy.auto_sync = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Leave the end of the backward to ``finalize_backward`` (True), as FSDP2's (root only).

        While on, no backward's end waits for a reduction or hands a gradient out
        (``set_is_last_backward`` has no effect): torch's pipeline stages run one
        backward per micro-batch with gradient sync off, then finalize once.

        Raises:
            TypeError: if ``enabled`` is not a bool.
            RuntimeError: on a module other than the root, as FSDP2.
        """
        if not isinstance(enabled, bool):
            raise TypeError(
                f"set_manual_backward_finalization: enabled must be a bool, got {enabled!r}"
            )
        engine, record = self._engine_and_record()
        if not record.is_root:
            raise RuntimeError(
                f"set_manual_backward_finalization must be called on the root module, not on "
                f"{type(self).__name__}"
            )
        engine.sync_policy.manual_finalization = enabled

    def finalize_backward(  # type: ignore[override]  # torch's overloads on async_op
        self, *, async_op: bool = False
    ) -> GradientReductionHandle | None:
        """Finish the backwards' gradient work now, as FSDP2's (root only).

        With gradient sync on, every gradient still local is reduced (HSDP's replicate
        dim included), waited for and handed out as each sharded parameter's
        ``.grad``, and the units left gathered are released; with sync off the grads
        stay local for a later backward with sync on. The work is done when this
        returns, so the handle's ``wait()`` (``async_op=True``) has nothing left to do.

        Raises:
            RuntimeError: on a module other than the root, as FSDP2.
        """
        engine, record = self._engine_and_record()
        if not record.is_root:
            raise RuntimeError(
                f"finalize_backward must be called on the root module, not on {type(self).__name__}"
            )
        if not engine.sync_policy.suppressed:
            engine.finish_grad_sync()
        return FinishedReduction() if async_op else None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this call's gradients as their sum over the data-parallel ranks over ``factor``.

        As FSDP2's: the factor of this module's own unit only (on the root, the
        parameters outside every other unit); the other units keep theirs, the
        mean by default (torchtitan sets it on every module). From the next
        reduction on.

        Raises:
            TypeError / ValueError: if ``factor`` is not a finite positive number.
        """
        factor = check_gradient_factor("factor", factor)
        engine, _ = self._engine_and_record()
        options = dataclasses.replace(engine._bucket_options, divide_factor=factor)
        for unit in self._units(recurse=False):
            for group in unit.groups:
                group.reduce_spec = reduce_spec_for(group.dist_index, options)


def _check_assignable(
    module: nn.Module, state_dict: Mapping[str, Any], meta: bool
) -> frozenset[str]:
    """Refuse a ``load_state_dict(assign=True)`` that copying its values would not honour.

    An entry whose dtype differs from its tensor's; with ``meta`` (a model built on
    the meta device, loaded strictly), a tensor the state dict leaves without a value.
    Returns the names of the model's tensors ``state_dict`` leaves out.
    """
    engine = ensure_built(module)
    with engine._forms.sharded():
        own = dict(nn.Module.state_dict(module, keep_vars=True))
    missing = sorted(own.keys() - state_dict.keys())
    if meta and missing:
        raise KeyError(
            f"load_state_dict(assign=True): the model was built on the meta device and the "
            f"state dict has no {missing[0]!r} ({len(missing)} missing); expected every "
            "parameter and buffer, or call model.to_empty() and initialise the rest first"
        )
    for key, value in state_dict.items():
        mine = own.get(key)
        if isinstance(value, torch.Tensor) and mine is not None and value.dtype != mine.dtype:
            raise TypeError(
                f"load_state_dict(assign=True): {key} is {value.dtype} in the state dict but "
                f"{mine.dtype} in the model; mf_fsdp.fsdp2 copies the values into its flat "
                "buffers and cannot take the state dict's dtype: cast the state dict, or load "
                "with assign=False"
            )
    return frozenset(missing)


def _prefetched_units(owner: FSDPModule, modules: object, method: str) -> list[Unit]:
    """The engine's units of ``modules`` (FSDP modules of ``owner``'s model, not the root)."""
    engine, record = owner._engine_and_record()
    if record.is_root:
        raise NotImplementedError(
            f"{method} on the root: mf prefetches the root's window itself; set the list on "
            "the blocks"
        )
    if not isinstance(modules, list | tuple):
        raise TypeError(f"{method}: modules must be a list of FSDP modules, got {modules!r}")
    units = []
    for module in modules:
        other = module.__dict__.get(RECORD_ATTR) if isinstance(module, nn.Module) else None
        if other is None or ensure_built(module) is not engine or other.is_root:
            raise ValueError(
                f"{method}: {module!r} is not a non-root module sharded by "
                "mf_fsdp.fsdp2.fully_shard in this model"
            )
        if other.unit is not None:
            units.append(other.unit)
    return units


_HONOURED = {
    name for name, value in vars(FSDPModule).items() if callable(value) and not name.startswith("_")
}
UNSUPPORTED = sorted(
    name
    for name, value in vars(TorchFSDPModule).items()
    if callable(value) and not name.startswith("_") and name not in _HONOURED
)
"""Torch's ``FSDPModule`` methods mf cannot honour yet; each raises naming itself."""


class _Refused:
    """A method of torch's ``FSDPModule`` that mf refuses: calling it raises naming it.

    A descriptor rather than a function: the set follows the installed torch's class,
    so it is no part of mf's recorded API (``api.txt``).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(
        self, module: nn.Module | None, owner: type | None = None
    ) -> Callable[..., NoReturn]:
        name, shown = self.name, type(module).__name__ if module is not None else "FSDPModule"

        def method(*args: Any, **kwargs: Any) -> NoReturn:
            raise NotImplementedError(
                f"{shown}.{name} (FSDP2's FSDPModule.{name}) is not supported by mf_fsdp.fsdp2 yet"
            )

        method.__name__ = method.__qualname__ = name
        method.__doc__ = "Not supported by mf_fsdp.fsdp2 yet: raises ``NotImplementedError``."
        return method


for _name in UNSUPPORTED:
    setattr(FSDPModule, _name, _Refused(_name))
del _name

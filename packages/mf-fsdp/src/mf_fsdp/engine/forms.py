"""Which form of each managed parameter the modules hold, and finding a parameter by either form.

See [Note: parameter forms] in ``buckets/param.py``: between passes every module
holds its parameters' sharded forms, during forward and backward their compute
forms. ``ParamForms`` keeps every registration of a parameter with two forms
(ZeRO-0 without TP has one object for both, which never swaps) and swaps them
all at once; a swap is one store per registration, four times the parameters
every step, so it must not cost more. A plain slots class, not an
``nn.Module`` attribute: its flag changes several times a step.

Outside a pass, FSDP2's ``unshard()`` lets the unit's modules hold their
compute forms until ``reshard()`` (``show_unit``), as FSDP2 registers the
unsharded parameters then; every whole swap (a pass starting or ending, a state
dict read or loaded: FSDP2's pre-hooks register the sharded ones too) ends that.

It also maps the parameters the user may still hold back to their records: a
compute form, and an original that an extension parameter's compute form
replaced (held weakly; see ``Bucket._adopt``), which an optimizer built
before wrapping still holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.param import FSDPParam

__all__ = ["ParamForms"]


class ParamForms:
    """The registrations of every parameter with two forms, and which form they hold.

    Args:
        fsdp_params: every managed parameter, in bucket order.
        groups: the engine's buckets (for the originals extension parameters replaced).
    """

    __slots__ = ("_by_compute", "_replaced", "_shown", "_slots", "sharded_registered")

    def __init__(self, fsdp_params: list[FSDPParam], groups: list[Bucket]) -> None:
        self.sharded_registered = False
        self._shown = False  # some unit's compute forms are registered between passes
        self.rebuild(fsdp_params, groups)

    def rebuild(self, fsdp_params: list[FSDPParam], groups: list[Bucket]) -> None:
        """Index the forms again (an extension parameter's compute form was made late)."""
        self._by_compute = {id(fp.compute): fp for fp in fsdp_params}
        self._replaced = {
            id(original): (group.replaced, group.fsdp_params[0])
            for group in groups
            if group.replaced is not None and (original := group.replaced()) is not None
        }
        self._slots: list[tuple[dict[str, Any], str, nn.Parameter, nn.Parameter]] = [
            (module._parameters, attr, fp.compute, fp.sharded)
            for fp in fsdp_params
            if fp.sharded is not fp.compute
            for module, attr in fp.slots
        ]

    def register_sharded(self) -> None:
        """Let every owning module hold the sharded form (between passes)."""
        if not self.sharded_registered or self._shown:
            for parameters, attr, _, sharded in self._slots:
                parameters[attr] = sharded
            self.sharded_registered, self._shown = True, False

    def register_compute(self) -> None:
        """Let every owning module hold the compute form (forward and backward)."""
        if self.sharded_registered:
            for parameters, attr, compute, _ in self._slots:
                parameters[attr] = compute
            self.sharded_registered, self._shown = False, False

    def show_unit(self, fsdp_params: list[FSDPParam], compute: bool) -> None:
        """Between passes, let ``fsdp_params``' modules hold their compute (or sharded) forms.

        FSDP2's ``unshard()`` registers a unit's unsharded parameters until its
        ``reshard()``; during a pass the modules hold the compute forms already.
        """
        if not self.sharded_registered:
            return
        for fp in fsdp_params:
            if fp.sharded is not fp.compute:
                for module, attr in fp.slots:
                    module._parameters[attr] = fp.compute if compute else fp.sharded
        self._shown = self._shown or compute

    @contextlib.contextmanager
    def sharded(self) -> Iterator[None]:
        """Register the sharded forms for the block, then restore what was registered."""
        was_sharded = self.sharded_registered
        self.register_sharded()
        try:
            yield
        finally:
            if not was_sharded:
                self.register_compute()

    def record_of(self, param: nn.Parameter) -> FSDPParam | None:
        """The record of ``param``: a compute form, or an original a compute form replaced."""
        fp = self._by_compute.get(id(param))
        if fp is not None:
            return fp
        ref, fp = self._replaced.get(id(param), (None, None))
        return fp if ref is not None and ref() is param else None

"""The torch contract of the module the engine wraps: it answers as that module would.

``WrappedModule`` is the part of ``MegatronFSDP`` that keeps the wrapped module's
face: attribute and method access resolve on it, ``named_parameters()`` and
``named_buffers()`` are its own, ``state_dict()`` and ``load_state_dict()`` run
its own (with its hooks) while the sharded forms are registered (see [Note:
parameter forms] in ``buckets/param.py``), DSD sees its keys
(``_fqn_modifiers``), and ``to_empty()`` gives a model built on the meta device
storage (FSDP2's flow, see [Note: meta-device flows] in ``meta_init.py``).
Nothing here communicates except what the module's own loading does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Self

import torch
from torch import nn

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.extension import ExtensionWeights
from mf_fsdp.engine.forms import ParamForms
from mf_fsdp.engine.sharded_params import OWNER_ATTR

__all__ = ["WrappedModule", "check_module_to_wrap"]


class WrappedModule(nn.Module):
    """The wrapped module's contract, for ``MegatronFSDP`` (see the module docstring).

    Attributes (set by ``MegatronFSDP``):
        module: the wrapped module.
        device: where the engine's buffers live.
        groups: the engine's buckets.
    """

    module: nn.Module
    device: torch.device
    groups: list[Bucket]
    _forms: ParamForms
    _awaiting_to_empty: bool
    _install_pending: bool
    _unassigned: frozenset[str]

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Self:
        """Give the wrapped module's meta buffers storage; FSDP2's meta-device flow.

        Build the model on the meta device, wrap it, call this, then the model's
        own init method: it writes the sharded parameters in place, exactly as on
        one process with the same seed (see [Note: meta-device flows]). The
        parameters already live in the engine's buffers; buffers still on the meta
        device get empty storage on the engine's device (``recurse`` is accepted
        for torch's signature). Returns ``self``.

        Raises:
            ValueError: if ``device`` is not the engine's device type.
        """
        del recurse
        target = torch.device(device) if device is not None else self.device
        if target.type != self.device.type:
            raise ValueError(
                f"to_empty: device={str(target)!r}, but the engine's buffers are on "
                f"{str(self.device)!r}; expected that device (pass device= to fully_shard "
                "to place them elsewhere)"
            )
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=self.device)
        for group in self.groups:
            if isinstance(group.weights, ExtensionWeights):
                group.weights.materialize(self.device)
        self._awaiting_to_empty = False
        self._install_pending = True
        return self

    def __getattr__(self, name: str) -> Any:
        """Resolve what the wrapper lacks on the wrapped module, as if it were that module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name == "module":
                raise
            return getattr(inner, name)

    def _fqn_modifiers(self) -> dict[str, str]:
        """Tell torch's DSD that ``module`` is not part of the state-dict keys."""
        return {"module": "module"}

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under their own names (sharded forms between passes)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers under their own names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The wrapped module's state dict: its keys, sharded parameter-shaped DTensors.

        Parameters are the sharded forms (``UnevenDTensor``s of the parameters'
        global shapes sharing storage with the engine's main weights, so
        ``dcp.load`` into this dict writes the weights in place; or plain tensors
        under ZeRO-0 without TP); buffers and extra state as the module gives them.
        """
        if args:
            raise TypeError(
                "MegatronFSDP.state_dict: positional arguments are not supported; pass "
                "destination=, prefix= and keep_vars= by name"
            )
        with self._forms.sharded():
            return self.module.state_dict(
                destination=destination, prefix=prefix, keep_vars=keep_vars
            )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict in any layout, then install the weights; collective.

        It is the wrapped module's own ``load_state_dict``, so the model's state-dict
        hooks run (keys a hook renames, splits or fuses load as into the plain
        module; see [Note: loading through the module's hooks]). Parameter values may
        be this model's own sharded tensors (e.g. filled by ``dcp.load``), DTensors of
        any other layout or world size, or full plain tensors; each rank keeps its
        rows. ``assign`` is accepted for torch's API and has no effect (values are
        always copied into the engine's buffers).

        Returns:
            ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``.

        Raises:
            RuntimeError: with ``strict``, for missing or unexpected keys; for a value
                whose shape differs from its parameter's.
        """
        del assign  # values are always copied into the engine's buffers
        with self._forms.sharded():
            return self.module.load_state_dict(state_dict, strict=strict)


def check_module_to_wrap(module: object) -> None:
    """Raise unless ``module`` is an ``nn.Module`` that no engine manages yet.

    A module wraps once: the engine moves its parameters into its buffers and
    replaces them with sharded forms, so a second engine would shard shards.
    Caught here, before any buffer is touched: ``module`` being a
    ``MegatronFSDP``, or holding a parameter that an engine manages (the module
    that was wrapped, any of its submodules, or a module containing either).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: naming the module's class and a managed parameter's name.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {module!r}")
    managed = next((name for name, p in module.named_parameters() if hasattr(p, OWNER_ATTR)), None)
    if isinstance(module, WrappedModule):
        inner = type(module.module).__name__
        raise ValueError(
            f"module: got a {type(module).__name__} (wrapping {inner}, managing parameter "
            f"{managed!r}); "
            "expected an unwrapped module: a model is wrapped once, then trained through the "
            "MegatronFSDP that fully_shard returned"
        )
    if managed is not None:
        raise ValueError(
            f"module: {type(module).__name__} is already wrapped: its parameter {managed!r} "
            "is managed by a MegatronFSDP; expected a module no engine manages yet (wrap a "
            "model once, then train through the MegatronFSDP that fully_shard returned)"
        )

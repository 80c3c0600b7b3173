"""Model and optimizer state dicts of a ``MegatronFSDP`` in one strategy-free form.

[Note: canonical checkpoint form]
Every tensor a checkpoint holds for a parameter is *flat*: global shape
``(numel,)``, keyed by the parameter's FQN in the wrapped module (no
``module.`` prefix). How the ranks hold it depends on the strategy, what DCP
sees does not:

- ZeRO-1/2/3: a 1-D DTensor over the data-parallel mesh whose local piece is
  this rank's uneven slice of the parameter, with its chunk metadata (global
  offset) attached, so DCP writes and reads the true offsets;
- ZeRO-0: a plain tensor holding the full flat value (replicated; DCP writes
  one copy);
- a tensor-parallel partitioned parameter (mf_utils attribute protocol or a
  ``Shard`` DTensor parameter, on a tp dim of size > 1): a leading tp dim,
  global shape ``(tp, numel_local)``, so the tp ranks' different values land
  in different rows and never overwrite each other (resharding works across
  data-parallel sizes, layouts and strategies, not across tp sizes).

Persistent buffers are flat plain tensors. Optimizer state tensors shaped like
their parameter (Adam ``exp_avg``/``exp_avg_sq``, SGD ``momentum_buffer``)
take their parameter's form; anything else (Adam's scalar ``step``) is kept
as it is and must be equal on every rank. Because the form is the same for
every strategy and world size, DCP reshards on load.

This module only builds and applies state dicts (no file I/O); see
``mf_fsdp.checkpoint`` for saving and loading. It reads the engine only
through its public contract: ``optimizer_named_parameters()``, each
parameter's ``orig_shape``, its TP facts (``tp_size``, ``tp_rank``,
``tp_partition_dim``, see ``mf_fsdp.tp_params.annotate_optimizer_param``) and,
when sharded, ``local_offset``; and the index's ``dp_tp_mesh()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor import uneven_dtensor_from_local
from mf_fsdp.megatron_fsdp import MegatronFSDP

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One managed parameter as the checkpoint sees it.

    Attributes:
        fqn: the parameter's name in the wrapped module.
        opt: the optimizer's parameter (1-D uneven DTensor, or the full tensor).
        shape: the parameter's shape as the module sees it.
        tp_rank: this rank's tensor-parallel index (0 without tp partitioning).
        tp_size: number of tp partitions of the parameter (1 if not partitioned).
        tp_mesh: mesh of the canonical DTensor when ``tp_size > 1``, else None.
        partition_dim: the tp partition dim (None if not partitioned).
    """

    fqn: str
    opt: nn.Parameter
    shape: torch.Size
    tp_rank: int = 0
    tp_size: int = 1
    tp_mesh: DeviceMesh | None = None
    partition_dim: int | None = None

    @property
    def numel(self) -> int:
        """Elements of this rank's (tp-local) parameter."""
        return self.shape.numel()

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        """Global shape of the checkpointed tensor: ``(numel,)`` or ``(tp, numel)``."""
        return (self.numel,) if self.tp_size == 1 else (self.tp_size, self.numel)

    @property
    def full_shape(self) -> torch.Size:
        """The module-visible shape gathered over tp (``shape`` without tp partitioning)."""
        if self.tp_size == 1 or self.partition_dim is None:
            return self.shape
        full = list(self.shape)
        full[self.partition_dim] *= self.tp_size
        return torch.Size(full)

    @property
    def sharded(self) -> bool:
        """True when this rank holds only a slice (ZeRO-1/2/3)."""
        return isinstance(self.opt, DTensor)

    @property
    def local_numel(self) -> int:
        """Elements of the parameter this rank holds."""
        return self.opt.to_local().numel() if self.sharded else self.numel

    def to_canonical(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (shaped like ``opt``) in the canonical form; shares its storage."""
        local = value.to_local() if isinstance(value, DTensor) else value.reshape(-1)
        return self.wrap_local(local.detach())

    def empty_canonical(self, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised canonical tensor of ``dtype`` (a target for ``dcp.load``)."""
        device = self.opt.to_local().device if self.sharded else self.opt.device
        return self.wrap_local(torch.empty(self.local_numel, dtype=dtype, device=device))

    def wrap_local(self, local: torch.Tensor) -> torch.Tensor:
        """The canonical tensor whose local piece is the flat ``local`` (no copy)."""
        if not self.sharded and self.tp_size == 1:
            return local
        offset, placements = 0, []
        if self.sharded:
            offset = self.opt.local_offset  # type: ignore[attr-defined]
            placements = list(self.opt.placements)
        if self.tp_size == 1:
            return uneven_dtensor_from_local(
                local,
                self.opt.device_mesh,
                placements,
                global_shape=(self.numel,),
                global_offset=(offset,),
                validate=False,
            )
        assert self.tp_mesh is not None  # internal invariant: set with tp_size > 1
        # Rows are tp ranks (Shard(0) on the tp dim); the data-parallel dims shard columns.
        dp_placements: list[Placement] = [
            Shard(1) if isinstance(p, Shard) else Replicate() for p in placements
        ] or [Replicate()] * (self.tp_mesh.ndim - 1)
        return uneven_dtensor_from_local(
            local.view(1, local.numel()),  # (1, -1) is ambiguous for an empty piece
            self.tp_mesh,
            [*dp_placements, Shard(0)],
            global_shape=self.canonical_shape,
            global_offset=(self.tp_rank, offset),
            validate=False,
        )

    def local_slice(self, value: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's flat piece of ``value`` (canonical DTensor, or any full form).

        Raises:
            ValueError: if ``value`` does not have this parameter's size or layout.
        """
        local_numel = self.local_numel
        if isinstance(value, DTensor):
            local = value.to_local().reshape(-1)
            if local.numel() != local_numel:
                raise ValueError(
                    f"state_dict[{name!r}]: local piece of {local.numel()} elements does not match "
                    f"this rank's {local_numel}; expected the layout of get_*_state_dict()"
                )
            return local
        if value.numel() not in (self.numel, self.full_shape.numel()):
            raise ValueError(
                f"state_dict[{name!r}]: {value.numel()} elements (shape {tuple(value.shape)}) do "
                f"not match the parameter's {self.numel} (shape {tuple(self.shape)})"
            )
        if value.numel() != self.numel:  # the tp-gathered full tensor: take this tp rank's slice
            value = value.reshape(self.full_shape).chunk(self.tp_size, self.partition_dim)
            value = value[self.tp_rank]
        flat = value.reshape(-1)
        if not self.sharded:
            return flat
        start = self.opt.local_offset  # type: ignore[attr-defined]
        return flat[start : start + local_numel]

    def materialize(self, local: torch.Tensor) -> torch.Tensor:
        """An optimizer-state tensor shaped like ``opt`` holding the flat piece ``local``."""
        if not self.sharded:
            return local.reshape(self.opt.shape).clone()
        opt = self.opt
        return uneven_dtensor_from_local(
            local.reshape(-1).clone(),
            opt.device_mesh,
            list(opt.placements),
            global_shape=tuple(opt.shape),
            global_offset=(opt.local_offset,),  # type: ignore[attr-defined]
            validate=False,
        )

    def is_param_like(self, value: Any) -> bool:
        """True for an optimizer-state value shaped like the parameter (sharded with it)."""
        if not isinstance(value, torch.Tensor) or value.shape != self.opt.shape:
            return False
        return isinstance(value, DTensor) or not self.sharded


def state_entries(model: MegatronFSDP) -> list[StateEntry]:
    """The checkpoint view of every managed parameter, in the engine's order.

    Raises:
        TypeError: if ``model`` is not a ``MegatronFSDP``.
        ValueError: for a tp-partitioned parameter whose tp slices differ in size (a
            ``Shard`` DTensor of an indivisible dim): the checkpoint form needs equal rows.
    """
    if not isinstance(model, MegatronFSDP):
        raise TypeError(f"model: expected a MegatronFSDP, got {type(model).__name__}")
    entries = []
    tp_mesh = None
    for fqn, opt in model.optimizer_named_parameters():
        shape = torch.Size(getattr(opt, "orig_shape", opt.shape))
        # TP facts from the engine (mf-tp attribute protocol and DTensor params alike).
        tp_size, dim = getattr(opt, "tp_size", 1), getattr(opt, "tp_partition_dim", -1)
        if tp_size == 1 or dim < 0:  # not tp-partitioned: equal on every tp rank
            entries.append(StateEntry(fqn, opt, shape))
            continue
        global_shape = tuple(getattr(opt, "tp_global_shape", ()))
        if global_shape and global_shape[dim] % tp_size:
            raise ValueError(
                f"model: parameter {fqn!r} (global shape {global_shape!r}) is split unevenly "
                f"over {tp_size} tp ranks along dim {dim}; checkpoints expect a dim divisible "
                "by the tp size"
            )
        tp_mesh = tp_mesh or model.dist_index.dp_tp_mesh()
        entries.append(
            StateEntry(
                fqn,
                opt,
                shape,
                tp_rank=opt.tp_rank,  # type: ignore[attr-defined]
                tp_size=tp_size,
                tp_mesh=tp_mesh,
                partition_dim=dim,
            )
        )
    return entries


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, buffer)`` for every buffer ``module.state_dict()`` would save."""
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def get_model_state_dict(model: MegatronFSDP) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers in the canonical checkpoint form.

    See [Note: canonical checkpoint form]. The tensors share storage with the
    engine's main weights, so ``dcp.load`` into this dict writes the weights in
    place (then call :func:`set_model_state_dict` to install them). No
    communication.

    Args:
        model: the wrapped model.

    Returns:
        ``{fqn: tensor}``: flat parameters (DTensors when sharded) and buffers.
    """
    out: dict[str, torch.Tensor] = {e.fqn: e.to_canonical(e.opt) for e in state_entries(model)}
    for fqn, buf in persistent_buffers(model.module):
        out[fqn] = buf.detach().reshape(-1)
    return out


def set_model_state_dict(model: MegatronFSDP, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load parameters and buffers, then install them into the model's compute weights.

    Accepts the canonical form (as :func:`get_model_state_dict` returns it,
    possibly filled by ``dcp.load``) or full tensors of any shape with the
    right number of elements (e.g. a plain ``module.state_dict()``).

    Raises:
        ValueError: for missing or unexpected keys, or a size mismatch.
    """
    entries = state_entries(model)
    buffers = dict(persistent_buffers(model.module))
    expected = [e.fqn for e in entries] + list(buffers)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if missing or unexpected:
        raise ValueError(
            f"state_dict: missing keys {missing!r}, unexpected keys {unexpected!r}; expected "
            "the keys of get_model_state_dict(model)"
        )
    with torch.no_grad():
        for entry in entries:
            target = entry.opt.to_local() if entry.sharded else entry.opt.data
            target.view(-1).copy_(entry.local_slice(state_dict[entry.fqn], entry.fqn))
        for fqn, buf in buffers.items():
            value = state_dict[fqn]
            if value.numel() != buf.numel():
                raise ValueError(
                    f"state_dict[{fqn!r}]: {value.numel()} elements do not match the buffer's "
                    f"{buf.numel()} (shape {tuple(buf.shape)})"
                )
            buf.copy_(value.reshape(buf.shape))
    model.install_optimized_model_weights()


def _entries_by_param(model: MegatronFSDP) -> dict[int, StateEntry]:
    return {id(e.opt): e for e in state_entries(model)}


def check_optimizer_binding(model: MegatronFSDP, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` was bound to ``model`` by ``fully_shard_optimizer``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {optimizer!r}")
    if getattr(optimizer, "_mf_fsdp_model", None) is not model:
        raise ValueError(
            "optimizer: it is not bound to this model; pass it through "
            "mf_fsdp.fully_shard_optimizer(optimizer, model) (or fully_shard) first"
        )


def group_fqns(model: MegatronFSDP, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each of ``optimizer``'s param groups."""
    by_param = _entries_by_param(model)
    return [[by_param[id(p)].fqn for p in group["params"]] for group in optimizer.param_groups]


def get_optimizer_state_dict(
    model: MegatronFSDP, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, in the canonical checkpoint form.

    Returns:
        ``{"state": {fqn: {key: value}}, "param_groups": [{option: value, "params":
        [fqn, ...]}, ...]}``; state tensors shaped like their parameter take the
        parameter's form (see [Note: canonical checkpoint form]) and share storage
        with the optimizer's state.

    Raises:
        TypeError / ValueError: if ``optimizer`` is not a torch optimizer bound to
            ``model`` by ``fully_shard_optimizer``.
    """
    check_optimizer_binding(model, optimizer)
    by_param = _entries_by_param(model)
    state: dict[str, dict[str, Any]] = {}
    for param, values in optimizer.state.items():
        entry = by_param[id(param)]
        state[entry.fqn] = {
            key: entry.to_canonical(value) if entry.is_param_like(value) else value
            for key, value in values.items()
        }
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
        for group, fqns in zip(optimizer.param_groups, group_fqns(model, optimizer), strict=True)
    ]
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(
    model: MegatronFSDP, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Replace the optimizer's state and options with those of ``state_dict``.

    Works on a fresh optimizer whose state is still empty: state tensors are
    created here from the values given, never by a synthetic step. Values
    shaped like their parameter may be canonical (possibly from another world
    size, via ``dcp.load``) or full tensors; the rest are copied as they are.

    Raises:
        ValueError: if the param groups or their parameters differ, or a state
            entry names an unknown parameter or has the wrong size.
    """
    check_optimizer_binding(model, optimizer)
    entries = {e.fqn: e for e in state_entries(model)}
    saved_groups = state_dict["param_groups"]
    current = group_fqns(model, optimizer)
    saved = [list(g["params"]) for g in saved_groups]
    if saved != current:
        raise ValueError(
            f"state_dict['param_groups']: parameters per group {saved!r} do not match the "
            f"optimizer's {current!r}; expected the same groups in the same order"
        )
    unknown = [fqn for fqn in state_dict["state"] if fqn not in entries]
    if unknown:
        raise ValueError(
            f"state_dict['state']: unknown parameters {unknown!r}; expected FQNs of the model"
        )
    optimizer.state.clear()
    for fqn, values in state_dict["state"].items():
        entry = entries[fqn]
        new: dict[str, Any] = {}
        for key, value in values.items():
            name = f"state[{fqn!r}][{key!r}]"
            if isinstance(value, DTensor) or _is_flat_param_value(entry, value):
                new[key] = entry.materialize(entry.local_slice(value, name))
            elif isinstance(value, torch.Tensor):
                new[key] = value.detach().clone()
            else:
                new[key] = value
        optimizer.state[entry.opt] = new
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _is_flat_param_value(entry: StateEntry, value: Any) -> bool:
    """A plain tensor holding a whole parameter (flat, module-shaped or tp-gathered)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    full = entry.full_shape
    return tuple(value.shape) in ((entry.numel,), entry.shape, (full.numel(),), full)

"""Stepping torch's elementwise optimizers on the local pieces of the sharded parameters.

[Note: local step]
An elementwise optimizer (SGD, Adam, AdamW, ...) updates every element from
that element's parameter, gradient and state alone, so stepping each rank's
local piece is exactly stepping the sharded parameter. Run on the sharded
``UnevenDTensor`` parameters themselves, each of the step's foreach ops goes
through Python subclass dispatch (measured: 0.6 ms of a 6 ms step on the tiny
preset, most of the host cost over plain PyTorch); run on plain tensors, the
ops are torch's own multi-tensor (or fused) kernels, as in plain PyTorch.

So for the duration of ``step()`` (after the engine's pre-step hook finished
the gradient reductions, before the post-step hook installs the weights) the
optimizer's param groups hold plain tensors and its ``state`` their state.
Updates land in the sharded tensors' storage; afterwards the param groups and
state are the sharded ones again (anything the step created anew is wrapped
like its parameter). Outside ``step()`` nothing changes: DSD, checkpoints and
users see parameter-shaped DTensors.

[Note: flat runs]
A bucket keeps this rank's pieces of its parameters end to end, in the main
weights and in the reduced gradients alike. Consecutive pieces of one param
group whose state tensors lie end to end as well form a *run*, and the
optimizer steps one flat tensor per run instead of one per parameter, as
Megatron's distributed optimizer steps flat buffers: torch's per-parameter
Python (``_init_group``, the step counters) and the per-tensor cost of its
kernels shrink from a parameter count to a bucket count. The run's state
holds flat views of its members' state tensors and the first member's step
counter; after the step the others' counters get its value (they are 0-d
views of one buffer: one copy per run). State that is not laid out that way
(created one parameter at a time, or loaded) is moved once into one buffer
per run and key, whose views the parameters' state entries then wrap; state
the step creates for a run is split into such views.
Elementwise math does not care where an element sits, so the result is the
per-parameter step's.

What a step swaps in (a *plan*: the runs, their flat tensors and state) is
kept from step to step, one per set of parameters stepped (the whole
optimizer, or one bucket inside the backward), and rebuilt only when a
parameter's gradient object, any entry of the state or the state dict itself
are other objects than last time: building it is most of the swap's cost.

Only optimizers bound by ``fully_shard_optimizer`` take this path (their
``step`` restores the swap even when it raises); others, and every optimizer
not in ``ELEMENTWISE``, step on the DTensors. A parameter that implements
FSDP2's all-gather extension is stepped alone, on the plain tensor inside its
subclass shard that holds its values (``_values``); when a shard has no such
tensor (two of them, or packed data), the whole step runs on the DTensors.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from mf_dtensor import UnevenDTensor
from mf_fsdp.buckets.extension import plain_tensors

__all__ = ["ELEMENTWISE", "enter_local_step", "exit_local_step", "forget_local_plans"]

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""torch's optimizers whose update of an element reads that element alone."""

CPU_RUN_MAX_NUMEL = 1 << 20
"""The most elements a run holds on the CPU. The multi-tensor step's temporaries are
as large as its tensors, and glibc hands temporaries of many megabytes back to
the system when freed, so each step would fault their pages in again: on the
CPU a run stops at 4 MiB of fp32, about a large parameter's size. Groups on
fused kernels, which make no temporaries, and accelerators, whose caching
allocators keep freed blocks, take whole buckets."""

_SWAP_ATTR = "_mf_fsdp_local_step"
_GRAD = operator.attrgetter("grad")
_PLANS_ATTR = "_mf_fsdp_local_plans"

State = dict[str, Any]


class _Member:
    """One sharded parameter of a run: where its piece starts in the run's flat tensors."""

    __slots__ = ("local", "offset", "param")

    def __init__(self, param: DTensor, local: torch.Tensor, offset: int) -> None:
        self.param = param
        self.local = local
        self.offset = offset


class _Run:
    """What the optimizer steps for consecutive pieces of one param group (see [Note: flat runs]).

    ``flat`` is the tensor stepped (a lone member's own local tensor), ``given``
    its state, and ``snapshot`` what ``given`` held when built, so that the
    step's new entries can be told apart.
    """

    __slots__ = ("flat", "given", "members", "snapshot")

    def __init__(self, members: list[_Member], flat: torch.Tensor, given: State) -> None:
        self.members = members
        self.flat = flat
        self.given = given
        self.snapshot = dict(given)

    def parts(self, value: Any) -> Iterator[tuple[_Member, Any]]:
        """Each member's share of a state value the step created for ``flat``."""
        lone = len(self.members) == 1
        for i, member in enumerate(self.members):
            if lone:
                yield member, value
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                piece = value.view(-1).narrow(0, member.offset, member.local.numel())
                yield member, piece.view(member.local.shape)
            elif isinstance(value, torch.Tensor):  # a counter: each member its own
                yield member, value if i == 0 else value.clone()
            else:
                yield member, value


class _Plan:
    """One step's swap for a set of param lists, and what it was built from."""

    __slots__ = (
        "counter_copies",
        "dicts",
        "grads",
        "keys",
        "local_state",
        "moved",
        "params",
        "plain",
        "runs",
        "state",
        "stepped",
        "values",
    )

    def __init__(
        self, groups: list[list[Any]], fused: list[bool], state: defaultdict[Any, State]
    ) -> None:
        self.state = state
        self.params = [p for params in groups for p in params]
        self.grads = [p.grad for p in self.params]
        self.runs: list[_Run] = []
        self.plain: list[Any] = []
        self.moved = False  # state tensors were moved into run buffers (see _lay_out_state)
        self.stepped = [self._swap_in(*args) for args in zip(groups, fused, strict=True)]
        # What valid() compares: the whole state as it is once the swap is built (it
        # may have moved state into run buffers), walked in C, with no parameter hashed.
        self.keys = list(state.keys())
        self.dicts = list(state.values())
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.local_state: defaultdict[Any, State] = defaultdict(dict)
        for p in self.plain:
            if p in state:
                self.local_state[p] = state[p]
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for run in self.runs:
            self.local_state[run.flat] = run.given
            for key, value in run.given.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0 and len(run.members) > 1:
                    others = [state[member.param][key] for member in run.members[1:]]
                    if _consecutive([value, *others]):  # one copy for the run (see _lay_out_state)
                        span = _span(others[0], len(others))
                        targets.append(span)
                        sources.append(value.expand(span.shape))
                    else:
                        targets += others
                        sources += [value] * len(others)
        self.counter_copies = (targets, sources)

    def valid(self, state: Any) -> bool:
        """Whether nothing the plan was built from was replaced since.

        That is: the parameters' gradient objects, and the whole state (its dict,
        each parameter's entry dict and every value in it, by identity and in
        order). A change anywhere in the state, even for a parameter outside the
        plan, rebuilds it: rare (a user resetting a moment, a load), and checking
        it all takes a few C loops where checking the plan's own entries would
        hash every parameter in Python (a step's host cost grows with them).
        """
        return (
            state is self.state
            and all(map(operator.is_, map(_GRAD, self.params), self.grads))
            and len(state) == len(self.keys)
            and all(map(operator.is_, state.keys(), self.keys))
            and all(map(operator.is_, state.values(), self.dicts))
            and sum(map(len, self.dicts)) == len(self.values)
            and all(
                map(
                    operator.is_,
                    itertools.chain.from_iterable(map(dict.values, self.dicts)),
                    self.values,
                )
            )
        )

    def _swap_in(self, params: list[Any], fused: bool) -> list[Any]:
        """The tensors stepped for one param group: runs' flat tensors and plain parameters.

        A run starts with a piece that has elements; a piece with none (the
        parameter's rows are all on other ranks) rides along with the run it
        follows, so that its counters advance with the others.
        """
        stepped: list[Any] = []
        pending: list[UnevenDTensor] = []
        anchor: UnevenDTensor | None = None  # pending's last piece with elements
        numel = 0  # pending's elements
        for p in params:
            if type(p) is not UnevenDTensor and isinstance(p, DTensor):  # an extension's shard
                if pending:
                    stepped.append(self._run_of(pending))
                    pending, anchor, numel = [], None, 0
                stepped.append(self._run_of([p]))
                continue
            plain = type(p) is not UnevenDTensor
            size = 0 if plain else p.to_local().numel()
            if pending and (
                plain
                or anchor is None
                or (not fused and p.device.type == "cpu" and numel + size > CPU_RUN_MAX_NUMEL)
                or not _joins(anchor, p, self.state)
            ):
                stepped.append(self._run_of(pending))
                pending, anchor, numel = [], None, 0
            if plain:
                stepped.append(p)
                self.plain.append(p)
            elif size or pending:
                pending.append(p)
                anchor = p if size else anchor
                numel += size
            else:
                stepped.append(self._run_of([p]))
        if pending:
            stepped.append(self._run_of(pending))
        return stepped

    def _run_of(self, params: Sequence[DTensor]) -> torch.Tensor:
        """The flat tensor stepped for ``params`` (the first has elements; each joins the run)."""
        if len(params) > 1 and _lay_out_state(params, self.state):
            self.moved = True
        members, numel = [], 0
        for p in params:
            local = _values(p)
            members.append(_Member(p, local, numel))
            numel += local.numel()
        first = members[0].local
        values = self.state.get(params[0]) or {}
        grad = _local_grad(params[0])
        if len(params) == 1:
            flat = first
            given = {k: _values(v) if isinstance(v, DTensor) else v for k, v in values.items()}
        else:
            flat, grad = _span(first, numel), _span(cast(torch.Tensor, grad), numel)
            given = {
                k: _span(v.to_local(), numel) if type(v) is UnevenDTensor else v
                for k, v in values.items()
            }
        if flat.grad is not grad:  # setting .grad checks it: only on change
            flat.grad = grad
        self.runs.append(_Run(members, flat, given))
        return flat


def _local_grad(param: DTensor) -> torch.Tensor | None:
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else None


class _NoPlainValuesError(Exception):
    """A sharded parameter's local tensor holds its values in no one plain tensor."""


def _values(tensor: DTensor) -> torch.Tensor:
    """The plain tensor holding the values of ``tensor``'s local piece.

    An ``UnevenDTensor``'s local tensor is plain. An extension parameter's is the
    subclass shard (see ``mf_fsdp.buckets.extension``): stepped through its one
    inner tensor of the piece's shape and dtype (torchao's float8 weight keeps its
    values there, and an in-place op on it changes that tensor alone). Any other
    subclass (two such inner tensors, packed data) raises ``_NoPlainValuesError``:
    the optimizer then steps the DTensors themselves.
    """
    local = tensor.to_local()
    if type(local) is torch.Tensor:
        return local
    inner = [t for t in plain_tensors(local) if t.shape == local.shape and t.dtype == local.dtype]
    if len(inner) != 1 or type(inner[0]) is not torch.Tensor:
        raise _NoPlainValuesError(type(local).__qualname__)
    return inner[0]


def _span(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat view of ``numel`` elements of ``first``'s storage, starting where it starts."""
    return first.as_strided((numel,), (1,), first.storage_offset())


def _follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` starts in memory where ``before`` ends (one storage and dtype)."""
    return (
        after.dtype == before.dtype
        and before.is_contiguous()
        and after.is_contiguous()
        and after.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
        # int: torch's stubs type storage_offset as int | SymInt (eager tensors give ints)
        and int(after.storage_offset()) == int(before.storage_offset()) + before.numel()
    )


def _joins(anchor: UnevenDTensor, param: UnevenDTensor, state: Any) -> bool:
    """Whether ``param`` can extend the run whose last piece with elements is ``anchor``.

    Its piece (if it has elements) and gradient must start where ``anchor``'s end,
    and its state must be shaped like the run's: the same keys, pieces or equal
    counters (see [Note: flat runs]).
    """
    grad, anchor_grad = _local_grad(param), _local_grad(anchor)
    local, anchor_local = param.to_local(), anchor.to_local()
    if grad is None or anchor_grad is None:
        return False
    if local.numel() and not (_follows(anchor_local, local) and _follows(anchor_grad, grad)):
        return False
    mine, theirs = state.get(param) or {}, state.get(anchor) or {}
    if mine.keys() != theirs.keys():
        return False
    if not (_flat_state(mine, local) and _flat_state(theirs, anchor_local)):
        return False
    return all(
        value.dtype == theirs[key].dtype
        and (type(value) is UnevenDTensor or torch.equal(value, theirs[key]))
        for key, value in mine.items()
    )


def _flat_state(values: State, local: torch.Tensor) -> bool:
    """Whether every state value is shaped like the piece ``local`` or is a counter (0-d)."""
    return all(
        (type(value) is UnevenDTensor and value.to_local().shape == local.shape)
        or (isinstance(value, torch.Tensor) and value.dim() == 0)
        for value in values.values()
    )


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    """Whether each of ``tensors`` starts in memory where the one before it ends."""
    return all(_follows(a, b) for a, b in itertools.pairwise(tensors))


def _lay_out_state(params: Sequence[DTensor], state: Any) -> bool:
    """Put the run's state tensors end to end, one buffer per key; whether any moved.

    Tensors already laid out so are kept; others are copied into a new buffer
    whose views the parameters' state entries wrap from then on. The members'
    counters (equal, see ``_joins``) become 0-d views of one buffer too, so that
    handing the run's counter to the others after a step is one copy, not one
    per parameter.
    """
    moved = False
    for key, value in (state.get(params[0]) or {}).items():
        counter = type(value) is not UnevenDTensor
        if counter and not (isinstance(value, torch.Tensor) and value.dim() == 0):
            continue
        pieces = [state[p][key] if counter else state[p][key].to_local() for p in params]
        if _consecutive(pieces):
            continue
        moved = True
        if counter:  # the stacked counters' 0-d views
            buffer = torch.stack(pieces)
            for index, p in enumerate(params):
                state[p][key] = buffer[index]
            continue
        buffer = pieces[0].new_empty(sum(piece.numel() for piece in pieces))
        offset = 0
        for p, piece in zip(params, pieces, strict=True):
            view = buffer.narrow(0, offset, piece.numel()).view(piece.shape)
            view.copy_(piece)
            state[p][key] = _like_param(view, p, view)
            offset += piece.numel()
    return moved


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in ELEMENTWISE and not any(
        group.get("differentiable", False) for group in optimizer.param_groups
    )


class _Swap:
    """What one step replaced: the param lists, and the plan swapped in (it holds the state)."""

    __slots__ = ("key", "params", "plan")

    def __init__(self, params: list[list[Any]], plan: _Plan, key: Any) -> None:
        self.params = params
        self.plan = plan
        self.key = key


@torch.no_grad()
def enter_local_step(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` plain tensors to step (see the module notes); idempotent."""
    if getattr(optimizer, _SWAP_ATTR, None) is not None or not _eligible(optimizer):
        return
    groups = [group["params"] for group in optimizer.param_groups]
    state = optimizer.state
    fused = [bool(group.get("fused")) for group in optimizer.param_groups]
    key = (tuple(fused), tuple(tuple(map(id, params)) for params in groups))
    plans: dict[Any, _Plan] = optimizer.__dict__.setdefault(_PLANS_ATTR, {})
    plan = plans.get(key)
    if plan is None or not plan.valid(state):  # a kept plan was built with some grads
        if all(p.grad is None for params in groups for p in params):
            return  # nothing to step (``step()`` after a backward that stepped every bucket)
        try:
            plan = _Plan(groups, fused, state)
        except _NoPlainValuesError:
            return  # a subclass shard the step must see whole: it steps the DTensors
        if plan.moved or any(kept.state is not state for kept in plans.values()):
            plans.clear()  # the others hold state tensors that are no longer the state
        plans[key] = plan
    for group, stepped in zip(optimizer.param_groups, plan.stepped, strict=True):
        group["params"] = stepped
    optimizer.state = plan.local_state
    setattr(optimizer, _SWAP_ATTR, _Swap(groups, plan, key))


@torch.no_grad()
def exit_local_step(optimizer: torch.optim.Optimizer) -> None:
    """Put the sharded parameters and their state back; nothing if no step is swapped."""
    swap: _Swap | None = getattr(optimizer, _SWAP_ATTR, None)
    if swap is None:
        return
    setattr(optimizer, _SWAP_ATTR, None)
    plan, state = swap.plan, swap.plan.state
    local_state = optimizer.state
    for group, params in zip(optimizer.param_groups, swap.params, strict=True):
        group["params"] = params
    optimizer.state = state
    targets, sources = plan.counter_copies
    if targets:
        torch._foreach_copy_(targets, sources)
    changed = False
    for param in plan.plain:  # state the step created for a plain parameter is its own
        stepped = local_state.get(param)
        if stepped is not None and state.get(param) is not stepped:
            state[param] = stepped
            changed = True
    for run in plan.runs:
        stepped = local_state.get(run.flat)
        if stepped is None:
            continue
        for key, value in stepped.items():
            if run.snapshot.get(key) is value:
                continue  # the entry it was given (a view, updated in place)
            changed = True
            for member, part in run.parts(value):
                kept = state.setdefault(member.param, {})
                kept[key] = _like_param(part, member.param, member.local)
    if changed:  # the next step gets a plan of the new state
        getattr(optimizer, _PLANS_ATTR, {}).pop(swap.key, None)


def forget_local_plans(optimizer: torch.optim.Optimizer, *unused: Any) -> None:
    """Drop the kept plans (a ``load_state_dict`` post-hook: they hold the replaced state)."""
    getattr(optimizer, _PLANS_ATTR, {}).clear()


def _like_param(value: Any, param: DTensor, local: torch.Tensor) -> Any:
    """A state value the step created: wrapped like ``param`` when shaped like its piece."""
    if not (isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0):
        return value
    if isinstance(param, UnevenDTensor):
        return UnevenDTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, pieces=param.pieces
        )
    return DTensor.from_local(  # an extension parameter's torch.chunk pieces
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )

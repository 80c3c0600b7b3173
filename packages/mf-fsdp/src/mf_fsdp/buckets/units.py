"""Finding FSDP units and splitting a model's parameters into buckets.

A unit is a module whose class is listed in ``fsdp_unit_modules`` and that
does not sit inside another unit (the outermost match wins), or one of the
``unit_modules`` given as instances: a module, or a group of modules gathered
and released together (FSDP2's ``fully_shard([norm, output])``). A parameter
belongs to the unit that contains it; a parameter reachable from several
units (a tied weight) or from none goes to the root (with units given as
instances, also one a module outside every unit holds). Units given as single
instances may nest: each module's own parameters go to the innermost unit around
it ([Note: nested units]). Each unit's parameters
are split by (dtype, requires_grad, expert or not) into buckets, keeping
model order (expert parameters, marked with mf_utils'
``set_expert_parallel_attribute``, live on another process group); at a
given world size ``lay_out`` may split a bucket further by row size (see
``mf_fsdp.buckets.layout.partition_bucket``) and gives each stacked weight a
bucket of its own (see [Note: stacked weights are spread]). A parameter that implements
FSDP2's all-gather extension is a bucket of its own, cut as FSDP2 cuts it
(``chunk_layout``, see ``buckets/extension.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mf_fsdp.buckets.extension import gathered_by_extension
from mf_fsdp.buckets.layout import (
    DEFAULT_ALIGNMENT,
    BucketLayout,
    chunk_layout,
    compute_bucket_layout,
    partition_bucket,
)
from mf_fsdp.buckets.tp_params import local_shape
from mf_utils import get_mcore_tensor_parallel_partition_dim, is_expert_parallel_parameter

__all__ = [
    "BucketSpec",
    "cut_dim",
    "is_stacked",
    "lay_out",
    "plan_bucket_layouts",
    "plan_buckets",
    "resolve_unit_classes",
    "row_shape",
]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """The parameters of one bucket.

    Attributes:
        unit: the unit module, or None for the root bucket(s).
        unit_name: the unit's qualified name ("" for the root).
        params: parameters in bucket order.
        names: their qualified names (the first name of a tied parameter).
        expert: the parameters are expert parameters (sharded and reduced over the
            expert-data-parallel group).
        members: every module of the unit when it is a group of modules (``unit`` is
            the first of them); empty for a unit of one module and for the root.
        extension: the one parameter implements FSDP2's all-gather extension (laid out
            by ``chunk_layout``, gathered through its hooks).
        row_dims: per parameter, the dim its shards cut (``cut_dim``); empty: all 0.
    """

    unit: nn.Module | None
    unit_name: str
    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]
    expert: bool = False
    members: tuple[nn.Module, ...] = ()
    extension: bool = False
    row_dims: tuple[int, ...] = ()


def resolve_unit_classes(spec: Sequence[type | str] | None) -> tuple[type[nn.Module], ...]:
    """Turn classes or dotted class paths into classes.

    ``spec`` is a sequence of them, or a single class or path.

    Raises:
        TypeError: for a ``spec`` that is not one of those, or an entry that is
            neither an ``nn.Module`` subclass nor a string.
        ValueError: for a path that cannot be imported.
    """
    if spec is None:
        return ()
    if isinstance(spec, (str, type)):
        spec = [spec]
    elif not isinstance(spec, Iterable):
        raise TypeError(
            f"fsdp_unit_modules: expected a list of nn.Module subclasses or dotted class "
            f"paths (or one of them), got {spec!r}"
        )
    classes: list[type[nn.Module]] = []
    for item in spec:
        if isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        elif isinstance(item, str):
            classes.append(_import_class(item))
        else:
            raise TypeError(
                f"fsdp_unit_modules: expected nn.Module subclasses or dotted class paths, "
                f"got {item!r}"
            )
    return tuple(classes)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"fsdp_unit_modules: cannot import {path!r} ({exc}); expected a dotted path "
            "such as 'package.module.ClassName'"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"fsdp_unit_modules: {path!r} is not an nn.Module subclass; expected a dotted "
            "path such as 'package.module.ClassName'"
        )
    return cls


def plan_buckets(
    module: nn.Module,
    unit_classes: tuple[type[nn.Module], ...],
    disable_bucketing: bool,
    unit_modules: Sequence[Sequence[nn.Module]] = (),
    ignored: Collection[int] = frozenset(),
) -> list[BucketSpec]:
    """Split ``module``'s parameters into buckets: the root bucket(s) first, then units.

    ``unit_modules`` names units by instance (each a group of one or more modules of
    ``module``), in addition to the instances of ``unit_classes``; single modules among
    them may nest (see [Note: nested units]), outer units first. Parameters whose
    ``id`` is in ``ignored`` go in no bucket.

    Raises:
        ValueError: if the module has no parameters, a unit class matches no submodule,
            or a unit module is not inside ``module``, is ``module`` itself, or sits
            inside a unit of ``unit_classes``; a group of modules nested with another unit.
    """
    names: dict[nn.Parameter, str] = {}
    for name, param in module.named_parameters():
        if id(param) not in ignored:
            names.setdefault(param, name)
    if not names:
        raise ValueError(
            f"module: {type(module).__name__} has no parameters; expected a module with at "
            "least one parameter to shard"
        )
    units: list[tuple[str, tuple[nn.Module, ...]]] = []
    covered: set[int] = set()  # inside a unit of ``unit_classes``
    in_instance: set[int] = set()  # inside a unit of ``unit_modules``
    seen: set[type] = set()
    groups = _instance_units(module, unit_modules)
    for qual, sub in module.named_modules():
        group = groups.get(id(sub))
        if group is not None:
            if id(sub) in covered:
                raise ValueError(
                    f"unit_modules: {qual!r} ({type(sub).__name__}) sits inside a unit of "
                    "fsdp_unit_modules; expected unit_modules outside those units (units nest "
                    "only among unit_modules)"
                )
            if sub is group[0]:
                units.append((qual, group))
            in_instance.update(id(m) for m in sub.modules())
            continue
        if not isinstance(sub, unit_classes):
            continue
        seen.update(c for c in unit_classes if isinstance(sub, c))
        if id(sub) not in covered and id(sub) not in in_instance:
            units.append((qual, (sub,)))
            covered.update(id(m) for m in sub.modules())
    missing = [c.__qualname__ for c in unit_classes if c not in seen]
    if missing:
        raise ValueError(
            f"fsdp_unit_modules: {missing!r} match no submodule of {type(module).__name__}; "
            "expected classes of modules inside the model"
        )
    if disable_bucketing:
        units = []
    owner = _owners(module, units, names, count_root=bool(groups))
    specs = _split(None, "", [p for p in names if owner[p] < 0], names)
    for index, (qual, members) in enumerate(units):
        own = [p for p in _unit_params(members) if p in owner and owner[p] == index]
        specs.extend(_split(members[0], qual, own, names, members if len(members) > 1 else ()))
    return specs


def _owners(
    module: nn.Module,
    units: list[tuple[str, tuple[nn.Module, ...]]],
    names: dict[nn.Parameter, str],
    count_root: bool,
) -> dict[nn.Parameter, int]:
    """Each parameter of ``names`` -> the index of its unit in ``units``, or -1 (the root).

    [Note: nested units] A module's own parameters are held by the innermost unit
    around it (FSDP2: a ``fully_shard`` call manages what no call inside it does).
    A parameter held by units nested in one another (one chain) belongs to the
    outermost of them, which is gathered whenever the inner ones run; one held by
    units side by side belongs to the root, and so does one the root's own modules
    hold when ``count_root`` (units given as instances, FSDP2's rule).

    Raises:
        ValueError: for a group of modules nested in a unit or holding one.
    """
    unit_of = {id(m): i for i, (_, members) in enumerate(units) for m in members}
    parent: dict[int, int] = {}
    holders: dict[nn.Parameter, set[int]] = {}

    def walk(sub: nn.Module, around: int) -> None:
        here = unit_of.get(id(sub), around)
        if here != around and here not in parent:
            parent[here] = around
        for param in sub._parameters.values():
            if param is not None and param in names:
                holders.setdefault(param, set()).add(here)
        for child in sub._modules.values():
            if child is not None:
                walk(child, here)

    walk(module, -1)
    for index, outer in parent.items():
        if outer >= 0 and (len(units[index][1]) > 1 or len(units[outer][1]) > 1):
            grouped = units[index if len(units[index][1]) > 1 else outer][0]
            raise ValueError(
                f"unit_modules: {grouped!r} is a group of modules nested with another unit "
                f"({units[index][0]!r} inside {units[outer][0]!r}); expected a group of modules "
                "outside every other unit and holding none"
            )

    def chain(index: int) -> list[int]:
        found = [index]
        while found[-1] >= 0:
            found.append(parent.get(found[-1], -1))
        return found

    owner: dict[nn.Parameter, int] = {}
    for param, held in holders.items():
        if not count_root and len(held) > 1:
            held = held - {-1}
        inner = max(held, key=lambda i: len(chain(i)))
        nested = held <= set(chain(inner))
        owner[param] = min(held, key=lambda i: len(chain(i))) if nested else -1
    return owner


def _unit_params(members: tuple[nn.Module, ...]) -> list[nn.Parameter]:
    """The parameters of a unit's modules, each once, in module order."""
    return list(dict.fromkeys(p for m in members for p in m.parameters()))


def _instance_units(
    module: nn.Module, unit_modules: Sequence[Sequence[nn.Module]]
) -> dict[int, tuple[nn.Module, ...]]:
    """Each unit module of ``unit_modules`` (by ``id``) -> its group, checked against ``module``.

    Raises:
        TypeError: for an entry that is not a group of ``nn.Module``s.
        ValueError: for a module outside ``module``, ``module`` itself, or one in two groups.
    """
    inside = {id(m) for m in module.modules()}
    groups: dict[int, tuple[nn.Module, ...]] = {}
    for entry in unit_modules:
        group = tuple(entry)
        if not group or not all(isinstance(m, nn.Module) for m in group):
            raise TypeError(f"unit_modules: expected groups of nn.Modules, got {entry!r}")
        for member in group:
            if member is module or id(member) not in inside or id(member) in groups:
                raise ValueError(
                    f"unit_modules: {type(member).__name__} is the root module, not inside "
                    f"{type(module).__name__}, or in two units; expected distinct submodules"
                )
            groups[id(member)] = group
    return groups


def _split(
    unit: nn.Module | None,
    qual: str,
    params: list[nn.Parameter],
    names: dict[nn.Parameter, str],
    members: tuple[nn.Module, ...] = (),
) -> list[BucketSpec]:
    by_key: dict[tuple[object, bool, bool], list[nn.Parameter]] = {}
    specs = []
    for param in params:
        if gathered_by_extension(param):
            specs.append(BucketSpec(unit, qual, (param,), (names[param],), False, members, True))
            continue
        key = (param.dtype, param.requires_grad, is_expert_parallel_parameter(param))
        by_key.setdefault(key, []).append(param)
    return [
        BucketSpec(unit, qual, tuple(group), tuple(names[p] for p in group), expert, members)
        for (_, _, expert), group in by_key.items()
    ] + specs


def is_stacked(shape: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` is a stack of matrices (3-D: grouped expert weights).

    See [Note: stacked weights are spread].
    """
    return len(shape) == 3


def cut_dim(param: torch.Tensor, world_size: int) -> int:
    """The dim a weight's own bucket cuts into shards: 0 (whole experts), or a later dim.

    A stacked weight whose experts do not split evenly enough over ``world_size``
    ranks (a rank would hold more than 1.25x an even share, ``_whole_experts_even``:
    one expert, 2 or 3 over 4 ranks, 3 over 2) is cut along the
    first dim after 0 that tensor parallelism does not split and that has at least
    ``world_size`` rows (FSDP2's and torchtitan's ``Shard(1)`` for a plain
    ``[E, F, D]``), so that every rank holds a share of every expert. Under expert
    tensor parallelism that is dim 2 of gate/up (``[E, F / etp, D]``, split along
    dim 1) and dim 1 of down (``[E, D, F / etp]``), so the dp split and the tp split
    sit on distinct dims. Whole experts (dim 0) are kept where no dim qualifies; one
    expert is still cut along the first dim tensor parallelism leaves whole.
    See [Note: stacked weights are spread].
    """
    shape = local_shape(param)
    if world_size <= 1 or not is_stacked(shape) or _whole_experts_even(shape[0], world_size):
        return 0
    split = _tp_split_dims(param)
    free = [d for d in range(1, len(shape)) if d not in split]
    for dim in free:
        if shape[dim] >= world_size:
            return dim
    return free[0] if shape[0] == 1 and free else 0


def _whole_experts_even(experts: int, world_size: int) -> bool:
    """Whether whole experts give every rank a share within 1.25x of an even one.

    Then dim 0 is kept: whole rows are contiguous, and a shape-aware optimizer
    (Adafactor, Muon) steps them as it steps a dense weight's rows, where it refuses a
    weight split along a later dim. 5 experts over 2 ranks (3 and 2: 1.2x) stay
    whole; 3 over 2 (2 and 1: 1.33x) and any count below ``world_size`` are cut.
    """
    most = -(-experts // world_size)  # the most experts one rank holds
    return 4 * most * world_size <= 5 * experts


def _tp_split_dims(param: torch.Tensor) -> set[int]:
    """The dims tensor parallelism splits ``param`` along (DTensor placements or mf-tp's mark)."""
    if isinstance(param, DTensor):
        return {p.dim % param.dim() for p in param.placements if isinstance(p, Shard)}
    dim = get_mcore_tensor_parallel_partition_dim(param)
    return set() if dim is None else {dim % param.dim()}


def row_shape(shape: Sequence[int], dim: int = 0) -> tuple[int, ...]:
    """The shape a weight is stored as in its bucket when cut along ``dim``: ``dim`` first.

    Cut along dim 1, ``[E, F, D]`` is stored as ``[F, E, D]`` (contiguous), so each
    shard is whole rows of it: rank ``r`` holds ``[F_r, E, D]``, and the gathered
    bucket is the whole weight with ``dim`` moved to the front; the parameter is that
    storage viewed back as ``[E, F, D]`` (``FSDPParam.view_rows``). Cut along dim 2,
    ``[E, F, D]`` is stored ``[D, E, F]``.
    """
    shape = tuple(shape)
    return (shape[dim], *shape[:dim], *shape[dim + 1 :]) if dim else shape


def lay_out(
    spec: BucketSpec, world_size: int, alignment: int = DEFAULT_ALIGNMENT
) -> list[tuple[BucketSpec, BucketLayout]]:
    """The buckets ``spec`` becomes at ``world_size`` shards, each with its layout.

    Usually one; several when row sizes whose LCM would cost too much padding are
    better apart (``partition_bucket``), and one more per stacked weight when
    ``world_size > 1``. Shapes are the tp-local ones; buckets are ordered by their
    first parameter in model order.

    [Note: stacked weights are spread]
    A unit's bucket is cut into ``world_size`` consecutive shards, so a tensor
    smaller than a shard can sit on one rank whole: transformers' Qwen3-MoE
    layer at 2 ranks left ``gate_up_proj`` [E, 2F, H] all on rank 0 and most of
    ``down_proj`` on rank 1. Dense weights are many and small next to a unit,
    so the bucket evens them out; a layer's grouped expert weights are few and
    each is a large share of it. So every stacked (3-D) weight gets a bucket of
    its own: its layout is itself cut into ``world_size`` shards of whole dim-0
    rows (experts), so each rank holds ``ceil(E / world)`` or ``floor`` of its
    experts, and the rest of the unit's parameters keep their bucket. The extra
    buckets are the unit's: the communication window gathers and reduces them
    in the same coalesced collectives as the unit's other buckets, and values
    stay plain views of each gathered bucket. A weight whose experts do not
    split evenly enough over the ranks (whole experts would give a rank over
    1.25x an even share: torchtitan's experts at ``efsdp x ep > E``, a
    ``[1, F, D]`` piece per expert-parallel rank; 3 experts over 4 ranks, where
    one rank would hold none) is cut along dim 1
    instead (``cut_dim``): its bucket stores it with dims 0 and 1 swapped, as
    ``[F, E, D]`` (``row_shape``), so each rank holds whole rows of that,
    ``[E, F_r, D]`` parameter-shaped (``FSDPParam.row_dim`` is 1: its sharded
    form is ``Shard(1)`` on the dp mesh, its boxes cut dim 1), and the gathered
    bucket is viewed back as ``[E, F, D]`` (strides ``(D, E * D, 1)``,
    ``FSDPParam.view_rows``). FSDP2 stores ``[E, F_r, D]`` contiguous instead
    and pays a permuting copy after each all-gather and before each
    reduce-scatter; here the compute parameter and its grad are strided views
    of the buckets, autograd accumulates into the strided grad view, and no
    copy is made (a kernel that wants contiguous weights copies them itself).
    ``F`` need not divide by ``world``: rows are whole, so shards may differ by
    a row. The cut dim is the first after 0 that tensor parallelism leaves
    whole and that has at least ``world`` rows: under expert TP gate/up
    ``[E, F / etp, D]`` are cut along dim 2 (stored ``[D, E, F / etp]``) and
    down ``[E, D, F / etp]`` along dim 1, so the dp split never shares a dim
    with a tp split and the placements stay plain ``Shard`` of distinct dims.
    Whole experts are kept where no dim qualifies, and within 1.25x of an even
    share (``_whole_experts_even``), so shape-aware optimizers keep whole rows.
    """
    if spec.extension:
        return [(spec, chunk_layout(local_shape(spec.params[0]), world_size))]
    shapes = [local_shape(p) for p in spec.params]
    stacked = [i for i, s in enumerate(shapes) if world_size > 1 and is_stacked(s)]
    rest = [i for i in range(len(shapes)) if i not in set(stacked)]
    parts = [
        (tuple(rest[j] for j in indices), layout)
        for indices, layout in partition_bucket([shapes[i] for i in rest], world_size, alignment)
    ]
    dims = [cut_dim(p, world_size) for p in spec.params]
    parts += [
        ((i,), compute_bucket_layout([row_shape(shapes[i], dims[i])], world_size, alignment))
        for i in stacked
    ]
    parts.sort(key=lambda part: part[0][0])
    return [
        (
            BucketSpec(
                spec.unit,
                spec.unit_name,
                tuple(spec.params[i] for i in indices),
                tuple(spec.names[i] for i in indices),
                spec.expert,
                spec.members,
                row_dims=tuple(dims[i] for i in indices),
            ),
            layout,
        )
        for indices, layout in parts
    ]


def plan_bucket_layouts(
    module: nn.Module,
    world_size: int,
    fsdp_unit_modules: Sequence[type[nn.Module] | str] | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    disable_bucketing: bool = False,
) -> list[tuple[str, BucketLayout]]:
    """The engine's buckets for ``module`` at ``world_size`` ranks, without a process group.

    Pure (shapes only, so a model on the meta device works): the same grouping and
    layout ``MegatronFSDP`` builds, for simulations at any scale.

    Returns:
        ``(unit_name, layout)`` per bucket, root bucket(s) first (``unit_name == ""``).
    """
    classes = resolve_unit_classes(fsdp_unit_modules)
    return [
        (part.unit_name, layout)
        for spec in plan_buckets(module, classes, disable_bucketing)
        for part, layout in lay_out(spec, world_size, alignment)
    ]

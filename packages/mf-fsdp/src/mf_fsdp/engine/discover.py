"""What the engine is given: the model's parameters, where each lives, and what it refuses.

``discover`` runs once when the engine is built and returns, for every managed
parameter, its names, its registrations and its tensor-parallel facts
(``ParamSource``), and which parameters are ignored. On the way it refuses,
in one line that names the parameter, on every rank, what the engine cannot
carry correctly: a silent wrong result (the weights a module sees no longer
being the weights the optimizer steps) is the worst outcome.

- **Tensor classes** (``classify_params``). A parameter's tensor (a DTensor's
  local tensor for tensor parallelism) is either plain, or a subclass that
  implements FSDP2's all-gather extension (``fsdp_pre_all_gather`` and
  ``fsdp_post_all_gather``, see ``buckets/extension.py``): torchao's float8
  training weights and NF4 tensors. No other subclass goes into flat buffers:
  the engine copies a parameter's values into them and back, which loses what
  a subclass keeps beside them (a scale, a quantisation, the data itself); one
  without the hooks is sharded as an extension parameter whose hooks must be
  set on its sharded local tensor by the first forward (FSDP2 reads them
  there), where a tensor-parallel DTensor's subclass is refused. The
  extension itself is refused where the engine does not gather through it
  (``check_extension_params``).
- **Shared memory** (``check_disjoint_params``). Two parameter objects whose
  memory overlaps (views of one tensor) are two names for some of the same
  numbers; the engine gives each its own buffer, so an update to one would
  no longer reach the other. Tied weights are one ``Parameter`` object
  registered twice, which the engine keeps as one.
- **Ranks that disagree** (``check_ranks_agree``). Every rank of a data-parallel
  group must hold the same parameters with the same dtypes and shapes: the
  buckets, and every collective on them, are built from those facts on each
  rank alone. A rank with another dtype would otherwise send other bytes than
  its peers expect (gloo aborts the process in C++). Expert parameters are
  compared within the expert-data-parallel group (expert-parallel ranks hold
  different experts by design).

Nothing here builds buckets or moves data; ``check_ranks_agree`` is the one
collective (an ``all_gather_object`` per group when the engine is built).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mf_fsdp.buckets.bucket import ParamSource
from mf_fsdp.buckets.tp_params import tp_info, validate_tp_params
from mf_fsdp.config import DistributedDataParallelConfig, ZeroDPStrategy
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_utils import is_expert_parallel_parameter

__all__ = ["Discovered", "discover"]

SUPPORTED = (
    "plain tensors, DTensors on the tensor-parallel mesh, and tensor subclasses that implement "
    "FSDP2's all-gather extension (fsdp_pre_all_gather and fsdp_post_all_gather: torchao's "
    "float8 training weights, NF4)"
)
"""What the engine carries, for the errors that refuse anything else."""


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def classify_params(named_params: Iterable[tuple[str, nn.Parameter]]) -> set[int]:
    """The ``id``s of the parameters gathered through FSDP2's extension; refuse other subclasses.

    Raises:
        TypeError: naming the first parameter whose tensor is a subclass the engine
            cannot carry (a lazy module's uninitialised parameter among them), or that
            defines only one of the two extension hooks, or a DTensor (tensor-parallel)
            parameter whose local tensor is a subclass (not supported yet). Another
            subclass without the hooks is an extension parameter whose hooks may be set
            on its sharded local tensor until the first forward (see [Note: hooks set
            after the wrap] in ``buckets/extension.py``).
    """
    extension: set[int] = set()
    for name, param in named_params:
        local = _local(param)
        kind = type(local)
        if isinstance(param, nn.UninitializedParameter):
            raise TypeError(
                f"module: parameter {name!r} is an uninitialized parameter of a lazy module; "
                "expected materialised parameters (run one forward of the plain model, or "
                "give the module its input sizes, before sharding it)"
            )
        pre = callable(getattr(local, "fsdp_pre_all_gather", None))
        post = callable(getattr(local, "fsdp_post_all_gather", None))
        if pre != post:
            which = "fsdp_pre_all_gather" if pre else "fsdp_post_all_gather"
            raise TypeError(
                f"module: parameter {name!r} ({kind.__qualname__}) defines {which} only; "
                "FSDP2's all-gather extension needs both fsdp_pre_all_gather and "
                "fsdp_post_all_gather"
            )
        if pre:
            if isinstance(param, DTensor):
                raise TypeError(
                    f"module: parameter {name!r} is a tensor-parallel DTensor whose local tensor "
                    f"is a {kind.__qualname__} with FSDP2's all-gather extension; mf-fsdp "
                    "gathers such subclasses only for parameters without tensor parallelism"
                )
            extension.add(id(param))
        elif kind not in (torch.Tensor, nn.Parameter):
            if isinstance(param, DTensor):
                raise TypeError(_no_hooks(name, local))
            extension.add(id(param))  # its hooks may come before the first gather
    return extension


def _no_hooks(name: str, local: torch.Tensor) -> str:
    kind = type(local)
    return (
        f"module: parameter {name!r} is a {kind.__module__}.{kind.__qualname__}, a tensor "
        f"subclass without FSDP2's all-gather extension; mf-fsdp carries {SUPPORTED}"
    )


def check_extension_params(
    named_params: Sequence[tuple[str, nn.Parameter]],
    extension: set[int],
    strategy: ZeroDPStrategy,
    ddp_config: DistributedDataParallelConfig,
    dist_index: FSDPDistributedIndex,
    meta_init: bool = False,
) -> None:
    """Refuse what the engine does not gather through the extension (``buckets/extension.py``).

    Supported: ZeRO-2 and ZeRO-3, plain data parallelism or HSDP that replicates
    across ``dp_outer``, dense (non-expert) parameters, with real values or on the
    meta device in FSDP2's flow (``to_empty()``, then the model's init), not with
    ``init_model_with_meta_device`` (it rebuilds parameters as plain tensors).

    Raises:
        ValueError: naming the first extension parameter and the setting that excludes it.
    """
    if not extension:
        return
    first = next(name for name, p in named_params if id(p) in extension)
    param = next(p for p in named_params if id(p[1]) in extension)[1]
    refusal = None
    if strategy.level < 2:
        refusal = (
            f"zero_dp_strategy={strategy.value!r}: expected 2 or 3 (the extension shards the "
            "parameter and reduce-scatters its gradient, as FSDP2 does)"
        )
    elif ddp_config.offload_optimizer_state:
        refusal = "offload_optimizer_state=True: expected False (the shard stays on the device)"
    elif dist_index.hsdp_outer_dp_shard:
        refusal = (
            "hybrid-sharded HSDP (outer_dp_sharding_strategy=1): expected HSDP that replicates "
            "across dp_outer, or none"
        )
    elif any(is_expert_parallel_parameter(p) for _, p in named_params if id(p) in extension):
        refusal = "an expert parameter: expected dense parameters"
    elif meta_init and any(p.is_meta for _, p in named_params if id(p) in extension):
        refusal = (
            "init_model_with_meta_device=True on the meta device: expected real values, or "
            "FSDP2's flow (wrap without it, then model.to_empty(device=...) and the init)"
        )
    if refusal is not None and not callable(getattr(param, "fsdp_pre_all_gather", None)):
        raise TypeError(f"{_no_hooks(first, param)} (for this setting: {refusal})")
    if refusal is not None:
        raise ValueError(
            f"module: parameter {first!r} ({type(param).__qualname__}) implements FSDP2's "
            f"all-gather extension, which mf-fsdp gathers only for some settings; got {refusal}"
        )


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[begin, end)`` of ``tensor``'s storage its elements can touch."""
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    span = 1 + sum((size - 1) * abs(stride) for size, stride in pairs)
    begin = int(tensor.storage_offset()) * tensor.element_size()  # int: stubs allow a SymInt
    return begin, begin + span * tensor.element_size()


def check_disjoint_params(named_params: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Refuse two parameter objects whose memory overlaps (see the module docstring).

    Parameters that are disjoint pieces of one buffer (a flat parameter buffer) are
    fine. The check compares the byte ranges each parameter's strides can reach, so
    two interleaved views that touch no common element (two columns of one matrix)
    are refused too.

    Raises:
        ValueError: naming two overlapping parameters.
    """
    by_storage: dict[int, list[tuple[int, int, str]]] = {}
    for name, param in named_params:
        local = _local(param)
        if type(local) not in (torch.Tensor, nn.Parameter) or local.is_meta or not local.numel():
            continue
        begin, end = _extent(local)
        by_storage.setdefault(local.untyped_storage().data_ptr(), []).append((begin, end, name))
    for spans in by_storage.values():
        spans.sort()
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                raise ValueError(
                    f"module: parameters {first!r} and {second!r} share memory (overlapping "
                    "views of one tensor); mf-fsdp gives every parameter a buffer of its own, "
                    "so an update to one would no longer reach the other; expected distinct "
                    "tensors (to tie weights, register one Parameter object under both names)"
                )


def _describe(name: str, param: nn.Parameter) -> str:
    local = _local(param)
    kind = type(local).__qualname__
    return f"{name}: {kind} {local.dtype} {tuple(local.shape)} grad={param.requires_grad}"


def check_ranks_agree(
    named_params: Sequence[tuple[str, nn.Parameter]], group: dist.ProcessGroup | None
) -> None:
    """Refuse ranks of ``group`` whose parameters differ in name, class, dtype, shape or grad.

    One ``all_gather_object`` of a digest per rank; only when they differ is the whole
    list exchanged, to name the first difference. A group of one (or no initialised
    process group) has nothing to compare.

    Raises:
        ValueError: on every rank, naming the first parameter the ranks disagree on.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) == "fake":  # a simulated rank: no peer holds anything
        return
    lines = [_describe(name, param) for name, param in named_params]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    every: list[list[str] | None] = [None] * len(digests)
    dist.all_gather_object(every, lines, group=group)
    ranks = dist.get_process_group_ranks(group)
    listed = [list(lines or []) for lines in every]
    longest = max(len(lines) for lines in listed)
    for position in range(longest):
        seen = [lines[position] if position < len(lines) else "(none)" for lines in listed]
        if len(set(seen)) > 1:
            pairs = zip(ranks, seen, strict=True)
            shown = "; ".join(f"rank {rank} has {line}" for rank, line in pairs)
            raise ValueError(
                f"module: the data-parallel ranks disagree on parameter #{position}: {shown}; "
                "expected every rank to hold the same parameters with the same class, dtype, "
                "shape and requires_grad (the buckets and their collectives are built from them)"
            )


def refuse_offloaded_tp(sources: dict[int, ParamSource], experts: set[int]) -> None:
    """Raise if a parameter is tensor-parallel: ``offload_optimizer_state`` does not cover TP.

    Expert parameters (``id`` in ``experts``) split over the expert-parallel dim, which
    the expert index takes as their tp dim (grouped experts), offload as the rest do
    (``tests/fsdp/buckets/test_offload.py::test_expert_parallel_world2``).

    Raises:
        ValueError: naming the option and a TP parameter.
    """
    tp = next(
        (s.fqns[0] for key, s in sources.items() if s.tp is not None and key not in experts),
        None,
    )
    if tp is not None:
        raise ValueError(
            f"offload_optimizer_state=True is not supported with tensor parallelism: parameter "
            f"{tp!r} is tensor-parallel; expected a model without TP parameters (or turn "
            "offload_optimizer_state off)"
        )


def check_ignored(module: nn.Module, ignored_params: Collection[nn.Parameter]) -> set[int]:
    """The ``id``s of ``ignored_params``, each checked to be a parameter of ``module``.

    Raises:
        TypeError: if ``ignored_params`` is not a collection of parameters.
        ValueError: naming an entry that is not a parameter of ``module``, or when every
            parameter of ``module`` is ignored.
    """
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Collection):
        raise TypeError(
            f"ignored_params: expected a collection of parameters, got {ignored_params!r}"
        )
    own = {id(p) for p in module.parameters()}
    for param in ignored_params:
        if not isinstance(param, torch.Tensor) or id(param) not in own:
            shown = tuple(param.shape) if isinstance(param, torch.Tensor) else param
            raise ValueError(
                f"ignored_params: {shown!r} is not a parameter of {type(module).__name__}; "
                "expected parameters of the module being sharded"
            )
    ignored = {id(p) for p in ignored_params}
    if own and own <= ignored:
        raise ValueError(
            f"ignored_params: every parameter of {type(module).__name__} is ignored; "
            "expected at least one parameter to shard"
        )
    return ignored


def managed_named_params(
    module: nn.Module, ignored: set[int]
) -> Iterator[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in module.named_parameters() if id(p) not in ignored)


def index_chooser(
    module: nn.Module, dist_index: FSDPDistributedIndex, ignored: set[int]
) -> Callable[[nn.Parameter], FSDPDistributedIndex]:
    """The index each parameter of ``module`` lives on: the expert one for expert parameters.

    Raises:
        ValueError: naming an expert parameter when ``dist_index`` has no expert mesh.
    """
    expert = next(
        (n for n, p in managed_named_params(module, ignored) if is_expert_parallel_parameter(p)),
        None,
    )
    if expert is not None and dist_index.expert_index is None:
        raise ValueError(
            f"dist_index: parameter {expert!r} is an expert parameter (allreduce=False) but "
            "the FSDPDistributedIndex has no expt_device_mesh; expected one whose "
            f"{dist_index.dp_shard_dim!r} dim is the expert-data-parallel group (its "
            "gradients must not be reduced over the whole data-parallel group)"
        )

    def index_of(param: nn.Parameter) -> FSDPDistributedIndex:
        if dist_index.expert_index is not None and is_expert_parallel_parameter(param):
            return dist_index.expert_index
        return dist_index

    return index_of


def param_sources(
    module: nn.Module,
    index_of: Callable[[nn.Parameter], FSDPDistributedIndex],
    strategy: ZeroDPStrategy,
    ignored: set[int],
) -> dict[int, ParamSource]:
    """Names, registrations and TP facts of every parameter of ``module``, by ``id``.

    Raises:
        ValueError: for a scalar (0-d) parameter under a sharded strategy, or a TP
            split the engine cannot describe (see ``tp_info``).
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for attr, weight in owner._parameters.items():
            if weight is not None:
                slots.setdefault(id(weight), []).append((owner, attr))
    sources = {}
    for name, param in managed_named_params(module, ignored):
        if strategy.level > 0 and param.dim() == 0:
            raise ValueError(
                f"module: parameter {name!r} is a scalar (0-d); sharded strategies split "
                "dim 0, so expected at least one dim (reshape it to (1,), as FSDP2 asks)"
            )
        sources[id(param)] = ParamSource(
            tuple(names[id(param)]), tuple(slots[id(param)]), tp_info(name, param, index_of(param))
        )
    return sources


@dataclass(frozen=True, slots=True)
class Discovered:
    """What the engine builds its buckets from.

    Attributes:
        ignored: the ``id``s of the parameters the engine leaves alone.
        sources: per managed parameter (by ``id``): its names, registrations, TP facts.
    """

    ignored: set[int]
    sources: dict[int, ParamSource]


def discover(
    module: nn.Module,
    dist_index: FSDPDistributedIndex,
    strategy: ZeroDPStrategy,
    ddp_config: DistributedDataParallelConfig,
    ignored_params: Collection[nn.Parameter],
    meta_init: bool,
) -> Discovered:
    """Check every parameter of ``module`` and describe each the engine manages.

    Collective (``check_ranks_agree``) once a process group is initialised.

    Raises:
        TypeError / ValueError: for what the module docstring lists, for ignored
            parameters that are not the module's, and for tensor-parallel parameters
            the engine cannot describe (``buckets/tp_params.py``).
    """
    ignored = check_ignored(module, ignored_params)
    named = list(managed_named_params(module, ignored))
    extension = classify_params(named)
    check_disjoint_params(named)
    if dist.is_initialized():
        expert = [(n, p) for n, p in named if is_expert_parallel_parameter(p)]
        dense = [(n, p) for n, p in named if not is_expert_parallel_parameter(p)]
        check_ranks_agree(dense, dist_index.get_dp_group())
        if expert and dist_index.expert_index is not None:
            check_ranks_agree(expert, dist_index.expert_index.get_dp_group())
    check_extension_params(named, extension, strategy, ddp_config, dist_index, meta_init)
    index_of = index_chooser(module, dist_index, ignored)
    validate_tp_params(named, index_of, meta_init)
    sources = param_sources(module, index_of, strategy, ignored)
    if ddp_config.offload_optimizer_state:
        refuse_offloaded_tp(sources, {id(p) for _, p in named if is_expert_parallel_parameter(p)})
    return Discovered(ignored, sources)


def expert_dtensor_dims(module: nn.Module, expt_device_mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The dims of ``expt_device_mesh`` that ``module``'s expert DTensor parameters live on.

    Grouped experts split over expert parallelism (mf-tp's ``GroupedExperts``,
    torchtitan's experts) are DTensors ``Shard(d)`` over a 1-D mesh of the
    expert-parallel group, or, with expert tensor parallelism, over a 2-D mesh
    ``(ep, etp)``; the engine treats those dims of the expert mesh as their
    tensor-parallel dims. Each is recognised by its ranks: the dim whose group here
    holds the same ranks as that dim of the parameters' mesh. Empty when no expert
    parameter is a DTensor.

    Raises:
        ValueError: naming a parameter whose mesh dims match no dims, or two parameters
            on different dims.
    """
    if expt_device_mesh is None:
        return ()
    names = expt_device_mesh.mesh_dim_names or ()
    by_ranks = {
        tuple(dist.get_process_group_ranks(expt_device_mesh.get_group(name))): name
        for name in names
    }
    found: tuple[str, tuple[str, ...]] | None = None
    for param_name, param in module.named_parameters():
        if not (isinstance(param, DTensor) and is_expert_parallel_parameter(param)):
            continue
        mesh = param.device_mesh
        dims = tuple(
            by_ranks.get(tuple(dist.get_process_group_ranks(mesh.get_group(i))), "")
            for i in range(mesh.ndim)
        )
        if not all(dims):
            shape = dict(zip(names, expt_device_mesh.shape, strict=True))
            ranks = mesh.mesh.flatten().tolist()
            raise ValueError(
                f"expt_device_mesh: expert parameter {param_name!r} is a DTensor over ranks "
                f"{ranks} ({mesh}); expected a mesh whose every dim is a dim of "
                f"expt_device_mesh {shape}"
            )
        if found is not None and found[1] != dims:
            raise ValueError(
                f"expt_device_mesh: expert parameters {found[0]!r} and {param_name!r} are "
                f"DTensors over its dims {found[1]!r} and {dims!r}; expected the same dims"
            )
        found = found or (param_name, dims)
    return () if found is None else found[1]

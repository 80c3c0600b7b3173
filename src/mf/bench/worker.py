"""One benchmark run: train a GPT with one engine on this rank and measure it.

Runs inside a process started by torch's elastic launcher (or alone for the
single-process reference). Each run is a fresh process, so the peak resident
memory it reports belongs to that engine alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mf.bench.comm_counter import CommCounter, group_key
from mf.bench.context_parallel import SavedBytes, cp_group_mesh, saved_activation_bytes
from mf.bench.engines import AUTOCAST, build_engine, gathers_float8
from mf.launch import leave_process_group
from mf.models import GPT, PRESETS, Block, GPTConfig
from mf.train.data.sequence_shards import sequence_shards

__all__ = ["COMPILED", "RunResult", "RunSpec", "bytes_written", "run", "train_step"]

COMPILED = "compile"
"""The engine suffix (``mf-zero3+compile``) that compiles every block with ``fullgraph=True``."""


@dataclass(frozen=True)
class RunSpec:
    """What to run: engine, model preset, batch and step counts."""

    engine: str
    preset: str
    micro_batch: int
    seq_len: int
    steps: int
    warmup: int
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    meta_init: bool = False
    cp: int = 1


@dataclass
class RunResult:
    """What one run measured on one rank (times are the max over ranks of each step).

    ``cpu_seconds``: the main thread's CPU time per step (the host's cost: Python,
    dispatch, kernel launches; on a CPU device the compute too). ``ops_per_step``:
    aten ops one training step dispatches, ``kernels_per_step`` the GPU kernels it
    launches (CUDA only); both counted by torch's profiler on one extra step.
    ``cp``: the context-parallel size (each data-parallel rank's ``micro_batch``
    sequences split over ``cp`` ranks); ``activation_bytes``: what the forward
    saved for the backward on this rank (``saved_activation_bytes``);
    ``cp_bytes_per_step``: the bytes sent over the cp group.
    """

    engine: str
    optimizer: str
    preset: str
    world_size: int
    num_params: int
    step_seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    optimizer_seconds: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    ops_per_step: int = 0
    kernels_per_step: int | None = None
    losses: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    state_bytes: int = 0
    calls_per_step: float = 0.0
    bytes_sent_per_step: float = 0.0
    wire_bytes_per_step: float | None = None
    calls_by_kind: dict[str, float] = field(default_factory=dict)
    forward_gather_bytes: float = 0.0
    gathers_fp8: bool = False
    cp: int = 1
    activation_bytes: int = 0
    cp_bytes_per_step: float = 0.0


def _rss_bytes(field_name: str) -> int:
    """Current (VmRSS) or peak (VmHWM) resident memory of this process."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bytes_written() -> int | None:
    """Bytes this process passed to write calls so far, sockets included (Linux only).

    ``wchar`` of ``/proc/self/io``: on a gloo run it is what the rank put on the
    wire, whatever the library calls asked for.
    """
    try:
        with open("/proc/self/io") as io:
            fields = dict(line.split(": ") for line in io.read().splitlines())
    except OSError:
        return None
    return int(fields["wchar"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def model_state_bytes(
    model: nn.Module, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]
) -> int:
    """Bytes of distinct storages held by parameters, gradients, buffers and optimizer state."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    tensors: list[torch.Tensor] = []
    for param in model.parameters():
        tensors.append(_local(param))
        if param.grad is not None:
            tensors.append(_local(param.grad))
    tensors.extend(model.buffers())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                tensors.append(_local(param))
                if param.grad is not None:
                    tensors.append(_local(param.grad))
        for state in optimizer.state.values():
            tensors.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    seen: dict[int, int] = {}
    for tensor in tensors:
        for plain in _plain_tensors(tensor):
            storage = plain.untyped_storage()
            if storage.nbytes() > 0:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data (a subclass's inner ones: float8, NF4)."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _plain_tensors(getattr(tensor, name))]


def _batch(spec: RunSpec, step: int, rank: int, world_size: int, vocab: int, device: torch.device):
    generator = torch.Generator().manual_seed(spec.seed * 100_003 + step)
    tokens = torch.randint(
        0, vocab, (world_size * spec.micro_batch, spec.seq_len + 1), generator=generator
    )
    mine = tokens[rank * spec.micro_batch : (rank + 1) * spec.micro_batch].to(device)
    return mine[:, :-1], mine[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _mean_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def run(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec.steps`` measured steps (after ``spec.warmup``) and return the measurements."""
    distributed = spec.engine != "single"
    device = torch.device(spec.device)
    if distributed:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    try:
        return asdict(_measure(spec, device, distributed))
    finally:
        if distributed:
            leave_process_group()


def _measure(spec: RunSpec, device: torch.device, distributed: bool) -> RunResult:
    """Build the engine on the joined group, train, and measure every rank's steps."""
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world_size, 1)))
    mesh = cp_mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        # The engines shard over every rank: the data-parallel ranks and their cp ranks.
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
        if spec.cp > 1:
            cp_mesh = cp_group_mesh(spec.cp, device.type)
    dp_rank, dp_size = rank // spec.cp, world_size // spec.cp

    config = PRESETS[spec.preset]
    if spec.seq_len > config.seq_len:
        raise ValueError(
            f"seq_len {spec.seq_len} exceeds the {spec.preset} preset's {config.seq_len}"
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmRSS")
    torch.manual_seed(spec.seed)
    name, _, mode = spec.engine.partition("+")
    unsharded = name in AUTOCAST
    model: nn.Module = _built_model(config, device, spec.meta_init, unsharded, spec.seed)
    result = RunResult(
        spec.engine, spec.optimizer, spec.preset, world_size, config.num_parameters(), cp=spec.cp
    )
    if spec.precision == "fp8":
        result.gathers_fp8 = gathers_float8(name, device.type)
        _to_float8(model, result.gathers_fp8)
    bf16 = spec.precision in ("bf16", "fp8")  # fp8: float8 matmuls in a bf16 model
    model, optimizers = build_engine(name, model, mesh, spec.lr, spec.optimizer, bf16)
    after_step = _float8_scales(model) if result.gathers_fp8 else None
    if spec.meta_init and not unsharded:
        _materialise(model, device, spec.seed)
    autocast = bf16 and unsharded  # engines with no mixed-precision policy of their own
    result.tokens_per_step = dp_size * spec.micro_batch * spec.seq_len
    if mode == COMPILED:  # torchtitan's recipe: each block on its own, the rest eager
        for module in model.modules():
            if isinstance(module, Block):
                module.compile(fullgraph=True)
    counter = CommCounter()
    step_local: list[float] = []
    optimizer_local: list[float] = []
    wire_local = 0
    with counter.installed():
        last = spec.warmup + spec.steps - 1
        for step in range(spec.warmup + spec.steps):
            tokens, targets = _batch(spec, step, dp_rank, dp_size, config.vocab_size, device)
            measured = step >= spec.warmup
            counter.enabled = measured
            if distributed:
                counter.enabled = False
                dist.barrier()
                counter.enabled = measured
            _sync(device)
            written = bytes_written()
            start, cpu_start = time.perf_counter(), time.thread_time()
            with sequence_shards(cp_mesh, tokens, targets) as positions:
                counting = (  # the hooks cost host time: only on the last step
                    saved_activation_bytes()
                    if step == last
                    else contextlib.nullcontext(SavedBytes())
                )
                with (
                    counting as saved,
                    torch.autocast(device.type, torch.bfloat16, enabled=autocast),
                ):
                    loss = model(tokens, targets, **_positions(positions))
                loss.backward()
            _sync(device)
            optimizer_start = time.perf_counter()
            for optimizer in optimizers:
                optimizer.step()
            if after_step is not None:
                after_step()
            _sync(device)
            optimizer_elapsed = time.perf_counter() - optimizer_start
            if step == last:
                result.state_bytes = model_state_bytes(model, optimizers)
                result.activation_bytes = int(_max_over_ranks(float(saved.total), device))
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            _sync(device)
            elapsed = time.perf_counter() - start
            cpu_elapsed = time.thread_time() - cpu_start
            counter.enabled = False
            after = bytes_written()
            if measured and written is not None and after is not None:
                wire_local += after - written
            result.losses.append(_mean_over_ranks(loss.item(), device))
            if measured:
                step_local.append(elapsed)
                optimizer_local.append(optimizer_elapsed)
                result.cpu_seconds.append(cpu_elapsed)
    batch = _batch(spec, spec.warmup + spec.steps, dp_rank, dp_size, config.vocab_size, device)

    def one_step() -> None:
        with sequence_shards(cp_mesh, *batch) as positions:
            train_step(model, optimizers, batch, autocast, device, positions)

    result.ops_per_step, result.kernels_per_step = _count_dispatch(one_step, device)
    result.step_seconds = [_max_over_ranks(t, device) for t in step_local]
    result.optimizer_seconds = [_max_over_ranks(t, device) for t in optimizer_local]
    result.calls_per_step = counter.num_calls / spec.steps
    result.calls_by_kind = {k: v / spec.steps for k, v in counter.calls.items()}
    result.bytes_sent_per_step = counter.bytes_sent / spec.steps
    if cp_mesh is not None:
        cp_bytes = counter.bytes_by_group.get(group_key(cp_mesh.get_group()), 0.0)
        result.cp_bytes_per_step = cp_bytes / spec.steps
    result.forward_gather_bytes = _forward_gather_bytes(model, batch[0], autocast, device)
    if distributed and bytes_written() is not None and device.type == "cpu":
        result.wire_bytes_per_step = _mean_over_ranks(wire_local / spec.steps, device)
    if name == "ddp":
        _ddp_traffic(model, result, world_size)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - baseline
    else:
        peak = _rss_bytes("VmHWM") - baseline
    result.peak_bytes = int(_max_over_ranks(float(peak), device))
    return result


def _forward_gather_bytes(
    model: nn.Module, tokens: torch.Tensor, autocast: bool, device: torch.device
) -> float:
    """Bytes this rank sends in one no-grad forward: the weights it gathers, nothing else.

    Whatever collectives an engine gathers with (all-gathers, gloo's point-to-point
    batches), a forward without autograd sends weights only.
    """
    counter = CommCounter()
    with counter.installed(), torch.no_grad():
        counter.enabled = True
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            model(tokens)
        counter.enabled = False
    return counter.bytes_sent


def _to_float8(model: nn.Module, gathers_fp8: bool) -> None:
    """The GPT's block linears in float8 (torchao), FP8-gathering weights if ``gathers_fp8``.

    ``mf-bench`` checked that the device has float8 matmuls. A meta-device model
    converts too (torchao builds its linears on meta).
    """
    from mf.models.float8 import convert_gpt_to_float8

    convert_gpt_to_float8(model, fsdp_float8_all_gather=gathers_fp8)


def _float8_scales(model: nn.Module) -> Callable[[], None]:
    """Torchao's step after the optimizers when weights gather in FP8, as torchtitan runs it.

    ``precompute_float8_dynamic_scale_for_fsdp``: every weight's scale in one all-reduce.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def _built_model(
    config: GPTConfig, device: torch.device, meta_init: bool, unsharded: bool, seed: int
) -> GPT:
    """The preset's model on ``device``, or on the meta device for an engine to shard first.

    With ``meta_init`` (a model too large for one device's fp32 copy) a sharding
    engine wraps the model built on the meta device, then it gets storage and
    its own init's values (``_materialise``: FSDP2's flow, also mf's); an
    ``unsharded`` engine gets the same init on the device itself (``to_empty``
    would untie the tied head).
    """
    if not meta_init:
        return GPT(config).to(device)
    with torch.device(device if unsharded else "meta"):
        model = GPT(config)
    if unsharded:
        _initialise(model, seed)
    return model


def _materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """Storage on ``device`` for a wrapped meta model, then its own init's values."""
    model.to_empty(device=device)
    _initialise(model, seed)


def _initialise(model: nn.Module, seed: int) -> None:
    """The model's own ``reset_parameters()``, drawn from ``seed``."""
    torch.manual_seed(seed)
    # getattr: a GPT's method, reached through the engine's wrapper; nn.Module declares none
    reset_parameters: Callable[[], None] = getattr(model, "reset_parameters")  # noqa: B009
    with torch.no_grad():
        reset_parameters()


def _positions(positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The forward's keyword for a cp rank's positions (none without CP)."""
    return {} if positions is None else {"positions": positions}


def train_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast: bool,
    device: torch.device,
    positions: torch.Tensor | None = None,
) -> None:
    """One training step as every engine runs it (forward, backward, steps, zero_grad).

    The forward runs under bf16 autocast when ``autocast``; every optimizer steps,
    then every one zeroes its grads with ``set_to_none=True``. ``positions``: a cp
    rank's, inside ``sequence_shards``.
    """
    with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        loss = model(*batch, **_positions(positions))
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)


def _count_dispatch(step: Callable[[], None], device: torch.device) -> tuple[int, int | None]:
    """The aten ops one ``step()`` dispatches and GPU kernels it launches (None off CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    if device.type != "cuda":
        return ops, None
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return ops, kernels


def _ddp_traffic(model: nn.Module, result: RunResult, world_size: int) -> None:
    """DDP all-reduces every gradient once per step, in C++ where the counter cannot see it."""
    from torch.nn.parallel import DistributedDataParallel

    assert isinstance(model, DistributedDataParallel)  # what the ddp engine builds
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buckets = model._get_ddp_logging_data().get("num_buckets_reduced") or len(
        model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(",")
    )
    result.calls_per_step = float(buckets)
    result.calls_by_kind = {"all_reduce": float(buckets)}
    result.bytes_sent_per_step = 2 * grad_bytes * (world_size - 1) / world_size

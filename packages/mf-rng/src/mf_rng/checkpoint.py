"""Activation recomputation that replays the forward pass's random numbers.

:func:`checkpoint` runs a block without keeping its activations and runs it
again during backward. For the recomputed dropout masks to equal the
original ones, the generators must be where they were at forward: the CPU
generator, the accelerator's generator and every named state of the
process-wide tracker are captured before the forward pass, installed for the
recomputation, and the states current at backward are put back afterwards,
so the rest of the program cannot tell recomputation happened. Autocast
settings are replayed the same way.

:class:`CheckpointWithoutOutput` goes further for blocks whose output is only
kept alive by the next op's saved tensors (an activation before a linear
layer): after the consumer has run, the output's storage is freed, and it is
refilled by recomputation just before the consumer's backward needs it.

Both are reentrant (the backward runs a nested ``torch.autograd.backward``),
as in the reference, so they work with ``.backward()`` but not with
``torch.autograd.grad``; using them there raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mf_rng.default_tracker import get_cuda_rng_tracker
from mf_rng.device_state import RNGState, get_rng_state, set_rng_state
from mf_utils import default_device, gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

__all__ = ["CheckpointWithoutOutput", "checkpoint"]

_GRAD_ERROR = (
    "{where}: activation recomputation only supports .backward(), not torch.autograd.grad "
    "(the recomputed graph is backpropagated into .grad of its leaves); use .backward() or "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) instead"
)


def _clone(state: Any) -> Any:
    # Graph-safe states are live generator objects that draws advance in place;
    # plain states are byte tensors that nothing modifies.
    return state.clone_state() if isinstance(state, torch.Generator) else state


@dataclasses.dataclass(frozen=True, slots=True)
class _RNGSnapshot:
    """The CPU, accelerator and tracker generator states at one moment.

    A snapshot ``for_replay`` holds clones and installs fresh clones on every
    :meth:`restore`, so replaying it never consumes it. Otherwise it holds the
    live state objects and :meth:`restore` puts those very objects back, which
    keeps graph-safe states registered with CUDA graphs in use.
    """

    device_states: tuple[tuple[torch.device, RNGState, bool], ...]
    tracker_states: dict[str, Any]
    for_replay: bool

    @classmethod
    def capture(cls, *, for_replay: bool) -> _RNGSnapshot:
        tracker = get_cuda_rng_tracker()
        graph_safe = bool(getattr(tracker, "use_cudagraphable_rng", False))
        devices = dict.fromkeys((torch.device("cpu"), default_device(), tracker.device))
        states = []
        for device in devices:
            # The CPU generator has no graph-safe states; accelerators follow the tracker.
            safe = graph_safe and device.type != "cpu"
            state = get_rng_state(device, graph_safe=safe, clone=for_replay)
            states.append((device, state, safe))
        tracker_states = tracker.get_states()
        if for_replay:
            tracker_states = {name: _clone(state) for name, state in tracker_states.items()}
        return cls(tuple(states), tracker_states, for_replay)

    def restore(self) -> None:
        copy = _clone if self.for_replay else (lambda state: state)
        for device, state, graph_safe in self.device_states:
            set_rng_state(copy(state), device, graph_safe=graph_safe)
        get_cuda_rng_tracker().set_states(
            {name: copy(state) for name, state in self.tracker_states.items()}
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _ForwardState:
    """What the recomputation must reproduce: RNG states and autocast settings at forward."""

    rng: _RNGSnapshot
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def capture(cls) -> _ForwardState:
        rng = _RNGSnapshot.capture(for_replay=True)
        device_types = dict.fromkeys(device.type for device, _, _ in rng.device_states)
        autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in device_types
        )
        return cls(rng, autocast, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def replayed(self, where: str) -> Iterator[None]:
        """Run the block with the forward's RNG and autocast state and grad enabled."""
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(_GRAD_ERROR.format(where=where))
        current = _RNGSnapshot.capture(for_replay=False)
        self.rng.restore()
        try:
            with contextlib.ExitStack() as stack:
                for kind, enabled, dtype in self.autocast:
                    stack.enter_context(
                        torch.autocast(
                            kind, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache
                        )
                    )
                stack.enter_context(torch.enable_grad())
                yield
        finally:
            current.restore()


@dataclasses.dataclass(frozen=True, slots=True)
class _ArgLayout:
    """Where the tensors sit among a call's positional arguments (the rest kept as is)."""

    values: tuple[Any, ...]  # non-tensor arguments; None where a tensor goes
    tensor_positions: tuple[int, ...]
    requires_grad: tuple[bool, ...]  # per tensor position

    @classmethod
    def of(cls, args: Sequence[Any]) -> tuple[_ArgLayout, list[torch.Tensor]]:
        positions = tuple(i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor))
        tensors = [args[i] for i in positions]
        values = tuple(None if i in positions else arg for i, arg in enumerate(args))
        return cls(values, positions, tuple(t.requires_grad for t in tensors)), tensors

    def detached_args(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """Rebuild the arguments with fresh leaf tensors that collect the recomputed grads."""
        args = list(self.values)
        for position, tensor, requires_grad in zip(
            self.tensor_positions, tensors, self.requires_grad, strict=True
        ):
            args[position] = tensor.detach().requires_grad_(requires_grad)
        return tuple(args)

    def input_grads(self, args: Sequence[Any]) -> tuple[torch.Tensor | None, ...]:
        """The grads the leaves of :meth:`detached_args` collected, one per argument."""
        return tuple(
            args[i].grad if i in self.tensor_positions else None for i in range(len(self.values))
        )


def _as_tuple(outputs: Any) -> tuple[Any, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _backward_through(outputs: Any, grad_outputs: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grad_outputs`` through the recomputed ``outputs`` that carry a graph."""
    pairs = [
        (output, grad)
        for output, grad in zip(_as_tuple(outputs), grad_outputs, strict=True)
        if isinstance(output, torch.Tensor) and output.requires_grad and grad is not None
    ]
    if pairs:
        recomputed, grads = zip(*pairs, strict=True)
        torch.autograd.backward(recomputed, grads)


class _CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without saving activations; recompute it during backward.

    =========  ==========================================  =========================
    pass       tensors                                     collectives (``group``)
    =========  ==========================================  =========================
    forward    args -> outputs; saves the tensor args       none
               (first arg: only this rank's 1-D chunk
               ``[numel / world]`` when distributing)
    backward   grad outputs -> grad of each tensor arg,     all-gather of the first
               via a nested backward of the recomputed      arg's chunks back to its
               block (param grads accumulate as usual)      shape when distributing
    =========  ==========================================  =========================
    """

    @staticmethod
    def forward(
        ctx: Any,
        function: Callable[..., Any],
        distribute_saved_activations: bool,
        group: dist.ProcessGroup | None,
        *args: Any,
    ) -> Any:
        ctx.function = function
        ctx.group = group
        ctx.set_materialize_grads(False)
        ctx.forward_state = _ForwardState.capture()
        with torch.no_grad():
            outputs = function(*args)
        ctx.layout, tensors = _ArgLayout.of(args)
        ctx.first_shape = None
        if distribute_saved_activations:
            ctx.first_shape = args[0].shape
            tensors[0] = split_tensor_into_1d_equal_chunks(
                args[0].detach(), new_buffer=True, group=group
            )
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        tensors = list(ctx.saved_tensors)
        if ctx.first_shape is not None:
            tensors[0] = gather_split_1d_tensor(tensors[0], group=ctx.group).view(ctx.first_shape)
        args = ctx.layout.detached_args(tensors)
        with ctx.forward_state.replayed("checkpoint"):
            outputs = ctx.function(*args)
        _backward_through(outputs, grad_outputs)
        return (None, None, None, *ctx.layout.input_grads(args))


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool,
    *args: Any,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Run ``function(*args)`` now and again in backward, keeping no activations in between.

    The recomputation sees the same CPU, accelerator and tracker RNG states
    (and autocast settings) as the forward pass, so dropout masks match and
    gradients equal those of an uncheckpointed run. Parameters used inside
    ``function`` get their gradients as usual.

    Args:
        function: the block; returns a tensor or a tuple (non-tensor and
            non-differentiable entries allowed).
        distribute_saved_activations: keep only this rank's equal 1-D chunk of
            ``args[0]`` until backward, which all-gathers it over ``group``
            (useful when ``args[0]`` is replicated across tensor-parallel ranks).
        *args: the block's positional arguments; tensors among them get
            gradients if they require them, anything else is passed through.
        group: the group to split ``args[0]`` over; the default group when ``None``.

    Returns:
        ``function``'s outputs.

    Raises:
        TypeError: if ``function`` is not callable, or ``args[0]`` is not a
            tensor while distributing.
        ValueError: if ``args[0]``'s numel does not divide by the group size.
        RuntimeError: if distributing without an initialised process group;
            in backward, if the graph is differentiated with ``torch.autograd.grad``.
    """
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable, got {function!r}")
    if distribute_saved_activations:
        _check_distributable(args, group)
    return _CheckpointFunction.apply(function, bool(distribute_saved_activations), group, *args)


def _check_distributable(args: Sequence[Any], group: dist.ProcessGroup | None) -> None:
    if not args or not isinstance(args[0], torch.Tensor):
        first = args[0] if args else "nothing"
        raise TypeError(
            f"checkpoint: distribute_saved_activations=True needs a tensor first argument, "
            f"got {first!r}"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "checkpoint: distribute_saved_activations=True needs an initialized process group"
        )
    world_size = dist.get_world_size(group)
    if args[0].numel() % world_size != 0:
        raise ValueError(
            f"checkpoint: distribute_saved_activations=True needs args[0].numel() "
            f"({args[0].numel()}) divisible by the group size {world_size}"
        )


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward without a graph; backward through the owner's recomputation.

    ========  ============================================  ===========
    pass      tensors                                       collectives
    ========  ============================================  ===========
    forward   args -> outputs (same shapes as ``run_        none
              function``'s); saves the tensor args
    backward  grad outputs -> grad of each tensor arg, via  none
              a nested backward of the recomputed outputs
    ========  ============================================  ===========
    """

    @staticmethod
    def forward(
        ctx: Any, run_function: Callable[..., Any], owner: CheckpointWithoutOutput, *args: Any
    ) -> Any:
        ctx.owner = owner
        ctx.recomputed = None
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.layout, tensors = _ArgLayout.of(args)
        ctx.save_for_backward(*tensors)
        owner._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.recomputed is None:
            # The hook did not run (no discard, or a hook tensor off this path): recompute now.
            ctx.owner._recompute(None, ctx)
        args, outputs = ctx.recomputed
        ctx.recomputed = None
        _backward_through(outputs, grad_outputs)
        return (None, None, *ctx.layout.input_grads(args))


class CheckpointWithoutOutput:
    """Recompute a block in backward *and* free its output in between.

    Use one object per checkpointed block and iteration::

        ckpt = CheckpointWithoutOutput()
        hidden = ckpt.checkpoint(activation, pre_activation)
        out = linear(hidden)                      # saves `hidden` for its backward
        ckpt.discard_output_and_register_recompute(out)
        # hidden's storage is now empty; the backward of `linear` finds it
        # refilled, because a hook on `out`'s gradient recomputes it first.

    The recomputation replays the forward's RNG and autocast state like
    :func:`checkpoint`.
    """

    def __init__(self) -> None:
        self._run_function: Callable[..., Any] | None = None
        self._forward_state: _ForwardState | None = None
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._ctx: Any = None

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without keeping activations; return its outputs.

        Raises:
            TypeError: if ``run_function`` is not callable.
        """
        if not callable(run_function):
            raise TypeError(
                f"CheckpointWithoutOutput.checkpoint: run_function must be callable, "
                f"got {run_function!r}"
            )
        self._run_function = run_function
        self._forward_state = _ForwardState.capture()
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self._outputs = tuple(o for o in _as_tuple(outputs) if isinstance(o, torch.Tensor))
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute it when ``hook_tensor``'s gradient arrives.

        Call it after every consumer of the outputs has run: the tensors keep
        their shapes but hold no memory until the recomputation refills them.
        When ``hook_tensor`` does not require grad (inference) no backward
        comes and nothing is registered.

        Raises:
            RuntimeError: if :meth:`checkpoint` was not called first.
            TypeError: if ``hook_tensor`` is not a tensor.
        """
        if self._outputs is None:
            raise RuntimeError(
                "discard_output_and_register_recompute: call checkpoint() first; "
                "there is no output to discard"
            )
        if not isinstance(hook_tensor, torch.Tensor):
            raise TypeError(
                f"discard_output_and_register_recompute: hook_tensor must be a tensor, "
                f"got {hook_tensor!r}"
            )
        for output in self._outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            ctx = self._ctx
            hook_tensor.register_hook(lambda grad: self._recompute(grad, ctx))

    def _recompute(self, _grad: torch.Tensor | None, ctx: Any) -> None:
        if ctx is None or ctx.recomputed is not None:
            return
        if self._ctx is not ctx or self._run_function is None or self._forward_state is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: the recomputation state is gone; each object supports "
                "one backward per checkpoint() call"
            )
        args = ctx.layout.detached_args(ctx.saved_tensors)
        with self._forward_state.replayed("CheckpointWithoutOutput"):
            outputs = self._run_function(*args)
        recomputed = [o for o in _as_tuple(outputs) if isinstance(o, torch.Tensor)]
        with torch.no_grad():
            for kept, fresh in zip(self._outputs or (), recomputed, strict=True):
                # Refill in place: the consumers saved `kept` itself, not a copy.
                storage = fresh.untyped_storage()
                kept.untyped_storage().resize_(storage.size())
                kept.untyped_storage().copy_(storage)
        ctx.recomputed = (args, outputs)
        self._run_function = self._forward_state = self._outputs = self._ctx = None

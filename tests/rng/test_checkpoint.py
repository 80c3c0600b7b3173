"""checkpoint() and CheckpointWithoutOutput against the same block run without
recomputation.

Gradients are compared bitwise (``torch.equal``): recomputation replays the
same ops on the same inputs with the same random numbers in the same order,
so no reduction order changes and every bit must match. Memory claims are
measured: which tensors autograd saves (``saved_tensors_hooks``) and the
byte size of the freed output storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mf_rng import (
    CheckpointWithoutOutput,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_state,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
    set_rng_state,
)
from tests._multiprocess import run_on_ranks

HIDDEN = 16
BATCH = 6


class Block(torch.nn.Module):
    """Linear -> dropout on the TP stream -> gelu -> dropout on the default stream -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        with get_cuda_rng_tracker().fork():
            h = F.dropout(h, 0.3)
        h = F.dropout(F.gelu(h), 0.2)
        return self.down(h)


def _grads(block: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [t.grad.clone() for t in (*inputs, *block.parameters())]


def _zero(block: torch.nn.Module, *inputs: torch.Tensor) -> None:
    for t in (*inputs, *block.parameters()):
        t.grad = None


def _run_twice(
    block: torch.nn.Module, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Grads of ``run`` and of plain ``block``, both from the same RNG states.

    Also checks that the checkpointed run leaves every generator (``x``'s
    device and the tracker) exactly where the plain run does: recomputation
    in backward leaves no trace.
    """
    tracker = get_cuda_rng_tracker()
    device_state, tracker_states = get_rng_state(x.device), tracker.get_states()
    out = run(x)
    weights = torch.arange(out.numel(), device=x.device).view_as(out)
    (out * weights).sum().backward()
    got, got_out = _grads(block, x), out.detach().clone()
    after = get_rng_state(x.device), tracker.get_states()

    _zero(block, x)
    set_rng_state(device_state, x.device)
    tracker.set_states(tracker_states)
    expected_out = block(x)
    (expected_out * weights).sum().backward()
    assert torch.equal(got_out, expected_out.detach())
    assert torch.equal(after[0], get_rng_state(x.device))
    for name, state in tracker.get_states().items():
        assert torch.equal(after[1][name], state), name
    return got, _grads(block, x)


def _assert_all_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"gradient {index} differs"


def _setup(seed: int = 0, device: str = "cpu") -> tuple[Block, torch.Tensor]:
    """A block and an input on ``device``; the process-wide tracker is seeded (TP rank 1)."""
    model_parallel_cuda_manual_seed(seed + 100, tp_rank=1)
    torch.manual_seed(seed)
    block = Block().to(device)
    return block, torch.randn(BATCH, HIDDEN, device=device, requires_grad=True)


def test_checkpoint_gradients_are_bitwise_equal_with_dropout() -> None:
    block, x = _setup()
    got, expected = _run_twice(block, x, lambda v: checkpoint(block, False, v))
    _assert_all_equal(got, expected)


def test_checkpoint_replays_the_same_states_on_a_second_backward() -> None:
    block, x = _setup()
    out = checkpoint(block, False, x)
    out.sum().backward(retain_graph=True)
    first = _grads(block, x)
    out.sum().backward()  # recomputes again from the same forward states
    # g + g == 2 * g exactly in floating point, so the sums are bitwise equal.
    _assert_all_equal(_grads(block, x), [2 * g for g in first])


def test_recomputation_differs_without_state_replay() -> None:
    """Control: the RNG replay is what makes the gradients match."""
    block, x = _setup()
    out = checkpoint(block, False, x)
    torch.manual_seed(999)  # move the default stream between forward and backward
    out.sum().backward()
    got = _grads(block, x)
    _zero(block, x)
    model_parallel_cuda_manual_seed(100, tp_rank=1)
    torch.manual_seed(999)
    block(x).sum().backward()  # a forward that draws the masks of the moved stream
    assert not torch.equal(got[0], x.grad)


@contextlib.contextmanager
def _recording_saved_numels() -> Iterator[list[int]]:
    """Yield a list that collects the numel of each tensor autograd saves in the block."""
    numels: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        numels.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield numels


def test_checkpoint_keeps_only_the_inputs() -> None:
    block, x = _setup()
    with _recording_saved_numels() as packed:
        out = checkpoint(block, False, x)
    assert packed == [x.numel()]
    with _recording_saved_numels() as packed:
        block(x)
    assert sum(packed) > 4 * x.numel()  # the plain block saves its activations
    out.sum().backward()  # the saved input is enough to backpropagate


def test_checkpoint_replays_autocast() -> None:
    block, x = _setup()

    def run(v: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return checkpoint(block, False, v)

    cpu_state, tracker_states = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    out = run(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # backward runs outside autocast
    got = _grads(block, x)
    _zero(block, x)
    torch.set_rng_state(cpu_state)
    get_cuda_rng_tracker().set_states(tracker_states)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block(x)
    expected.float().sum().backward()
    _assert_all_equal(got, _grads(block, x))


def test_non_tensor_and_non_grad_inputs_and_outputs() -> None:
    model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    bias = torch.randn(3)  # no grad
    index = torch.tensor([2, 0])  # integer tensor

    def function(
        x: torch.Tensor, scale: float, bias: torch.Tensor, index: torch.Tensor, tag: str
    ) -> tuple[Any, ...]:
        y = F.dropout(x * scale + bias, 0.5)
        return y, tag, y.argmax(-1), y[index].sum(), bias * 2

    def loss(outputs: tuple[Any, ...]) -> torch.Tensor:
        y, _, _, picked, doubled_bias = outputs
        return (y * y).sum() + 3 * picked + doubled_bias.sum()

    cpu_state = torch.get_rng_state()
    outputs = checkpoint(function, False, x, 2.5, bias, index, "tag")
    assert outputs[1] == "tag"
    assert outputs[2].dtype == torch.int64
    assert not outputs[2].requires_grad
    # A Function cannot tell which outputs depend on a grad input, so `bias * 2`
    # is marked as requiring grad; its recomputation has no graph and is skipped.
    assert outputs[4].requires_grad
    loss(outputs).backward()
    got = x.grad.clone()
    assert bias.grad is None
    x.grad = None
    torch.set_rng_state(cpu_state)
    loss(function(x, 2.5, bias, index, "tag")).backward()
    assert torch.equal(got, x.grad)


def test_only_some_outputs_used_and_no_grad_inputs_at_all() -> None:
    x = torch.randn(5, requires_grad=True)
    first, _second = checkpoint(lambda v: (v.sin(), v.cos()), False, x)
    first.sum().backward()  # the second output gets no gradient
    assert torch.equal(x.grad, x.detach().cos())
    frozen = checkpoint(lambda v: v * 2, False, torch.ones(3))
    assert not frozen.requires_grad


def test_torch_autograd_grad_is_a_clear_error() -> None:
    block, x = _setup()
    out = checkpoint(block, False, x)
    with pytest.raises(
        RuntimeError, match=r"only supports \.backward\(\), not torch\.autograd\.grad"
    ):
        torch.autograd.grad(out.sum(), x)


def test_checkpoint_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match=r"checkpoint: function must be callable, got 3"):
        checkpoint(3, False, torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a tensor first argument, got 2\.0"):
        checkpoint(lambda a: a, True, 2.0)
    with pytest.raises(TypeError, match=r"needs a tensor first argument, got 'nothing'"):
        checkpoint(lambda: torch.ones(1), True)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match=r"needs an initialized process group"):
            checkpoint(lambda a: a, True, torch.ones(2))


def test_checkpoint_without_output_frees_and_refills_the_output() -> None:
    block, x = _setup()
    cpu_state, tracker_states = torch.get_rng_state(), get_cuda_rng_tracker().get_states()

    def activation(h: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork():
            return F.dropout(F.gelu(h), 0.4)

    pre = block.up(x)
    ckpt = CheckpointWithoutOutput()
    hidden = ckpt.checkpoint(activation, pre)
    kept = hidden.detach().clone()
    nbytes = hidden.untyped_storage().nbytes()
    assert nbytes == hidden.numel() * hidden.element_size()
    out = block.down(hidden)  # saves `hidden` for the weight gradient
    ckpt.discard_output_and_register_recompute(out)
    assert hidden.untyped_storage().nbytes() == 0
    assert hidden.shape == kept.shape  # metadata survives

    refilled: list[int] = []
    hidden_grad_seen = hidden.register_hook(
        lambda grad: refilled.append(hidden.untyped_storage().nbytes())
    )
    out.pow(2).sum().backward()
    hidden_grad_seen.remove()
    assert refilled == [nbytes]  # refilled before the consumer's backward needed it
    assert torch.equal(hidden.detach(), kept)
    got = _grads(block, x)

    _zero(block, x)
    torch.set_rng_state(cpu_state)
    get_cuda_rng_tracker().set_states(tracker_states)
    block.down(activation(block.up(x))).pow(2).sum().backward()
    _assert_all_equal(got, _grads(block, x))


def test_checkpoint_without_output_recomputes_in_backward_when_not_discarded() -> None:
    model_parallel_cuda_manual_seed(3)
    x = torch.randn(8, requires_grad=True)
    cpu_state = torch.get_rng_state()
    ckpt = CheckpointWithoutOutput()
    y, label = ckpt.checkpoint(lambda v, s: (F.dropout(v * s, 0.5), "label"), x, 3.0)
    assert label == "label"
    (y * y).sum().backward()
    got = x.grad.clone()
    x.grad = None
    torch.set_rng_state(cpu_state)
    (F.dropout(x * 3.0, 0.5) ** 2).sum().backward()
    assert torch.equal(got, x.grad)


def test_checkpoint_without_output_errors() -> None:
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(RuntimeError, match=r"call checkpoint\(\) first"):
        ckpt.discard_output_and_register_recompute(torch.ones(1))
    with pytest.raises(TypeError, match=r"run_function must be callable, got None"):
        ckpt.checkpoint(None)  # type: ignore[arg-type]
    x = torch.randn(4, requires_grad=True)
    y = ckpt.checkpoint(torch.sin, x)
    with pytest.raises(TypeError, match=r"hook_tensor must be a tensor, got 'y'"):
        ckpt.discard_output_and_register_recompute("y")  # type: ignore[arg-type]

    out = y * 2
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(RuntimeError, match=r"not torch\.autograd\.grad"):
        torch.autograd.grad(out.sum(), x)

    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.sin, x)
    loss = y.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"one backward per checkpoint\(\) call"):
        loss.backward()


def test_checkpoint_without_output_in_inference_only_frees() -> None:
    ckpt = CheckpointWithoutOutput()
    with torch.no_grad():
        y = ckpt.checkpoint(torch.exp, torch.randn(4))
        out = y + 1
        ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().nbytes() == 0
    assert not out.requires_grad


def _rank_distributed_saved_activations(rank: int, world_size: int) -> None:
    initialize_rng_tracker(device="cpu")
    group = dist.new_group(list(range(world_size)))
    block, x = _setup()  # same input on every rank, TP stream shared as in _setup
    original = x.detach().clone()
    for chosen in (None, group):
        packed: list[int] = []

        def run(
            v: torch.Tensor, chosen: dist.ProcessGroup | None = chosen, packed: list[int] = packed
        ) -> torch.Tensor:
            with _recording_saved_numels() as numels:
                out = checkpoint(block, True, v, group=chosen)
            packed.extend(numels)
            return out

        got, expected = _run_twice(block, x, run)
        # Only this rank's 1-D chunk of the first input was kept for backward.
        assert packed == [x.numel() // world_size], packed
        _assert_all_equal(got, expected)
        assert torch.equal(x.detach(), original)  # the caller's tensor is untouched
        _zero(block, x)

    with pytest.raises(
        ValueError, match=r"args\[0\]\.numel\(\) \(3\) divisible by the group size 2"
    ):
        checkpoint(torch.sin, True, torch.ones(3))


@pytest.mark.multiprocess
def test_distribute_saved_activations_on_two_ranks() -> None:
    run_on_ranks(_rank_distributed_saved_activations, 2)

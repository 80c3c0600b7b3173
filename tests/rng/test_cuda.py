"""The CUDA side of mf_rng: per-device generators, graph-safe states,
recomputation and freed output memory on a GPU.

Skipped where CUDA is absent (CI is CPU-only); run these on a GPU machine.
Equalities are bitwise for the same reasons as in the CPU tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from mf_rng import (
    CheckpointWithoutOutput,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_model_parallel_rng_tracker_name,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
    supports_graph_safe_rng,
    use_rng_tracker,
)
from mf_rng.device_state import device_generator, resolve_device
from tests.rng.test_checkpoint import _assert_all_equal, _run_twice, _setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = "cuda"


@pytest.fixture
def cuda_tracker() -> Iterator[None]:
    """A process-wide tracker on the current CUDA device for the test."""
    with use_rng_tracker():
        initialize_rng_tracker(device=CUDA)
        yield


def _fresh_cuda(seed: int) -> torch.Generator:
    return torch.Generator(device=CUDA).manual_seed(seed)


def test_resolve_and_generator_follow_the_current_device() -> None:
    current = torch.cuda.current_device()
    assert resolve_device(CUDA) == torch.device(CUDA, current)
    assert device_generator(CUDA) is torch.cuda.default_generators[current]
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"index out of range, {count} cuda devices exist"):
        device_generator(torch.device(CUDA, count))


@pytest.mark.parametrize("graph_safe", [False, True])
def test_cuda_fork_matches_a_fresh_generator_and_restores_default(graph_safe: bool) -> None:
    if graph_safe and not supports_graph_safe_rng(CUDA):
        pytest.skip("this torch has no graph-safe CUDA generator states")
    tracker = RNGStatesTracker(use_cudagraphable_rng=graph_safe, device=CUDA)
    tracker.add("a", 17)
    torch.cuda.manual_seed(5)
    cpu_before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(64, device=CUDA)
    after_fork = torch.rand(8, device=CUDA)
    # Graph-safe states are live objects (forks advance them): a snapshot clones.
    snapshot = {
        name: state.clone_state() if graph_safe else state
        for name, state in tracker.get_states().items()
    }
    if graph_safe:
        assert tracker.get_states()["a"] is tracker.states_["a"]
    with tracker.fork("a"):
        second = torch.rand(64, device=CUDA)

    reference = _fresh_cuda(17)
    assert torch.equal(first, torch.rand(64, device=CUDA, generator=reference))
    assert torch.equal(second, torch.rand(64, device=CUDA, generator=reference))
    torch.cuda.manual_seed(5)
    assert torch.equal(after_fork, torch.rand(8, device=CUDA))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator is not involved

    tracker.set_states(snapshot)  # a snapshot taken before the second fork rewinds it
    with tracker.fork("a"):
        assert torch.equal(torch.rand(64, device=CUDA), second)


def test_cuda_seeding_seeds_the_device_generator(cuda_tracker: None) -> None:
    model_parallel_cuda_manual_seed(99, tp_rank=3)
    tracker = get_cuda_rng_tracker()
    assert tracker.device.type == CUDA
    drawn = torch.rand(16, device=CUDA)
    assert torch.equal(drawn, torch.rand(16, device=CUDA, generator=_fresh_cuda(99)))
    with tracker.fork(get_model_parallel_rng_tracker_name()):
        inside = torch.rand(16, device=CUDA)
    assert torch.equal(inside, torch.rand(16, device=CUDA, generator=_fresh_cuda(99 + 2718 + 3)))


def test_cuda_checkpoint_gradients_are_bitwise_equal(cuda_tracker: None) -> None:
    block, x = _setup(device=CUDA)
    got, expected = _run_twice(block, x, lambda v: checkpoint(block, False, v))
    _assert_all_equal(got, expected)


def test_cuda_checkpoint_without_output_frees_device_memory(cuda_tracker: None) -> None:
    model_parallel_cuda_manual_seed(7)
    x = torch.randn(1024, 1024, device=CUDA, requires_grad=True)
    weight = torch.randn(1024, 1024, device=CUDA, requires_grad=True)

    def activation(v: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork():
            return F.dropout(F.gelu(v), 0.1)

    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    tracker_states = get_cuda_rng_tracker().get_states()
    ckpt = CheckpointWithoutOutput()
    hidden = ckpt.checkpoint(activation, x)
    out = hidden @ weight
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ckpt.discard_output_and_register_recompute(out)
    torch.cuda.synchronize()
    assert hidden.untyped_storage().nbytes() == 0
    assert before - torch.cuda.memory_allocated() == hidden.numel() * hidden.element_size()
    out.sum().backward()
    got = (x.grad.clone(), weight.grad.clone())

    x.grad = weight.grad = None
    torch.set_rng_state(cpu_state)
    torch.cuda.set_rng_state(cuda_state)
    get_cuda_rng_tracker().set_states(tracker_states)
    (activation(x) @ weight).sum().backward()
    assert torch.equal(got[0], x.grad)
    assert torch.equal(got[1], weight.grad)

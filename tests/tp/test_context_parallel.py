"""Context-parallel attention equals one process's attention over the whole sequence.

Where to start: ``_rank_parity`` runs ``F.scaled_dot_product_attention``
inside ``mf_tp.context_parallel`` on 2 or 4 gloo ranks and compares each
rank's rows, and the gradients of its q, k, v shards, with one process's
attention over the full sequence. The single-process tests above it check
the pieces without a process group: the head-tail layout, and the blockwise
math of every rank simulated in one process (hypothesis over world sizes,
chunk lengths, heads, grouped-query shapes, causal or not).

Tolerances: fp32 results differ from one process only in the order of fp32
sums (the log-sum-exp merge, the split of a row's keys into blocks), so
rtol 1e-5 with an atol of 5e-6 for values near zero (hypothesis found a causal
world-4 case, seed 2037, whose ``dv`` differs by 1.5e-6 at a value near
zero). bf16 runs are compared with the fp32 reference at 3e-2: bf16 keeps 8
bits of mantissa. fp64 runs are compared with a fp64 reference at 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mf_tp
from mf_tp._attention_kernels import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, MATH, BlockSaved
from mf_tp._blockwise_attention import attend, attend_backward, attention_blocks
from mf_tp._sequence_layout import SequenceLayout
from mf_tp.context_parallelism import SUPPORTED
from tests._multiprocess import cpu_mesh, run_on_ranks

RTOL = 1e-5
ATOL = 5e-6
BF16_TOL = 3e-2
FP64_TOL = 1e-10


def _qkv(
    batch: int, heads: int, kv_heads: int, seq: int, dim: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen)
    grad = torch.randn(batch, heads, seq, dim, generator=gen)
    return q, k, v, grad


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, ...]:
    """One process's output and q, k, v gradients over the full sequence."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


# --- the layout -------------------------------------------------------------------------------


def test_head_tail_layout_pairs_each_chunk_with_its_mirror() -> None:
    layout = SequenceLayout.of(8, 2, where="test")
    assert layout.balanced
    assert layout.positions(0).tolist() == [0, 1, 6, 7]
    assert layout.positions(1).tolist() == [2, 3, 4, 5]
    assert layout.gathered_positions().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_a_length_not_divisible_by_2cp_is_split_contiguously() -> None:
    layout = SequenceLayout.of(6, 2, where="test")
    assert not layout.balanced
    assert layout.positions(1).tolist() == [3, 4, 5]


def test_a_length_not_divisible_by_cp_is_refused() -> None:
    with pytest.raises(ValueError, match=r"test: a sequence length of 7 cannot be split .* of 2"):
        SequenceLayout.of(7, 2, where="test")


@given(world=st.integers(1, 8), chunk=st.integers(1, 4))
def test_every_rank_does_the_same_causal_work(world: int, chunk: int) -> None:
    layout = SequenceLayout.of(2 * world * chunk, world, where="test")
    work = set()
    for rank in range(world):
        pairs = sum(int(p) + 1 for p in layout.positions(rank))  # keys a causal row attends
        work.add(pairs)
    assert len(work) == 1, f"unequal causal work per rank: {sorted(work)}"
    assert sorted(layout.gathered_positions().tolist()) == list(range(layout.seq_len))


# --- the blockwise math, every rank simulated in one process ----------------------------------


def _simulate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    world: int,
    causal: bool,
    kernel: object,
) -> tuple[torch.Tensor, ...]:
    """Every rank's blockwise forward and backward, reassembled into full tensors."""
    layout = SequenceLayout.of(q.shape[2], world, where="test")
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for rank in range(world):
        pos = layout.positions(rank)
        blocks = attention_blocks(layout, rank, causal)
        local_q = q[:, :, pos]
        o, lse, extras = attend(local_q, k, v, blocks, kernel, scale)
        out[:, :, pos] = o
        dq_r, dk_r, dv_r = attend_backward(
            grad[:, :, pos], local_q, k, v, o, lse, extras, blocks, kernel, scale
        )
        dq[:, :, pos] = dq_r
        dk += dk_r
        dv += dv_r
    return out, dq, dk.to(k.dtype), dv.to(v.dtype)


@settings(max_examples=30)
@given(
    world=st.integers(1, 4),
    chunk=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    groups=st.sampled_from([1, 2]),
    causal=st.booleans(),
    kernel=st.sampled_from([CPU_FLASH, MATH]),
    seed=st.integers(0, 2**16),
)
def test_simulated_ranks_equal_one_process(
    world: int, chunk: int, kv_heads: int, groups: int, causal: bool, kernel: object, seed: int
) -> None:
    q, k, v, grad = _qkv(2, kv_heads * groups, kv_heads, 2 * world * chunk, 8, seed)
    expected = _reference(q, k, v, grad, causal)
    got = _simulate(q, k, v, grad, world, causal, kernel)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=f"{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_simulated_bf16_stays_close_to_fp32(causal: bool) -> None:
    q, k, v, grad = _qkv(2, 4, 2, 16, 16)
    expected = _reference(q, k, v, grad, causal)
    got = _simulate(*(t.bfloat16() for t in (q, k, v, grad)), 4, causal, CPU_FLASH)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, rtol=BF16_TOL, atol=BF16_TOL, msg=name)


@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_EFFICIENT], ids=lambda k: k.name)
def test_cuda_kernels_are_called_as_aten_declares(kernel: object) -> None:
    """On meta tensors: argument order, extras and shapes of the CUDA kernels' calls.

    The numbers need a GPU (see ``test_parity_on_cuda``); what this pins is that
    the aten signatures, the padded log-sum-exp of the efficient kernel and the
    repeated key heads of grouped-query attention fit together.
    """
    dtype = torch.bfloat16 if kernel is CUDA_FLASH else torch.float32
    q = torch.empty(2, 4, 8, 16, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 24, 16, device="meta", dtype=dtype)
    result = kernel.forward(q, k, k, causal=False, scale=0.25)
    assert result.out.shape == q.shape
    assert result.lse.shape == (2, 4, 8)
    assert result.lse.dtype == torch.float32
    saved = BlockSaved(result.out, q, k, k, result.out, result.lse, result.aux)
    dq, dk, dv = kernel.backward(saved, causal=False, scale=0.25)
    assert dq.shape == q.shape
    assert dk.shape == dv.shape == k.shape


# --- the collectives: 2 and 4 gloo ranks --------------------------------------------------------


def _rank_parity(rank: int, world: int, dtype: torch.dtype, cases: list[tuple]) -> None:
    mesh = cpu_mesh((world,), ("cp",))
    for causal, heads, kv_heads in cases:
        seq = 4 * world
        q, k, v, grad = _qkv(2, heads, kv_heads, seq, 8, seed=heads + 10 * kv_heads + causal)
        if dtype == torch.float64:  # the reference in float64 too: equal to 1e-10
            q, k, v, grad = (t.double() for t in (q, k, v, grad))
        expected = _reference(q, k, v, grad, causal)
        positions = torch.arange(seq)
        buffers = [t.to(dtype) for t in (q, k, v, grad)] + [positions]
        originals = [b.clone() for b in buffers]
        with mf_tp.context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2, 0], no_restore_buffers={buffers[3]}
        ):
            local_q, local_k, local_v = (b.detach().requires_grad_(True) for b in buffers[:3])
            out = F.scaled_dot_product_attention(
                local_q, local_k, local_v, is_causal=causal, enable_gqa=heads != kv_heads
            )
            out.backward(buffers[3])
            full_out, full_dq, full_dk, full_dv = mf_tp.context_parallel_unshard(
                mesh, [out.detach(), local_q.grad, local_k.grad, local_v.grad], [2, 2, 2, 2]
            )
            mine = [t.index_select(2, positions) for t in expected]
        what = f"causal={causal} heads={heads}/{kv_heads} {dtype}"
        tol = {
            torch.float64: dict.fromkeys(("rtol", "atol"), FP64_TOL),
            torch.float32: {"rtol": RTOL, "atol": ATOL},
        }.get(dtype, dict.fromkeys(("rtol", "atol"), BF16_TOL))
        local = (out, local_q.grad, local_k.grad, local_v.grad)
        for name, g, e in zip(("out", "dq", "dk", "dv"), local, mine, strict=True):
            assert g.dtype == dtype
            torch.testing.assert_close(g.to(e.dtype), e, **tol, msg=f"rank {rank} {name} {what}")
        full = (full_out, full_dq, full_dk, full_dv)
        for name, g, e in zip(("out", "dq", "dk", "dv"), full, expected, strict=True):
            torch.testing.assert_close(g.to(e.dtype), e, **tol, msg=f"unsharded {name} {what}")
        for index in (0, 1, 2, 4):
            assert torch.equal(buffers[index], originals[index]), f"buffer {index} not restored"
        assert buffers[3].shape[2] == seq // world, "a no_restore buffer came back"


_CASES = [(False, 4, 4), (True, 4, 4), (True, 4, 2), (False, 4, 1)]


@pytest.mark.multiprocess
def test_parity_world_2_fp32() -> None:
    run_on_ranks(_rank_parity, 2, torch.float32, _CASES, timeout=120)


@pytest.mark.multiprocess
def test_parity_world_2_fp64() -> None:
    """float64 attention, causal among the cases, equals one process's float64 to 1e-10."""
    run_on_ranks(_rank_parity, 2, torch.float64, _CASES, timeout=120)


@pytest.mark.multiprocess
def test_parity_world_4_fp32() -> None:
    run_on_ranks(_rank_parity, 4, torch.float32, _CASES, timeout=180)


@pytest.mark.multiprocess
def test_parity_world_2_bf16() -> None:
    run_on_ranks(_rank_parity, 2, torch.bfloat16, [(False, 4, 4), (True, 4, 2)], timeout=120)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_parity_on_cuda() -> None:  # pragma: no cover - runs where GPUs are
    run_on_ranks(_rank_parity_cuda, 2, backend="nccl", timeout=180)


def _rank_parity_cuda(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, BF16_TOL)):
        for causal in (False, True):
            q, k, v, grad = (t.cuda() for t in _qkv(2, 4, 2, 8 * world, 64))
            expected = _reference(q, k, v, grad, causal)
            buffers = [t.to(dtype) for t in (q, k, v, grad)]
            positions = torch.arange(8 * world, device="cuda")
            with mf_tp.context_parallel(
                mesh, buffers=[*buffers, positions], buffer_seq_dims=[2, 2, 2, 2, 0]
            ):
                local = [b.detach().requires_grad_(True) for b in buffers[:3]]
                out = F.scaled_dot_product_attention(*local, is_causal=causal, enable_gqa=True)
                out.backward(buffers[3])
                got = (out, *(t.grad for t in local))
                mine = [t.index_select(2, positions) for t in expected]
            for g, e in zip(got, mine, strict=True):
                torch.testing.assert_close(g.float(), e, rtol=tol, atol=tol)


def _rank_overlapping_buffers(rank: int, world: int) -> None:
    """Buffers that are overlapping views of one tensor (inputs, targets) shard and come back."""
    mesh = cpu_mesh((world,), ("cp",))
    windows = torch.arange(2 * 9).view(2, 9)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    before = windows.clone()
    positions = SequenceLayout.of(8, world, where="test").positions(rank)
    with mf_tp.context_parallel(mesh, buffers=[inputs, targets], buffer_seq_dims=[1, 1]):
        assert torch.equal(inputs, before[:, :-1][:, positions])
        assert torch.equal(targets, before[:, 1:][:, positions])
    assert torch.equal(windows, before), "the tensor the buffers view was written"
    assert torch.equal(inputs, before[:, :-1])
    assert inputs.stride() == (9, 1), "the view's strides were not restored"
    assert inputs.data_ptr() == windows.data_ptr(), "the buffer no longer views its tensor"


@pytest.mark.multiprocess
def test_overlapping_buffers_shard_and_come_back_unchanged() -> None:
    run_on_ranks(_rank_overlapping_buffers, 2, timeout=60)


# --- calls it cannot serve: one clear line each ---------------------------------------------------


def _rank_refusals(rank: int, world: int) -> None:
    mesh = cpu_mesh((world,), ("cp",))
    q = torch.randn(1, 2, 4, 8)
    bad_calls = {
        r"got an attn_mask of shape \(4, 4\)": dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)),
        r"got dropout_p=0.1": dict(dropout_p=0.1),
        r"got 2 query heads and 1 key heads with enable_gqa=False": dict(
            key=q[:, :1], value=q[:, :1]
        ),
        r"got query, key, value of shapes \[\(2, 4, 8\)": dict(query=q[0], key=q[0], value=q[0]),
        r"shapes and dtypes": dict(key=q[:, :, :2], value=q[:, :, :2]),
    }
    with mf_tp.context_parallel(mesh):
        for message, change in bad_calls.items():
            call = dict(query=q, key=q, value=q) | change
            with pytest.raises(ValueError, match=message) as raised:
                F.scaled_dot_product_attention(**call)
            assert SUPPORTED in str(raised.value)
        odd = torch.randn(1, 2, 3, 8)  # 6 positions over 2 ranks: no head-tail split
        with pytest.raises(ValueError, match=r"is_causal=True with 3 local positions"):
            F.scaled_dot_product_attention(odd, odd, odd, is_causal=True)
        F.scaled_dot_product_attention(odd, odd, odd)  # without a mask it is served
    # Outside the context attention is plain again.
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))


def _rank_bad_arguments(rank: int, world: int) -> None:
    mesh = cpu_mesh((world,), ("cp",))
    tokens = torch.zeros(2, 8)
    parameter = torch.nn.Parameter(torch.zeros(2, 8))
    cases = [
        (TypeError, r"mesh must be a DeviceMesh, got ProcessGroup", {"mesh": dist.group.WORLD}),
        (ValueError, r"got 0 dims for 1 buffers", {"buffer_seq_dims": []}),
        (ValueError, r"buffer_seq_dims\[0\]=2 is not a dim", {"buffer_seq_dims": [2]}),
        (ValueError, r"sequence length of 7 cannot be split", {"buffers": [torch.zeros(2, 7)]}),
        (ValueError, r"no_restore_buffers must be a subset", {"no_restore_buffers": {parameter}}),
        (
            TypeError,
            r"buffers\[0\] must be a plain tensor .*got Parameter",
            {"buffers": [parameter]},
        ),
        (
            ValueError,
            r"buffers\[1\] appears twice",
            {"buffers": [tokens, tokens], "buffer_seq_dims": [1, 1]},
        ),
    ]
    for error, message, change in cases:
        arguments = {"mesh": mesh, "buffers": [tokens], "buffer_seq_dims": [1]} | change
        with pytest.raises(error, match=message), mf_tp.context_parallel(**arguments):
            pass
        assert tokens.shape == (2, 8), "a refused call touched a buffer"


@pytest.mark.multiprocess
def test_calls_it_cannot_serve_raise_one_clear_line() -> None:
    run_on_ranks(_rank_refusals, 2, timeout=60)


@pytest.mark.multiprocess
def test_bad_arguments_raise_before_touching_buffers() -> None:
    run_on_ranks(_rank_bad_arguments, 2, timeout=60)

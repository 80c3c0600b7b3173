"""Every mapping's forward and backward against the analytic single-process result.

Each rank builds the same full tensors from a shared seed, feeds its own
piece through the mapping, backpropagates a known upstream gradient and
compares with what the math says the local output and input gradient must be.
Only the order of fp32 sums differs from the math, hence atol = rtol = 1e-6.
TP=2 and TP=4 run the same body; a separate TP=4 run covers the process-group
layout over the world and over a DeviceMesh.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import mf_rng
import mf_tp
from tests._multiprocess import cpu_mesh, run_on_ranks

ATOL = 1e-6
RTOL = 1e-6


def _check(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    expected_out: torch.Tensor,
    grad_out: torch.Tensor,
    expected_grad: torch.Tensor,
    what: str,
) -> None:
    x = x.clone().requires_grad_(True)
    out = fn(x)
    torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=RTOL, msg=f"{what}: forward")
    out.backward(grad_out)
    torch.testing.assert_close(x.grad, expected_grad, atol=ATOL, rtol=RTOL, msg=f"{what}: backward")


def _check_region_mappings(rank: int, t: int, group: dist.ProcessGroup | None) -> None:
    gen = torch.Generator().manual_seed(1234)
    X = torch.randn(4 * t, 3 * t, generator=gen)  # [S, H], same on every rank
    G = torch.randn(4 * t, 3 * t, generator=gen)
    tri = t * (t + 1) / 2  # sum over ranks of (r + 1)
    rows = lambda a: a.chunk(t, dim=0)[rank]  # noqa: E731
    cols = lambda a: a.chunk(t, dim=-1)[rank]  # noqa: E731
    scale = rank + 1

    _check(
        lambda x: mf_tp.copy_to_tensor_model_parallel_region(x, group),
        X,
        X,
        G * scale,
        G * tri,
        "copy_to",
    )
    _check(
        lambda x: mf_tp.reduce_from_tensor_model_parallel_region(x, group),
        X * scale,
        X * tri,
        G,
        G,
        "reduce_from",
    )
    _check(
        lambda x: mf_tp.scatter_to_tensor_model_parallel_region(x, group),
        X,
        cols(X),
        cols(G),
        G,
        "scatter_to_tp",
    )
    _check(
        lambda x: mf_tp.gather_from_tensor_model_parallel_region(x, group),
        cols(X),
        X,
        G,
        cols(G),
        "gather_from_tp",
    )
    _check(
        lambda x: mf_tp.scatter_to_sequence_parallel_region(x, group),
        X,
        rows(X),
        rows(G),
        G,
        "scatter_to_sp",
    )
    for use_global_buffer in (False, True):
        _check(
            lambda x, b=use_global_buffer: mf_tp.gather_from_sequence_parallel_region(
                x, True, group, use_global_buffer=b
            ).clone(),
            rows(X),
            X,
            G * scale,
            rows(G) * tri,
            f"gather_from_sp(buffer={use_global_buffer})",
        )
        _check(
            lambda x, b=use_global_buffer: mf_tp.reduce_scatter_to_sequence_parallel_region(
                x, group, use_global_buffer=b
            ).clone(),
            X * scale,
            rows(X) * tri,
            rows(G),
            G,
            f"reduce_scatter_to_sp(buffer={use_global_buffer})",
        )
    _check(
        lambda x: mf_tp.gather_from_sequence_parallel_region(x, False, group),
        rows(X),
        X,
        G,
        rows(G),
        "gather_from_sp(tensor_parallel_output_grad=False)",
    )
    _check(
        lambda x: mf_tp.all_gather_last_dim_from_tensor_parallel_region(x, group),
        cols(X),
        X,
        G * scale,
        cols(G) * tri,
        "all_gather_last_dim",
    )
    _check(
        lambda x: mf_tp.reduce_scatter_last_dim_to_tensor_parallel_region(x, group),
        X * scale,
        cols(X) * tri,
        cols(G),
        G,
        "reduce_scatter_last_dim",
    )
    _check(lambda x: mf_tp.all_to_all_sp2hp(x, group), rows(X), cols(X), cols(G), rows(G), "sp2hp")
    _check(lambda x: mf_tp.all_to_all_hp2sp(x, group), cols(X), rows(X), rows(G), cols(G), "hp2sp")

    # Uneven sequence splits: rank r holds r + 1 rows (rank 0 of a 4-way split: 1 row).
    sizes = [r + 1 for r in range(t)]
    Xu, Gu = X[: sum(sizes)], G[: sum(sizes)]
    mine = lambda a: a.split(sizes, dim=0)[rank]  # noqa: E731
    for tp_out_grad in (True, False):
        grad_in = G[: sum(sizes)] * (scale if tp_out_grad else 1)
        _check(
            lambda x, f=tp_out_grad: mf_tp.gather_from_sequence_parallel_region(
                x, f, group, output_split_sizes=sizes
            ),
            mine(Xu),
            Xu,
            grad_in,
            mine(Gu) * (tri if tp_out_grad else 1),
            f"uneven gather_from_sp(tensor_parallel_output_grad={tp_out_grad})",
        )
    _check(
        lambda x: mf_tp.reduce_scatter_to_sequence_parallel_region(
            x, group, input_split_sizes=sizes
        ),
        Xu * scale,
        mine(Xu) * tri,
        mine(Gu),
        Gu,
        "uneven reduce_scatter_to_sp",
    )

    # all_to_all: rank r sends r + j + 1 rows to rank j; block (src, dst) holds 100*src + dst.
    def block(src: int, dst: int, width: int = 2) -> torch.Tensor:
        return torch.full((src + dst + 1, width), 100.0 * src + dst)

    send = [r + j + 1 for j in range(t)] if (r := rank) >= 0 else []
    recv = [j + rank + 1 for j in range(t)]
    x_in = torch.cat([block(rank, j) for j in range(t)])
    out_expected = torch.cat([block(j, rank) for j in range(t)])
    grad_outgoing = torch.cat([block(j, rank) * 0.5 + rank for j in range(t)])
    # The gradient of my block (rank -> j) is what rank j received from me, scaled by j's rule.
    grad_expected = torch.cat([block(rank, j) * 0.5 + j for j in range(t)])
    _check(
        lambda x: mf_tp.all_to_all(group, x, recv, send),
        x_in,
        out_expected,
        grad_outgoing,
        grad_expected,
        "uneven all_to_all",
    )
    even = torch.cat([torch.full((2, 3), 10.0 * rank + j) for j in range(t)])
    even_out = torch.cat([torch.full((2, 3), 10.0 * j + rank) for j in range(t)])
    _check(lambda x: mf_tp.all_to_all(group, x), even, even_out, even_out, even, "even all_to_all")

    # Bad input: the last dim must divide by t.
    if t > 1:
        with pytest.raises(ValueError, match="last dim 7 is not divisible"):
            mf_tp.scatter_to_tensor_model_parallel_region(torch.zeros(2, 7), group)
        with pytest.raises(ValueError, match="output_split_sizes"):
            mf_tp.gather_from_sequence_parallel_region(
                torch.zeros(5, 2), True, group, output_split_sizes=[5] * (t + 1)
            )


def _rank_mappings(rank: int, world_size: int) -> None:
    # Explicit group without any global state, then the default group.
    _check_region_mappings(rank, world_size, dist.group.WORLD)
    mf_tp.initialize_model_parallel(world_size)
    try:
        assert mf_tp.get_tensor_model_parallel_world_size() == world_size
        _check_region_mappings(rank, world_size, None)
    finally:
        mf_tp.destroy_model_parallel()


def _rank_groups(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size=3"):
        mf_tp.initialize_model_parallel(3)
    with pytest.raises(RuntimeError, match="not initialized"):
        mf_tp.get_tensor_model_parallel_group()

    groups = mf_tp.initialize_model_parallel(2)
    try:
        # TP groups are consecutive ranks, DP groups stride across them.
        assert dist.get_process_group_ranks(groups.tp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(groups.dp_group) == [rank % 2, rank % 2 + 2]
        assert mf_tp.get_tensor_model_parallel_rank() == rank % 2
        assert mf_tp.get_data_parallel_rank() == rank // 2
        assert mf_tp.get_data_parallel_world_size() == 2
        assert mf_tp.get_tensor_model_parallel_src_rank() == rank // 2 * 2
        # mf_rng picks the TP rank up for model_parallel_cuda_manual_seed.
        assert mf_rng.registered_model_parallel_rank("tp") == rank % 2
        with pytest.raises(RuntimeError, match="already exist"):
            mf_tp.initialize_model_parallel(2)
        # The mappings honour the TP group: a reduce only sums the 2 ranks of my group.
        summed = mf_tp.reduce_from_tensor_model_parallel_region(torch.tensor([float(rank)]))
        assert summed.item() == (rank // 2 * 2) * 2 + 1
    finally:
        mf_tp.destroy_model_parallel()
    assert mf_rng.registered_model_parallel_rank("tp") == 0
    assert not mf_tp.model_parallel_is_initialized()

    mesh = cpu_mesh((2, 2), ("dp", "tp"))
    groups = mf_tp.initialize_model_parallel(device_mesh=mesh)
    try:
        assert groups.device_mesh is mesh
        assert dist.get_process_group_ranks(groups.tp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    finally:
        mf_tp.destroy_model_parallel()
    # Lending groups temporarily: the default and the mf_rng registration follow, then revert.
    with mf_tp.use_model_parallel_groups(groups):
        assert mf_tp.get_tensor_model_parallel_group() is groups.tp_group
        assert mf_rng.registered_model_parallel_rank("tp") == rank % 2
    assert not mf_tp.model_parallel_is_initialized()
    assert mf_rng.registered_model_parallel_rank("tp") == 0
    with (
        pytest.raises(TypeError, match="groups must be ModelParallelGroups or None"),
        mf_tp.use_model_parallel_groups(mesh),
    ):
        pass
    with pytest.raises(ValueError, match="disagrees with the mesh"):
        mf_tp.initialize_model_parallel(4, device_mesh=mesh)
    with pytest.raises(ValueError, match=r"must name dims 'tp' and 'dp'"):
        mf_tp.initialize_model_parallel(device_mesh=cpu_mesh((4,), ("fsdp",)))


@pytest.mark.multiprocess
def test_mappings_tp2() -> None:
    run_on_ranks(_rank_mappings, 2)


@pytest.mark.multiprocess
def test_mappings_tp4() -> None:
    run_on_ranks(_rank_mappings, 4, timeout=180)


@pytest.mark.multiprocess
def test_process_groups_over_world_and_mesh() -> None:
    run_on_ranks(_rank_groups, 4, timeout=180)

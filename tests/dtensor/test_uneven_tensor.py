"""``UnevenDTensor``: explicit pieces, correct gathers, optimizers and DCP round trips.

Gathers, redistributions and checkpoints only move data, so they are compared
with ``torch.equal``. Optimizer steps are elementwise on the local pieces and
are compared exactly with a single-process optimizer on the full tensors;
only norms (reductions in another order) get a tolerance.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from mf_dtensor import (
    ExplicitPieces,
    PieceMap,
    UnevenDTensor,
    rank_order_chunks,
    uneven_local_piece,
)
from mf_dtensor.chunk_metadata import local_mesh_index
from mf_dtensor.layout import make_chunk, mesh_coordinates
from mf_dtensor.pieces import (
    check_local_boxes,
    cut_boxes,
    normalize_placements,
    place_boxes,
    take_boxes,
)
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.dtensor._cases import LayoutCase, compositions, layout_cases

RowRanges = Sequence[Sequence[tuple[int, int]]]  # per rank: (start, stop) row ranges


def _full(shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator).to(dtype)


def _row_boxes(shape: Sequence[int], rows: RowRanges) -> ExplicitPieces:
    """Boxes of whole rows: rank r holds ``rows[r]`` (stacked in that order)."""
    rest = tuple(shape[1:])
    return ExplicitPieces(
        tuple(
            tuple(
                make_chunk((start, *[0] * len(rest)), (stop - start, *rest)) for start, stop in rr
            )
            for rr in rows
        )
    )


def _row_split(shape: Sequence[int], sizes: Sequence[int]) -> ExplicitPieces:
    """One contiguous block of rows per rank, of the given sizes (0 gives a 0-row box)."""
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    return _row_boxes(shape, [[(s, s + n)] for s, n in zip(starts, sizes, strict=True)])


def _replicated_over(pieces: ExplicitPieces, copies: int) -> ExplicitPieces:
    """A map for a (copies, n) mesh with [Replicate(), ...]: every row of the mesh alike."""
    return ExplicitPieces(pieces.boxes_per_rank * copies)


def _uneven(
    full: torch.Tensor, mesh: Any, placements: Sequence[Placement], pieces: PieceMap
) -> UnevenDTensor:
    boxes = pieces.boxes(local_mesh_index(mesh))
    local = cut_boxes(full, boxes, (0, *full.shape[1:])).clone()
    return UnevenDTensor.from_local(local, mesh, placements, shape=full.shape, pieces=pieces)


def _standard_piece(full: torch.Tensor, mesh: Any, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece in torch's own (torch.chunk) layout, as DCP planning computes it."""
    sizes, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _check_gathers(x: UnevenDTensor, full: torch.Tensor, targets: Sequence[Sequence[Placement]]):
    mesh = x.device_mesh
    gathered = x.full_tensor()
    assert type(gathered) is torch.Tensor
    assert torch.equal(gathered, full)
    for target in targets:
        result = x.redistribute(mesh, target)
        expected = tuple(
            Shard(p.dim % full.ndim) if isinstance(p, Shard) else p for p in target
        )  # negative dims come back normalised, as from DTensor.redistribute
        assert type(result) is DTensor
        assert result.placements == expected
        assert result.shape == full.shape
        assert torch.equal(result.to_local(), _standard_piece(full, mesh, expected))
        assert torch.equal(result.full_tensor(), full)


# In-process: pure logic.


def test_explicit_pieces_normalizes_boxes() -> None:
    box = ChunkStorageMetadata(offsets=[0, 0], sizes=[1, 3])  # type: ignore[arg-type]
    pieces = ExplicitPieces([[box], []])  # type: ignore[arg-type]
    assert pieces.boxes_per_rank == ((make_chunk((0, 0), (1, 3)),), ())
    assert isinstance(pieces.boxes(0)[0].offsets, torch.Size)
    assert pieces.boxes(0)[0] is not box  # a copy: the caller's box stays the caller's
    assert isinstance(pieces, PieceMap)
    assert pieces == ExplicitPieces(((make_chunk((0, 0), (1, 3)),), ()))
    with pytest.raises(ValueError, match=r"mesh_index: expected 0 <= mesh_index < 2, got 2"):
        pieces.boxes(2)


def test_explicit_pieces_errors() -> None:
    with pytest.raises(ValueError, match=r"boxes_per_rank\[1\]: .* must agree in every other dim"):
        ExplicitPieces(((), (make_chunk((0, 0), (1, 3)), make_chunk((1, 0), (1, 2)))))
    with pytest.raises(ValueError, match=r"boxes_per_rank\[0\]: .*no negative entries"):
        ExplicitPieces(((make_chunk((-1,), (2,)),),))
    with pytest.raises(ValueError, match=r"offsets and sizes of one length"):
        ExplicitPieces(((make_chunk((0,), (2, 2)),),))


def test_check_local_boxes_errors() -> None:
    shape, shard = (6, 4), (Shard(0),)
    boxes = [make_chunk((0, 0), (2, 4)), make_chunk((3, 0), (2, 4))]
    check_local_boxes(boxes, shape, shard, (4, 4))
    with pytest.raises(ValueError, match=r"local_tensor: expected shape \(4, 4\) .*got \(3, 4\)"):
        check_local_boxes(boxes, shape, shard, (3, 4))
    with pytest.raises(ValueError, match=r"out of bounds in dim 0 of global shape \(6, 4\)"):
        check_local_boxes([make_chunk((5, 0), (2, 4))], shape, shard, (2, 4))
    with pytest.raises(ValueError, match=r"does not span dim 1"):
        check_local_boxes([make_chunk((0, 1), (2, 3))], shape, shard, (2, 3))
    with pytest.raises(ValueError, match=r"must agree in every other dim"):
        check_local_boxes(
            [make_chunk((0, 0), (1, 2)), make_chunk((1, 2), (1, 1))], shape, (Shard(1),), (2, 2)
        )
    with pytest.raises(ValueError, match=r"must hold all 6 rows"):
        check_local_boxes([make_chunk((0, 0), (2, 1))], shape, (Shard(1),), (2, 1))
    with pytest.raises(ValueError, match=r"holds no boxes, so expected 0 rows"):
        check_local_boxes([], shape, shard, (1, 4))
    with pytest.raises(ValueError, match=r"expected 2 dims like shape"):
        check_local_boxes([], shape, shard, (0,))
    check_local_boxes([], shape, shard, (0, 4))


def test_normalize_placements() -> None:
    assert normalize_placements([Shard(-1), Replicate()], 3, 2) == (Shard(2), Replicate())
    with pytest.raises(ValueError, match=r"placements\[1\]: expected Shard\(dim\) or Replicate"):
        normalize_placements([Replicate(), Partial()], 2, 2)
    with pytest.raises(ValueError, match=r"placements\[0\]: expected Shard\(dim\) or Replicate"):
        normalize_placements([_StridedShard(0, split_factor=2)], 2, 1)
    with pytest.raises(ValueError, match=r"placements\[0\]: Shard\(dim=2\) shards a dim the 2-D"):
        normalize_placements([Shard(2)], 2, 1)
    with pytest.raises(ValueError, match=r"placements: expected one placement per mesh dim \(2\)"):
        normalize_placements([Shard(0)], 2, 2)


@st.composite
def _row_layouts(
    draw: st.DrawFn, ranks: int
) -> tuple[tuple[int, ...], list[list[tuple[int, int]]]]:
    """A shape and, per rank, row ranges in any order (empty ones included) tiling its rows."""
    rows = draw(st.integers(0, 9))
    shape = (rows, *draw(st.lists(st.integers(1, 3), max_size=2)))
    segments = draw(compositions(rows, draw(st.integers(1, 6))))
    owners = draw(
        st.lists(st.integers(0, ranks - 1), min_size=len(segments), max_size=len(segments))
    )
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    start = 0
    for size, owner in zip(segments, owners, strict=True):
        per_rank[owner].append((start, start + size))
        start += size
    return shape, [draw(st.permutations(ranges)) for ranges in per_rank]


@given(_row_layouts(3), st.integers(0, 2**16))
def test_cut_and_place_boxes_round_trip(layout, seed: int) -> None:
    shape, rows = layout
    pieces = _row_boxes(shape, rows)
    full = _full(shape, seed)
    rebuilt = torch.full(shape, float("nan"))
    for rank in range(3):
        boxes = pieces.boxes(rank)
        local = cut_boxes(full, boxes, (0, *shape[1:]))
        check_local_boxes(boxes, shape, (Shard(0),), local.shape)
        expected_rows = [full[start:stop] for start, stop in rows[rank]]
        assert torch.equal(local, torch.cat([full[:0], *expected_rows]))
        padded = torch.cat([local.reshape(-1), torch.zeros(3)])
        place_boxes(rebuilt, padded, boxes)
        taken = torch.full((local.numel(),), float("nan"), dtype=torch.float64)
        take_boxes(full, boxes, taken)  # the inverse, converting the dtype on the way
        assert torch.equal(taken, local.reshape(-1).double())
    assert torch.equal(rebuilt, full)


# Multi-rank.

PIECE_CASES: dict[str, tuple[tuple[int, ...], Callable[[tuple[int, ...]], ExplicitPieces]]] = {
    "rows_1_4": ((5, 3), lambda s: _row_split(s, [1, 4])),
    "rows_4_1": ((5, 3), lambda s: _row_split(s, [4, 1])),
    "rows_5_0": ((5, 3), lambda s: _row_split(s, [5, 0])),
    "no_boxes_on_0": ((5, 3), lambda s: _row_boxes(s, [[], [(0, 5)]])),
    # rank 0 rows 0-1 and 3-4, rank 1 rows 2 and 5 (e.g. a fused QKV under TP).
    "multi_box": ((6, 4), lambda s: _row_boxes(s, [[(0, 2), (3, 5)], [(2, 3), (5, 6)]])),
    "reversed_boxes": ((6, 4), lambda s: _row_boxes(s, [[(3, 5), (0, 2)], [(5, 6), (2, 3)]])),
    "one_dim": ((7,), lambda s: _row_split(s, [7, 0])),
}


def _rank_torch_contract(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    for name, (shape, make) in PIECE_CASES.items():
        full = _full(shape, seed=len(name))
        pieces = make(shape)
        x = _uneven(full, mesh, [Shard(0)], pieces)
        assert x.pieces is pieces, name
        assert list(x.local_boxes()) == list(pieces.boxes(rank)), name
        _check_gathers(x, full, [[Replicate()], [Shard(0)], [Shard(-1)]])
        half = x.redistribute(placements=[Replicate()], forward_dtype=torch.float64)
        assert torch.equal(half.to_local(), full.double()), name
    # The standard DTensor with the same pieces is what this class exists to fix.
    full = _full((5, 3), seed=1)
    local = full[:1] if rank == 0 else full[1:]
    plain = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
    assert not torch.equal(plain.full_tensor(), full)


@pytest.mark.multiprocess
def test_torch_contract_example_gathers_and_redistributes() -> None:
    run_on_ranks(_rank_torch_contract, 2)


def _rank_ops_keep_layout(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    full = _full((6, 4), seed=3)
    shape, make = PIECE_CASES["multi_box"]
    pieces = make(shape)
    x = _uneven(full, mesh, [Shard(0)], pieces)
    derived = {
        "zeros_like": (torch.zeros_like(x), torch.zeros_like(full)),
        "detach": (x.detach(), full),
        "clone": (x.clone(), full),
        "mul": (x * 2, full * 2),
        "to_bf16": (x.to(torch.bfloat16), full.to(torch.bfloat16)),
        "add_same_map": (x + _uneven(full, mesh, [Shard(0)], make(shape)), full * 2),
        "foreach": (torch._foreach_mul([x], 3.0)[0], full * 3),
    }
    for name, (value, expected) in derived.items():
        assert type(value) is UnevenDTensor, name
        assert value.pieces is pieces, name
        assert torch.equal(value.full_tensor(), expected), name
    y = x.clone()
    assert y.mul_(2) is y  # in-place ops hand back the input itself
    assert torch.equal(y.full_tensor(), full * 2)
    # A scalar reduction is a plain (Partial/Replicate) DTensor, and correct.
    total = x.sum()
    assert type(total) is DTensor
    torch.testing.assert_close(total.full_tensor(), full.sum())

    parameter = torch.nn.Parameter(x)
    assert type(parameter) is UnevenDTensor
    assert isinstance(parameter, torch.nn.Parameter)
    copied = copy.deepcopy(parameter)
    assert type(copied) is UnevenDTensor
    assert isinstance(copied, torch.nn.Parameter)
    assert copied.pieces is pieces
    assert copied.to_local().data_ptr() != parameter.to_local().data_ptr()
    assert torch.equal(copied.full_tensor(), full)
    # A piece that starts inside its buffer (a bucket's view) copies too, beside
    # another view of that buffer: one storage copied for both.
    local = x.to_local()
    buffer = torch.cat([torch.zeros(5), local.reshape(-1)])
    view = UnevenDTensor.from_local(
        buffer[5:].view(local.shape), mesh, [Shard(0)], shape=shape, pieces=pieces
    )
    head = UnevenDTensor.from_local(
        buffer[:5], mesh, [Shard(0)], shape=(10,), pieces=_row_split((10,), [5, 5])
    )
    view_copy, head_copy = copy.deepcopy([view, head])
    assert torch.equal(view_copy.full_tensor(), full)
    storage = view_copy.to_local().untyped_storage().data_ptr()
    assert storage == head_copy.to_local().untyped_storage().data_ptr()
    assert storage != buffer.untyped_storage().data_ptr()

    other_map = _row_split(shape, [3, 3])
    other = _uneven(full, mesh, [Shard(0)], other_map)
    with pytest.raises(ValueError, match=r"aten.add.Tensor: UnevenDTensor inputs have different"):
        _ = x + other
    with pytest.raises(ValueError, match=r"aten._foreach_add.List: UnevenDTensor inputs have"):
        torch._foreach_add([x], [other])
    # Different maps at different positions of a foreach op are fine.
    scaled = torch._foreach_mul([x, other], 2.0)
    assert [t.pieces for t in scaled] == [pieces, other_map]
    assert scaled[1].pieces is other_map


@pytest.mark.multiprocess
def test_ops_keep_type_and_pieces() -> None:
    run_on_ranks(_rank_ops_keep_layout, 2)


def _rank_errors_and_local_piece(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    shape = (6, 4)
    full = _full(shape, seed=5)
    pieces = PIECE_CASES["multi_box"][1](shape)
    x = _uneven(full, mesh, [Shard(0)], pieces)
    mine = cut_boxes(full, pieces.boxes(rank), (0, 4))

    # uneven_local_piece for each accepted kind of value.
    assert torch.equal(uneven_local_piece(full, x), mine)
    same_map = _uneven(full, mesh, [Shard(0)], pieces)
    piece = uneven_local_piece(same_map, x)  # no copy: its local tensor
    assert piece.data_ptr() == same_map.to_local().data_ptr()
    assert piece.shape == x.to_local().shape
    other_layout = _uneven(full, mesh, [Shard(0)], _row_split(shape, [0, 6]))
    assert torch.equal(uneven_local_piece(other_layout, x), mine)
    standard = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    assert torch.equal(uneven_local_piece(standard, x), mine)
    replicated = distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)
    assert torch.equal(uneven_local_piece(replicated, x), mine)
    empty_here = _uneven(full, mesh, [Shard(0)], _row_boxes(shape, [[], [(0, 6)]]))
    assert uneven_local_piece(full, empty_here).shape == empty_here.to_local().shape
    with pytest.raises(ValueError, match=r"value: expected the global shape \(6, 4\) of `like`, "):
        uneven_local_piece(full[:5], x)
    with pytest.raises(ValueError, match=r"got \(6, 3\)"):
        uneven_local_piece(distribute_tensor(full[:, :3], mesh, [Shard(0)]), x)
    with pytest.raises(TypeError, match=r"like: expected an UnevenDTensor, got DTensor"):
        uneven_local_piece(full, standard)  # type: ignore[arg-type]

    # from_local refuses what it can check locally.
    local = mine.clone()
    with pytest.raises(ValueError, match=r"local_tensor: expected shape \(\d, 4\)"):
        UnevenDTensor.from_local(local[:1], mesh, [Shard(0)], shape=shape, pieces=pieces)
    with pytest.raises(ValueError, match=r"placements\[0\]: expected Shard\(dim\) or Replicate"):
        UnevenDTensor.from_local(local, mesh, [Partial()], shape=shape, pieces=pieces)
    strided = _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match=r"placements\[0\]: expected Shard\(dim\) or Replicate"):
        UnevenDTensor.from_local(local, mesh, [strided], shape=shape, pieces=pieces)
    with pytest.raises(ValueError, match=r"placements: expected one placement per mesh dim"):
        UnevenDTensor.from_local(local, mesh, [Shard(0), Shard(1)], shape=shape, pieces=pieces)
    with pytest.raises(ValueError, match=r"out of bounds in dim \d of global shape \(4, 4\)"):
        UnevenDTensor.from_local(local, mesh, [Shard(0)], shape=(4, 4), pieces=pieces)
    with pytest.raises(ValueError, match=r"pieces: expected boxes for each of the 2 ranks"):
        UnevenDTensor.from_local(
            local, mesh, [Shard(0)], shape=shape, pieces=_row_split(shape, [6])
        )
    with pytest.raises(TypeError, match=r"pieces: expected a PieceMap"):
        UnevenDTensor.from_local(local, mesh, [Shard(0)], shape=shape, pieces=[[]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"local_tensor: expected a plain torch.Tensor"):
        UnevenDTensor.from_local(x, mesh, [Shard(0)], shape=shape, pieces=pieces)
    with pytest.raises(ValueError, match=r"shape: expected at least one dim"):
        UnevenDTensor.from_local(torch.tensor(1.0), mesh, [Replicate()], shape=(), pieces=pieces)

    # redistribute supports the same mesh and no Partial target.
    with pytest.raises(ValueError, match=r"placements: Partial targets are not supported"):
        x.redistribute(mesh, [Partial()])
    with pytest.raises(ValueError, match=r"placements: expected the target placements, got None"):
        x.redistribute(mesh)
    other_mesh = cpu_mesh((2,), ("other",))
    with pytest.raises(ValueError, match=r"device_mesh: UnevenDTensor redistributes on its own"):
        x.redistribute(other_mesh, [Replicate()])
    with pytest.warns(UserWarning, match=r"grad_placements is ignored"):
        x.full_tensor(grad_placements=[Replicate()])


@pytest.mark.multiprocess
def test_errors_and_uneven_local_piece() -> None:
    run_on_ranks(_rank_errors_and_local_piece, 2)


# Optimizers: several layouts at once, compared with one process on full tensors.

OPTIMIZER_LAYOUTS = ("rows_1_4", "multi_box", "no_boxes_on_0", "one_dim")


def _grads(step: int) -> list[torch.Tensor]:
    return [
        _full(PIECE_CASES[name][0], seed=100 * step + i) for i, name in enumerate(OPTIMIZER_LAYOUTS)
    ]


def _run_optimizer(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    params: list[torch.Tensor],
    to_param_layout: Callable[[int, torch.Tensor], torch.Tensor],
    steps: int = 3,
) -> torch.optim.Optimizer:
    optimizer = make(params)
    for step in range(steps):
        for i, (param, grad) in enumerate(zip(params, _grads(step), strict=True)):
            param.grad = to_param_layout(i, grad)
        optimizer.step()
    return optimizer


def _check_optimizers(mesh: Any, placements: Sequence[Placement], pieces: list[PieceMap]) -> None:
    fulls = [_full(PIECE_CASES[name][0], seed=i) for i, name in enumerate(OPTIMIZER_LAYOUTS)]
    optimizers: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
        "adam_loop": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False, weight_decay=0.01),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
        "sgd_momentum_loop": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    }
    for name, make in optimizers.items():
        reference = [torch.nn.Parameter(full.clone()) for full in fulls]
        ref_opt = _run_optimizer(make, reference, lambda i, g: g)
        params = [
            torch.nn.Parameter(_uneven(full, mesh, placements, p))
            for full, p in zip(fulls, pieces, strict=True)
        ]
        opt = _run_optimizer(make, params, lambda i, g: _uneven(g, mesh, placements, pieces[i]))
        for i, (param, ref) in enumerate(zip(params, reference, strict=True)):
            assert type(param) is UnevenDTensor, (name, i)
            assert param.pieces is pieces[i], (name, i)
            assert torch.equal(param.full_tensor(), ref.detach()), (name, i)
            for key, ref_value in ref_opt.state[ref].items():
                value = opt.state[param][key]
                if key == "step":
                    assert torch.equal(value, ref_value), (name, i)
                    continue
                assert type(value) is UnevenDTensor, (name, key)
                assert value.pieces is pieces[i], (name, key)
                assert torch.equal(value.full_tensor(), ref_value), (name, i, key)
        # Clipping: the norm over uneven pieces is the single-process norm.
        for param, ref, grad in zip(params, reference, _grads(7), strict=True):
            ref.grad = grad
            param.grad = _uneven(grad, mesh, placements, param.pieces)
        for foreach in (True, False):
            ref_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5, foreach=foreach)
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach)
            torch.testing.assert_close(norm.full_tensor(), ref_norm)
            for param, ref in zip(params, reference, strict=True):
                assert type(param.grad) is UnevenDTensor
                torch.testing.assert_close(param.grad.full_tensor(), ref.grad)


def _rank_optimizers(rank: int, world_size: int) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    pieces = [PIECE_CASES[name][1](PIECE_CASES[name][0]) for name in OPTIMIZER_LAYOUTS]
    _check_optimizers(mesh, [Shard(0)], pieces)


@pytest.mark.multiprocess
def test_optimizers_match_single_process() -> None:
    run_on_ranks(_rank_optimizers, 2)


# Checkpoints.

# name: (shape, placements on a 1-D mesh of 2, save rows, load rows, dtype)
CHECKPOINT_CASES: dict[
    str, tuple[tuple[int, ...], Placement, RowRanges, RowRanges, torch.dtype]
] = {
    "rows_1_4": ((5, 3), Shard(0), [[(0, 1)], [(1, 5)]], [[(0, 5)], [(5, 5)]], torch.float32),
    "rows_5_0": ((5, 3), Shard(0), [[(0, 5)], [(5, 5)]], [[], [(0, 5)]], torch.float32),
    "multi_box": (
        (6, 4),
        Shard(0),
        [[(0, 2), (3, 5)], [(2, 3), (5, 6)]],
        [[(5, 6), (0, 1)], [(1, 5)]],
        torch.float32,
    ),
    "bf16": ((4,), Shard(0), [[], [(0, 4)]], [[(0, 3)], [(3, 4)]], torch.bfloat16),
    "nothing": ((0, 3), Shard(0), [[(0, 0)], []], [[], [(0, 0)]], torch.float32),
}


def _column_pieces(shape: tuple[int, ...], sizes: Sequence[int]) -> ExplicitPieces:
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    return ExplicitPieces(
        tuple(((make_chunk((0, s), (shape[0], n)),)) for s, n in zip(starts, sizes, strict=True))
    )


def _rank_checkpoint(rank: int, world_size: int, directory: str) -> None:
    mesh = cpu_mesh((2,), ("dp",))
    fulls, saved, to_load, plain = {}, {}, {}, {}
    for index, (name, (shape, placement, save_rows, load_rows, dtype)) in enumerate(
        CHECKPOINT_CASES.items()
    ):
        fulls[name] = _full(shape, seed=index, dtype=dtype)
        saved[name] = _uneven(fulls[name], mesh, [placement], _row_boxes(shape, save_rows))
        zeros = torch.zeros_like(fulls[name])
        to_load[name] = _uneven(zeros, mesh, [placement], _row_boxes(shape, load_rows))
        plain[name] = distribute_tensor(zeros.clone(), mesh, [Shard(0)], src_data_rank=None)
    # Sharded along dim 1, 2 + 3 columns saved, loaded as 5 + 0.
    fulls["cols"] = _full((3, 5), seed=11)
    saved["cols"] = _uneven(fulls["cols"], mesh, [Shard(1)], _column_pieces((3, 5), [2, 3]))
    to_load["cols"] = _uneven(torch.zeros(3, 5), mesh, [Shard(1)], _column_pieces((3, 5), [5, 0]))
    plain["cols"] = distribute_tensor(torch.zeros(3, 5), mesh, [Shard(1)], src_data_rank=None)

    # Hooks: one chunk per non-empty box (none for empty boxes of a non-empty tensor).
    multi = saved["multi_box"]
    assert multi.__create_chunk_list__() == list(multi.local_boxes())
    assert saved["rows_5_0"].__create_chunk_list__() == (
        [] if rank == 1 else [make_chunk((0, 0), (5, 3))]
    )
    items = multi.__create_write_items__("w", multi)
    assert [item.index.offset for item in items] == [box.offsets for box in multi.local_boxes()]
    for item in items:
        shard = multi.__get_tensor_shard__(item.index)
        assert torch.equal(
            shard,
            fulls["multi_box"][
                tuple(
                    slice(o, o + s)
                    for o, s in zip(
                        item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes, strict=True
                    )
                )
            ],
        )
        assert shard.data_ptr() >= multi.to_local().data_ptr()  # a view, not a copy

    path = f"{directory}/ckpt"
    dcp.save({"model": saved, "step": 7}, checkpoint_id=path)
    loaded = {"model": to_load, "step": 0}
    dcp.load(loaded, checkpoint_id=path)
    dcp.load({"model": plain}, checkpoint_id=path)
    for name, full in fulls.items():
        assert type(to_load[name]) is UnevenDTensor, name
        assert torch.equal(to_load[name].full_tensor(), full), name
        assert torch.equal(plain[name].full_tensor(), full), name
    assert loaded["step"] == 7
    if rank == 0:
        dcp_to_torch_save(path, f"{directory}/full.pt")
        state = torch.load(f"{directory}/full.pt", weights_only=True)
        for name, full in fulls.items():
            assert torch.equal(state["model"][name], full), name
    dist.barrier()


@pytest.mark.multiprocess
def test_checkpoint_round_trips(tmp_path) -> None:
    run_on_ranks(_rank_checkpoint, 2, str(tmp_path))


# A 2x2 mesh: a Replicate mesh dim, and two sharded tensor dims.


def _block_pieces(
    shape: tuple[int, int], rows: Sequence[int], cols: Sequence[int]
) -> ExplicitPieces:
    """[Shard(0), Shard(1)] on a (len(rows), len(cols)) mesh with the given block sizes."""
    row_starts = list(itertools.accumulate([0, *rows[:-1]]))
    col_starts = list(itertools.accumulate([0, *cols[:-1]]))
    return ExplicitPieces(
        tuple(
            (make_chunk((row_starts[i], col_starts[j]), (rows[i], cols[j])),)
            for i, j in mesh_coordinates((len(rows), len(cols)))
        )
    )


def _rank_mesh_2d(rank: int, world_size: int, directory: str) -> None:
    mesh = cpu_mesh((2, 2), ("rep", "shard"))
    targets = [
        [Replicate(), Replicate()],
        [Replicate(), Shard(0)],
        [Shard(0), Shard(1)],
        [Shard(0), Shard(0)],
        [Shard(1), Replicate()],
    ]
    cases = {
        "replicate_rows": (
            [Replicate(), Shard(0)],
            (5, 3),
            _replicated_over(_row_split((5, 3), [1, 4]), 2),
        ),
        "replicate_multi_box": (
            [Replicate(), Shard(0)],
            (6, 4),
            _replicated_over(PIECE_CASES["multi_box"][1]((6, 4)), 2),
        ),
        "blocks": ([Shard(0), Shard(1)], (5, 4), _block_pieces((5, 4), [3, 2], [1, 3])),
        "blocks_empty": ([Shard(0), Shard(1)], (5, 4), _block_pieces((5, 4), [5, 0], [0, 4])),
    }
    state, loaded, fulls = {}, {}, {}
    for index, (name, (placements, shape, pieces)) in enumerate(cases.items()):
        full = fulls[name] = _full(shape, seed=20 + index)
        x = state[name] = _uneven(full, mesh, placements, pieces)
        _check_gathers(x, full, targets)
        assert torch.equal(uneven_local_piece(full, x), x.to_local())
        other = distribute_tensor(full, mesh, [Shard(1), Shard(0)], src_data_rank=None)
        assert torch.equal(uneven_local_piece(other, x), x.to_local())
        loaded[name] = distribute_tensor(
            torch.zeros(shape), mesh, [Shard(1), Shard(0)], src_data_rank=None
        )
    dcp.save(state, checkpoint_id=f"{directory}/ckpt")
    dcp.load(loaded, checkpoint_id=f"{directory}/ckpt")
    for name, full in fulls.items():
        assert torch.equal(loaded[name].full_tensor(), full), name
    # Optimizers on a mesh with a Replicate dim: replicas step alike, norms count once.
    pieces = [
        _replicated_over(PIECE_CASES[name][1](PIECE_CASES[name][0]), 2)
        for name in OPTIMIZER_LAYOUTS
    ]
    _check_optimizers(mesh, [Replicate(), Shard(0)], pieces)


@pytest.mark.multiprocess
def test_mesh_2d(tmp_path) -> None:
    run_on_ranks(_rank_mesh_2d, 4, str(tmp_path), timeout=240)


# Random layouts (one box per rank from layout_cases, several from row interleavings).


def _pieces_from_case(case: LayoutCase) -> ExplicitPieces:
    chunks = rank_order_chunks(
        case.global_shape, case.mesh_shape, case.placements, case.local_shapes
    )
    return ExplicitPieces(tuple((chunk,) for chunk in chunks))


def _random_targets(case: LayoutCase) -> list[list[Placement]]:
    ndim = len(case.global_shape)
    options = [Replicate(), *(Shard(d) for d in range(ndim))]
    targets = list(itertools.product(options, repeat=len(case.mesh_shape)))
    return [list(t) for t in targets[:: max(1, len(targets) // 4)]]


def _rank_random_layouts(
    rank: int,
    world_size: int,
    cases: list[LayoutCase],
    row_layouts: list[tuple[tuple[int, ...], list[list[tuple[int, int]]]]],
) -> None:
    meshes: dict[tuple[int, ...], Any] = {}
    for case in cases:
        if case.mesh_shape not in meshes:
            names = tuple(f"m{i}" for i in range(len(case.mesh_shape)))
            meshes[case.mesh_shape] = cpu_mesh(case.mesh_shape, names)
        mesh = meshes[case.mesh_shape]
        full = case.full_tensor()
        x = _uneven(full, mesh, case.placements, _pieces_from_case(case))
        _check_gathers(x, full, _random_targets(case))
    mesh = cpu_mesh((world_size,), ("flat",))
    for index, (shape, rows) in enumerate(row_layouts):
        full = _full(shape, seed=index)
        x = _uneven(full, mesh, [Shard(0)], _row_boxes(shape, rows))
        _check_gathers(x, full, [[Replicate()], [Shard(0)]])
        other = _uneven(
            full, mesh, [Shard(0)], _row_split(shape, [0] * (world_size - 1) + [shape[0]])
        )
        assert torch.equal(uneven_local_piece(other, x), x.to_local())


MESH_SHAPES = {2: [(2,), (1, 2), (2, 1)], 4: [(2, 2), (4,)]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
@settings(
    max_examples=1,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_layouts(world_size: int, data) -> None:
    cases = data.draw(
        st.lists(layout_cases(MESH_SHAPES[world_size]), min_size=12, max_size=12), label="cases"
    )
    rows = data.draw(st.lists(_row_layouts(world_size), min_size=8, max_size=8), label="rows")
    run_on_ranks(_rank_random_layouts, world_size, cases, rows, timeout=240)

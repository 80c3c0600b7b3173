"""mf_dtensor: unevenly sharded DTensors that gather, split and checkpoint correctly.

The FSDP engine shards flat buckets at arbitrary element offsets, so a
parameter's local piece can be any contiguous range, including none. This
package makes such DTensors first-class: build them from a local piece
(:func:`uneven_dtensor_from_local`), validate their layout, gather them to
the full tensor, split them without replicating, and save/load them with
``torch.distributed.checkpoint`` across layouts and world sizes. The
function names and semantics follow Megatron-FSDP's ``uneven_dtensor``
module; pure layout math lives in :mod:`mf_dtensor.layout`.

:class:`UnevenDTensor` is the object form: a DTensor subclass carrying an
explicit :class:`PieceMap`, whose ``full_tensor``, ``redistribute`` and
checkpoint hooks use the true pieces and whose op outputs keep the layout.
"""

from mf_dtensor.checkpoint import (
    filter_unflattened_state_dict,
    get_unflattened_state_dict,
    preprocess_state_dict_for_uneven_dtensor,
)
from mf_dtensor.chunk_metadata import (
    ChunkLayout,
    attach_chunk_metadata,
    gather_and_compute_chunk_metadata,
    get_chunk_metadata,
    update_uneven_dtensor_chunk_metadata,
    validate_uneven_dtensor,
)
from mf_dtensor.layout import rank_order_chunks, split_sections, validate_chunk_layout
from mf_dtensor.pieces import boxes_numel, place_boxes, take_boxes
from mf_dtensor.uneven import (
    assemble_full_tensor_from_uneven_chunks,
    gather_uneven_dtensor_to_full_tensor,
    split_dtensor,
    uneven_dtensor_from_local,
)
from mf_dtensor.uneven_tensor import ExplicitPieces, PieceMap, UnevenDTensor, uneven_local_piece

__all__ = [
    "ChunkLayout",
    "ExplicitPieces",
    "PieceMap",
    "UnevenDTensor",
    "assemble_full_tensor_from_uneven_chunks",
    "attach_chunk_metadata",
    "boxes_numel",
    "filter_unflattened_state_dict",
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "get_chunk_metadata",
    "get_unflattened_state_dict",
    "place_boxes",
    "preprocess_state_dict_for_uneven_dtensor",
    "rank_order_chunks",
    "split_dtensor",
    "split_sections",
    "take_boxes",
    "uneven_dtensor_from_local",
    "uneven_local_piece",
    "update_uneven_dtensor_chunk_metadata",
    "validate_chunk_layout",
    "validate_uneven_dtensor",
]

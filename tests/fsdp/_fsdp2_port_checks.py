"""Helpers of the ``test_fsdp2_port_*`` files: one scenario run on torch's FSDP2 and on mf.

The ported tests call a scenario once with torch's ``fully_shard`` and once with
``mf_fsdp.fsdp2.fully_shard``, in the same rank, with the same assertions. The
only check that knows mf's layout is ``check_local_rows``: FSDP2's pieces are
``torch.chunk`` rows, mf's are whole rows of its flat buckets, so a piece is
compared with the original cut in the parameter's own layout, and the full
tensor with the original (the value users see).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import TestCase

from tests.fsdp._fsdp2_conformance import _reference_piece

__all__ = ["BOTH", "check_local_rows"]

BOTH = ("torch's FSDP2", "mf_fsdp.fsdp2")
"""The labels of the two runs of a scenario, in the order the tests run them."""


def check_local_rows(case: TestCase, original: torch.Tensor, sharded: DTensor) -> None:
    """``sharded`` holds ``original``: this rank's piece in its layout, and in full."""
    case.assertEqual(sharded.to_local(), _reference_piece(original, sharded))
    case.assertEqual(sharded.full_tensor(), original)

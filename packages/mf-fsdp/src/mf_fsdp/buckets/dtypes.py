"""The dtypes of one bucket: compute, main weights, main grads, and the reduction's.

Resolved once when the bucket is built (``engine/assemble.py``) from the
mixed-precision policy, and read by every buffer and reduction of the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BucketDtypes"]


@dataclass(frozen=True, slots=True)
class BucketDtypes:
    """Compute, main-weight, main-grad and communication dtypes of one bucket."""

    compute: torch.dtype
    main: torch.dtype
    grads: torch.dtype
    comm: torch.dtype

"""Planning buckets without a process group: layouts for any world size, from shapes alone.

The public face of the pure layout math (``buckets/layout.py``) and the bucket
plan (``buckets/units.py``): what the engine would build for a model at a given
number of ranks, for simulations at cluster scale (``benchmarks/padding.py``,
mf-bench's scale tables) and for tests. No tensors, no collectives.
"""

from mf_fsdp.buckets.layout import (
    DEFAULT_ALIGNMENT,
    BucketLayout,
    compute_bucket_layout,
    partition_bucket,
)
from mf_fsdp.buckets.units import plan_bucket_layouts
from mf_fsdp.engine.stats import BucketStats

__all__ = [
    "DEFAULT_ALIGNMENT",
    "BucketLayout",
    "BucketStats",
    "compute_bucket_layout",
    "partition_bucket",
    "plan_bucket_layouts",
]

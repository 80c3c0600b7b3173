"""The side-by-side benchmark behind ``mf-bench`` (mf vs PyTorch FSDP2 vs DDP)."""

from mf.bench.comm_counter import CommCounter
from mf.bench.worker import RunResult, RunSpec, bytes_written, model_state_bytes, run

__all__ = ["CommCounter", "RunResult", "RunSpec", "bytes_written", "model_state_bytes", "run"]

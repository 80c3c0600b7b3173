"""Reference models used by mf's command-line jobs, benchmarks and tests."""

from mf.models.gpt import GPT, PRESETS, Block, GPTConfig
from mf.models.gpt_tp import GPTTensorParallel, TensorParallelBlock

__all__ = ["GPT", "PRESETS", "Block", "GPTConfig", "GPTTensorParallel", "TensorParallelBlock"]

"""Reference models used by mf's command-line jobs, benchmarks and tests."""

from mf.models.gpt import GPT, PRESETS, Block, GPTConfig
from mf.models.gpt_tp import GPTTensorParallel, TensorParallelBlock
from mf.models.optimizers import OPTIMIZER_RECIPES, build_optimizers, hidden_matrices

__all__ = [
    "GPT",
    "OPTIMIZER_RECIPES",
    "PRESETS",
    "Block",
    "GPTConfig",
    "GPTTensorParallel",
    "TensorParallelBlock",
    "build_optimizers",
    "hidden_matrices",
]

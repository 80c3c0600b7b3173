"""Reference models used by mf's command-line jobs, benchmarks and tests."""

from mf.models.gpt import GPT, PRESETS, Block, GPTConfig

__all__ = ["GPT", "PRESETS", "Block", "GPTConfig"]

"""``mf-train``: a real GPT training run on mf, started with one command."""

from mf.train.options import TrainOptions, parse_options

__all__ = ["TrainOptions", "parse_options"]

"""``mf-sample``: text from a trained mf-train model, on one process.

Reads an mf-train ``--out-dir`` (its ``model.safetensors`` export), a
``--ckpt-dir`` (the newest checkpoint) or one checkpoint folder, builds the
plain ``mf.models.GPT`` and continues ``--prompt``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mf.train.data import decode, encode
from mf.train.export import load_model, sample_text

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mf-sample",
        description="Generate text from an mf-train model export or checkpoint (one process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("path", help="an mf-train --out-dir, --ckpt-dir or checkpoint folder")
    parser.add_argument("--prompt", default="The ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error(f"--tokens must be 0 or more, got {args.tokens}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be a positive number, got {args.temperature}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Print the prompt and its continuation; 2 with one line on a bad path."""
    args = _parse(argv)
    try:
        model = load_model(args.path)
    except ValueError as error:
        print(f"mf-sample: error: {error}", file=sys.stderr)
        return 2
    prompt = encode(args.prompt or "\n")
    seq_len = model.config.seq_len
    sequence = sample_text(model, prompt, args.tokens, seq_len, args.seed, args.temperature)
    print(decode(sequence))
    return 0


if __name__ == "__main__":
    sys.exit(main())

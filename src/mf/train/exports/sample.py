"""``mf-sample``: text from a trained mf-train model, on one process.

Reads an mf-train ``--out-dir`` (its ``model.safetensors`` export), a
``--ckpt-dir`` (the newest checkpoint) or one checkpoint folder, builds the
plain ``mf.models.GPT`` and continues ``--prompt`` in bytes. A transformers
folder (a ``--model PATH`` run's ``<out-dir>/model``, its ``--out-dir``, or any
causal-LM folder) is loaded with transformers and speaks through its tokenizer;
``--chat QUESTION`` asks it as a user turn rendered by the folder's chat template
with the generation prompt, and prints the answer alone, stopped at the end of
turn (the EOS ids of the folder's generation config, which an mf-train export
extends with the template's end-of-turn token).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mf.train.data.text import BYTES, ByteCodec
from mf.train.exports.chat_export import stop_ids
from mf.train.exports.export import load_model, sample_text
from mf.train.exports.folder_export import FolderCodec, load_folder_for_sampling
from mf.train.sources.model_folder import CausalLM

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mf-sample",
        description="Generate text from an mf-train model export or checkpoint (one process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "path",
        help="an mf-train --out-dir, --ckpt-dir or checkpoint folder, or a transformers folder",
    )
    parser.add_argument("--prompt", default="The ", help="text to continue")
    parser.add_argument(
        "--chat",
        default=None,
        metavar="QUESTION",
        help="a transformers folder with a chat template: ask QUESTION as a user turn and "
        "print the answer, stopped at the end of turn (instead of --prompt)",
    )
    parser.add_argument(
        "--tokens", type=int, default=200, help="tokens to generate (bytes for the GPT presets)"
    )
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
    model: torch.nn.Module
    codec: ByteCodec | FolderCodec
    try:
        loaded = load_folder_for_sampling(Path(args.path))
        if loaded is None:
            gpt = load_model(args.path)
            model, codec, seq_len = gpt, BYTES, gpt.config.seq_len
        else:
            model, codec, seq_len = loaded
        if args.chat is not None:
            if loaded is None:
                raise ValueError(
                    f"--chat: {args.path!r} is an mf GPT (bytes, no chat template); expected "
                    "a transformers folder with a chat template"
                )
            return _answer(args, *loaded)
    except ValueError as error:
        print(f"mf-sample: error: {error}", file=sys.stderr)
        return 2
    prompt = codec.encode(args.prompt or "\n")
    sequence = sample_text(model, prompt, args.tokens, seq_len, args.seed, args.temperature)
    print(codec.decode(sequence))
    return 0


def _answer(args: argparse.Namespace, model: CausalLM, codec: FolderCodec, seq_len: int) -> int:
    """Print the answer to ``--chat``'s question, stopped at the folder's end of turn.

    Raises:
        ValueError: the folder has no chat template (one line).
    """
    tokenizer = codec.tokenizer
    if not tokenizer.chat_template:
        raise ValueError(
            f"--chat: the folder {args.path!r} has no chat template (chat_template in "
            "tokenizer_config.json, or chat_template.jinja) to render the question"
        )
    question = [{"role": "user", "content": args.chat}]
    prompt = tokenizer.apply_chat_template(
        question, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    stop = set(stop_ids(model.lm.generation_config))
    prompt_tokens = torch.tensor([int(t) for t in prompt])
    sequence = sample_text(
        model, prompt_tokens, args.tokens, seq_len, args.seed, args.temperature, stop
    )
    answer = [int(t) for t in sequence[len(prompt_tokens) :]]
    if answer and answer[-1] in stop:
        answer.pop()
    print(codec.decode(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A small Llama folder made locally, to try ``mf-train --model PATH`` with no download.

``python -m mf.train.exports.example_folder PATH`` writes what a downloaded model folder
holds: ``config.json`` (a ``LlamaConfig``), ``model.safetensors`` (random weights
from ``--seed``) and a tokenizer (``tokenizer.json``): byte-level BPE trained by
``tokenizers`` on mf-train's built-in corpus, with an ``<eos>`` token. The tests
of ``--model PATH`` build their tiny folders with ``make_llama_folder``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mf.train.data.text import load_corpus

__all__ = ["make_llama_folder", "save_tokenizer"]


def save_tokenizer(folder: Path, vocab_size: int, corpus_chars: int | None = None) -> None:
    """Train byte-level BPE on the built-in corpus (its first ``corpus_chars``); save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = load_corpus(None)[0][:corpus_chars]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.save_pretrained(folder)


def make_llama_folder(
    folder: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    positions: int = 128,
    vocab_size: int = 320,
    corpus_chars: int | None = 20_000,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A Llama folder (config, safetensors, tokenizer) of random weights; returns ``folder``.

    The tokenizer has ``vocab_size`` tokens or fewer (BPE stops when the corpus has
    no more merges); the model's embedding has ``vocab_size`` rows.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's bar is not this command's output
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(folder, vocab_size, corpus_chars)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=0,  # <eos>, the tokenizer's first token
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.to(dtype)  # type: ignore[arg-type]  # transformers types .to as a decorator's wrapper
    model.save_pretrained(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """Write the folder; print its size."""
    parser = argparse.ArgumentParser(
        prog="python -m mf.train.exports.example_folder",
        description="Write a small random Llama folder with a BPE tokenizer (no download).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("folder")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = make_llama_folder(
        Path(args.folder),
        hidden=args.hidden,
        layers=args.layers,
        heads=max(1, args.hidden // 32),
        kv_heads=max(1, args.hidden // 64),
        intermediate=4 * args.hidden,
        positions=args.positions,
        vocab_size=args.vocab_size,
        corpus_chars=None,
        seed=args.seed,
    )
    print(f"wrote {folder}: {sorted(p.name for p in folder.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny model folders whose tokenizers carry chat templates, and conversations to train them on.

A Llama folder from ``mf.train.exports.example_folder`` (random weights, byte-level
BPE on a few KB of the built-in corpus) whose tokenizer gains the special tokens
of a chat format and a template of ours in that format: ChatML as Qwen's models
write it (a default system turn, ``<|im_start|>role\\n...<|im_end|>\\n``), or the
headers of Llama 3 (``<|begin_of_text|>``, ``<|start_header_id|>role<|end_header_id|>``,
contents trimmed, ``<|eot_id|>``). Neither marks its answers with ``{% generation %}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mf.train.exports.example_folder import make_llama_folder, save_tokenizer

__all__ = ["CHATML", "LLAMA3", "chat_folder", "random_conversations"]

CHATML = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) "
    "+ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
_SPECIAL = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
}


def chat_folder(folder: Path, style: str, template: bool = True, **model: int) -> Path:
    """A tiny Llama folder whose tokenizer speaks ``style`` ("chatml", "llama3").

    Its special tokens are added; the template only if ``template``. The end-of-turn
    token is the tokenizer's EOS, as in instruction-tuned folders.
    """
    from transformers import AutoTokenizer

    make_llama_folder(folder, vocab_size=320, **model)
    save_tokenizer(folder, 300, 20_000)  # room in the embedding for the special tokens
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text, special, end = _SPECIAL[style]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.eos_token = end
    if template:
        tokenizer.chat_template = text
    tokenizer.save_pretrained(folder)
    return folder


def random_conversations(path: Path, count: int) -> Path:
    """Write ``count`` conversations: a system turn, then one or two exchanges of random
    letters and lengths (so rows, ranks and micro-batches hold unequal answer counts)."""
    draw = random.Random(3)

    def words(most: int) -> str:
        return "".join(draw.choice("abcdefgh ") for _ in range(draw.randint(1, most))).strip()

    lines = []
    for _ in range(count):
        turns = [{"role": "system", "content": "S"}]
        for _ in range(draw.randint(1, 2)):
            turns += [{"role": "user", "content": words(12) or "q"}]
            turns += [{"role": "assistant", "content": words(10) or "a"}]
        lines.append(json.dumps({"messages": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path

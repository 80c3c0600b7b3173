"""An exported folder that answers through its chat template and stops at the end of its turn.

A chat-tuned model learns to write the template's end-of-turn token after each
answer (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3: the loss counts it,
``mf.train.data.answer_masks``). Many folders' configs name another EOS
(``<|endoftext|>``, ``<|end_of_text|>``), so ``generate`` would write past the
answer into a made-up next turn. The export therefore keeps the template the run
rendered with (the folder's own or ``--chat-template FILE``) in the tokenizer it
saves, and writes a generation config whose ``eos_token_id`` lists the
end-of-turn token beside the EOS ids the folder already stops at.

The end-of-turn token is read off the template itself: rendered with an answer,
the token it writes right after the answer's text, when that is a special
(added) token; a template that ends turns in plain text (a newline) names none,
and the EOS ids stay as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mf.train.data.chat_template import read_chat_template

__all__ = ["end_of_turn_ids", "export_tokenizer", "stop_ids", "with_end_of_turn"]

_ANSWER = "mfanswermark"
"""The answer's text in the rendering the end-of-turn token is read from."""


def export_tokenizer(folder_path: Path, chat_template: str | None) -> Any:
    """The folder's tokenizer as the run used it: with ``--chat-template FILE``'s template.

    Raises:
        ValueError: the template file cannot be read (one line).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder_path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The token the chat template writes right after an answer, if a special one; else [].

    [] also for a tokenizer without a template or one that cannot render a
    user turn and an answer.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # the template's own raise_exception, a Jinja error, ...
        return []
    if not isinstance(text, str) or _ANSWER not in text:
        return []
    after = text[text.rindex(_ANSWER) + len(_ANSWER) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [int(ids[0])] if ids and ids[0] in special else []


def stop_ids(generation_config: Any) -> list[int]:
    """A generation config's ``eos_token_id`` as a list (it may be one id, a list or None)."""
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def with_end_of_turn(lm: Any, folder_path: Path, tokenizer: Any) -> None:
    """Give ``lm`` the folder's generation config, stopping at the end of turn too.

    The folder's ``generation_config.json`` where it has one (its sampling
    settings kept), else the one transformers derives from its config; its EOS
    ids, then the template's end-of-turn token and the tokenizer's EOS, each once.
    """
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(folder_path, local_files_only=True)
    except OSError:  # no generation_config.json
        config = GenerationConfig.from_model_config(lm.config)
    wanted = [*stop_ids(config), *end_of_turn_ids(tokenizer), tokenizer.eos_token_id]
    eos = list(dict.fromkeys(t for t in wanted if t is not None))
    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    lm.generation_config = config

r"""An example's tokens and which of them are answers, the tokens the loss counts.

A conversation is rendered by the model folder's chat template
(``apply_chat_template``). Most templates (Qwen's, Llama 3's) mark no answer
(no ``{% generation %}``), so the answers are found from the template's own
renderings of the conversation's beginnings: an answer spanning messages
``[a, b)`` is the tokens that the rendering of ``messages[:b]`` adds after the
rendering of ``messages[:a]`` with the generation prompt (``<|im_start|>assistant\n``
for ChatML). So it holds the answer's content and the template's end of turn
(``<|im_end|>`` and what the template writes after it; ``<|eot_id|>``),
the tokens the model must learn to write after the generation prompt. Each
rendering must begin the next one token for token, else the example is refused.

A standard prompt-completion pair is the prompt's tokens, then the completion's
and the EOS token, the answer (no special tokens added, as for text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mf.train.data.formats import Conversation, PromptCompletion

__all__ = ["answer_mask", "conversation_answers"]


def _render(
    tokenizer: Any, messages: Sequence[dict[str, str]], generation: bool, where: str
) -> list[int]:
    """The template's tokens of ``messages``; one ValueError when the template refuses them."""
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=generation, return_dict=False
        )
    except Exception as error:  # the template's own raise_exception, a Jinja error, ...
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{where}: the chat template cannot render it ({first})") from None
    return [int(t) for t in ids]


def conversation_answers(tokenizer: Any, example: Conversation) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and, per token, whether it belongs to an answer.

    Raises:
        ValueError: one line naming the example: the template cannot render it, or
            renders a beginning of it otherwise than inside the whole.
    """
    messages = example.messages
    tokens = _render(tokenizer, messages, False, example.where)
    mask = [False] * len(tokens)
    for start, end in example.answers:
        prompt = _render(tokenizer, messages[:start], True, example.where)
        through = (
            tokens
            if end == len(messages)
            else _render(tokenizer, messages[:end], False, example.where)
        )
        if through[: len(prompt)] != prompt or tokens[: len(through)] != through:
            raise ValueError(
                f"{example.where}: the chat template renders messages[:{end}] otherwise than "
                "as the beginning of the whole conversation, so its answer cannot be told "
                "from the prompt"
            )
        mask[len(prompt) : len(through)] = [True] * (len(through) - len(prompt))
    return tokens, mask


def answer_mask(
    tokenizer: Any, example: Conversation | PromptCompletion
) -> tuple[list[int], list[bool]]:
    """An example's tokens and its answer mask (see the module docstring)."""
    if isinstance(example, Conversation):
        return conversation_answers(tokenizer, example)
    prompt = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
    completion = [*tokenizer(example.completion, add_special_tokens=False)["input_ids"]]
    completion.append(tokenizer.eos_token_id)
    return [*prompt, *completion], [False] * len(prompt) + [True] * len(completion)

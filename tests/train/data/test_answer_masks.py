"""The answer masks equal the assistant spans exactly, for random multi-turn conversations.

Two templates of ours without ``{% generation %}`` markers (``chat_folders``):
ChatML as Qwen writes it and Llama 3's headers. The expected spans come from
the rendered text, independently of the prefix renderings the masks come from:
each assistant turn's content and the template's end of turn (``<|im_end|>\\n``;
``<|eot_id|>`` after the trimmed content), in order, and nothing else counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mf.train.data.answer_masks import answer_mask
from mf.train.data.formats import Conversation, PromptCompletion

_END = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>"}
_words = st.lists(st.text(alphabet="abcdefgh XYZ.,?", min_size=1, max_size=8), min_size=1)
_content = _words.map(lambda words: " ".join(words).strip() or "ok")
_roles = (
    st.lists(st.sampled_from(["user", "assistant"]), min_size=1, max_size=6)
    .filter(lambda roles: "assistant" in roles)
    .map(lambda roles: ["user", *roles])
)


@st.composite
def _conversations(draw: Any) -> list[dict[str, str]]:
    roles = draw(_roles)
    if draw(st.booleans()):
        roles = ["system", *roles]
    return [{"role": role, "content": draw(_content)} for role in roles]


def _runs(tokenizer: Any, tokens: list[int], mask: list[bool]) -> list[str]:
    """The masked tokens' contiguous runs, decoded."""
    runs: list[list[int]] = []
    for i, (token, counted) in enumerate(zip(tokens, mask, strict=True)):
        if counted:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return [tokenizer.decode(run) for run in runs]


@pytest.fixture(scope="module")
def tokenizers(chatml: Path, llama3: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {
        "chatml": AutoTokenizer.from_pretrained(chatml),
        "llama3": AutoTokenizer.from_pretrained(llama3),
    }


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_masks_are_the_assistant_turns_exactly(tokenizers: dict[str, Any], style: str) -> None:
    tokenizer = tokenizers[style]

    @settings(max_examples=40)
    @given(_conversations())
    def check(messages: list[dict[str, str]]) -> None:
        answers = tuple((i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant")
        tokens, mask = answer_mask(tokenizer, Conversation("x", tuple(messages), answers))
        whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert tokens == list(whole)
        expected = [m["content"] + _END[style] for m in messages if m["role"] == "assistant"]
        assert _runs(tokenizer, tokens, mask) == expected

    check()


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_a_conversational_completion_is_counted_whole(
    tokenizers: dict[str, Any], style: str
) -> None:
    tokenizer = tokenizers[style]
    prompt = ({"role": "user", "content": "Name two colours"},)
    completion = ({"role": "assistant", "content": "red and blue"},)
    example = Conversation("x", prompt + completion, ((1, 2),))
    tokens, mask = answer_mask(tokenizer, example)
    assert _runs(tokenizer, tokens, mask) == ["red and blue" + _END[style]]
    prompt_part = tokenizer.apply_chat_template(
        list(prompt), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tokens[: len(prompt_part)] == list(prompt_part)
    assert not any(mask[: len(prompt_part)])


def test_a_standard_completion_is_counted_with_its_eos(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["chatml"]
    tokens, mask = answer_mask(tokenizer, PromptCompletion("x", "The sky is", " blue"))
    assert tokenizer.decode(tokens) == "The sky is blue" + tokenizer.eos_token
    assert _runs(tokenizer, tokens, mask) == [" blue" + tokenizer.eos_token]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizers: dict[str, Any]) -> None:
    """A template whose rendering of a beginning is not the beginning of the whole's."""
    tokenizer = tokenizers["chatml"]
    saved = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last %}{{ 'LAST ' }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    try:
        messages = (
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        )
        with pytest.raises(ValueError, match="line 3: the chat template renders messages"):
            answer_mask(tokenizer, Conversation("--data 'f' line 3", messages, ((1, 2),)))
    finally:
        tokenizer.chat_template = saved

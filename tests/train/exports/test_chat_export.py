"""A chat-tuned export answers through its template and stops at the end of its turn.

The end-of-turn token is read off the template (ChatML's ``<|im_end|>``, Llama 3's
``<|eot_id|>``; none for a template that ends turns with a newline). A tiny folder
without a template (its tokenizer has ChatML's tokens, its config's EOS is
``<eos>``) is chat-tuned with ``--chat-template FILE`` on random questions that
all have one answer; the export keeps the template, its generation config stops
at ``<|im_end|>`` as well as ``<eos>``, and transformers' ``generate`` after
``apply_chat_template(add_generation_prompt=True)`` writes the answer and stops.
``mf-sample --chat`` prints the answer alone.

Planted: the export without the end-of-turn token in ``eos_token_id`` generates
past the answer (the test's ``max_new_tokens``); the tokenizer saved without the
run's ``--chat-template`` has no template to render the question.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from mf.train.exports.chat_export import end_of_turn_ids
from mf.train.exports.sample import main as sample_main
from mf.train.run.options import parse_options
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.train.data.chat_folders import CHATML
from tests.train.exports.chat_data import ANSWER, fixed_answer_chats

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers")

NEWLINE_TURNS = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def test_end_of_turn_token_is_read_off_the_template(
    chatml: Path, llama3: Path, untemplated: Path
) -> None:
    from transformers import AutoTokenizer

    for folder, token in ((chatml, "<|im_end|>"), (llama3, "<|eot_id|>")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(token)], folder
    plain = AutoTokenizer.from_pretrained(untemplated)
    assert end_of_turn_ids(plain) == []  # no template
    plain.chat_template = NEWLINE_TURNS
    assert end_of_turn_ids(plain) == []  # turns end in plain text: no token to stop at


def _rank_train(rank: int, world: int, argv: list[str]) -> None:
    from mf.train.rank.worker import train

    train(parse_options(argv))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_chat_tuned_export_answers_through_its_template_and_stops(
    untemplated: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    data = fixed_answer_chats(tmp_path / "chat.jsonl", 64)
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "8"]
    argv += ["--steps", "24", "--lr", "2e-2", "--eval-every", "24", "--sample-tokens", "0"]
    argv += ["--no-plot", "--save-every", "0", "--nproc", "1", "--model", str(untemplated)]
    argv += ["--data", str(data), "--chat-template", str(template), "--out-dir", str(out)]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt")]
    run_on_ranks(_rank_train, 1, argv, timeout=200)

    exported = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tokenizer.chat_template == CHATML
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    question = [{"role": "user", "content": "ponmlkji"}]
    inputs = tokenizer.apply_chat_template(
        question, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out_tokens = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = out_tokens[0, inputs["input_ids"].shape[1] :].tolist()
    assert answer[-1] == end, tokenizer.decode(answer)  # stopped at the end of turn
    assert tokenizer.decode(answer[:-1]) == ANSWER
    assert model.config.eos_token_id == 0  # the folder's <eos>, not the end of turn
    assert set(model.generation_config.eos_token_id) == {0, end}

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = sample_main([str(out), "--chat", "abcdefgh", "--temperature", "0.05"])
    assert code == 0
    assert printed.getvalue() == ANSWER + "\n"


def test_sample_chat_refuses_what_has_no_template(untemplated: Path, capsys) -> None:
    assert sample_main([str(untemplated), "--chat", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("mf-sample: error: --chat: the folder")
    assert "has no chat template" in err[0]

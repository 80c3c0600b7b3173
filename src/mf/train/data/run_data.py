"""The data a run trains on, picked by ``--model`` and the shape of ``--data``.

A preset trains on bytes (``mf.train.data.text``); a model folder on its
tokenizer's tokens: text packed into sequences (``mf.train.data.tokenized``), or
conversations and prompt-completion pairs packed apart (or one per sequence under
``--no-pack``), the loss on the answers (``mf.train.data.examples``). The corpus is
named with its shape, how full its sequences are and what the loss counts, for
the run's first lines.
"""

from __future__ import annotations

from mf.train.data.chat_template import use_chat_template
from mf.train.data.documents import read_data
from mf.train.data.examples import ExampleData
from mf.train.data.formats import TEXT
from mf.train.data.text import BUILTIN_CORPUS, TextData, builtin_documents, load_corpus
from mf.train.data.tokenized import TokenData, load_tokenizer
from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import folder_of

__all__ = ["RunData", "training_data"]

RunData = TextData | TokenData | ExampleData
"""What a run's steps draw their batches from."""


def training_data(options: TrainOptions) -> tuple[RunData, str]:
    """The run's data and how to name its corpus.

    Raises:
        ValueError: one line (a bad file or line, a missing tokenizer or chat
            template, a short corpus, an example longer than ``--seq-len``).
    """
    folder = folder_of(options.model)
    if folder is None:
        text, name = load_corpus(options.data, options.text_field)
        return TextData.from_text(text, options.seq_len), name
    data = None if options.data is None else read_data(options.data, options.text_field)
    if options.no_pack and (data is None or data.shape == TEXT):
        raise ValueError(
            "--no-pack is for messages or prompt-completion --data; text is cut into "
            "--seq-len sequences, not padded"
        )
    if options.cp > 1 and not options.no_pack and data is not None and data.shape != TEXT:
        raise ValueError(
            f"--cp {options.cp} does not serve packed examples ({data.shape} --data); "
            "pass --no-pack to pad one example per sequence"
        )
    tokenizer = load_tokenizer(folder)
    if options.data is None or data is None:
        documents = builtin_documents()
        return TokenData.from_documents(documents, tokenizer, options.seq_len), BUILTIN_CORPUS
    if data.shape == TEXT:
        name = f"{options.data} (text)"
        return TokenData.from_documents(data.examples, tokenizer, options.seq_len), name
    if data.conversational:
        use_chat_template(tokenizer, options.chat_template, options.data, data.shape)
    if len(data.examples) < 2:
        raise ValueError(
            f"--data {options.data!r} holds one example; expected two or more (the last "
            "10%, at least one, are held out for validation)"
        )
    examples = ExampleData.from_file(
        data, tokenizer, options.seq_len, options.train_on_prompt, not options.no_pack
    )
    counted = (
        "every token (--train-on-prompt)"
        if options.train_on_prompt
        else f"the answers' {examples.counted_tokens():,} tokens"
    )
    trained = len(examples.rows) - examples.held_out
    layout = (
        "one per sequence (--no-pack)"
        if options.no_pack
        else f"packed into {trained} sequence{'s' * (trained != 1)}"
    )
    real = f"{examples.real_fraction():.1%} real tokens"
    name = f"{options.data} ({data.shape}, {len(data.examples)} examples {layout}, {real}; "
    name += f"loss on {counted})"
    return examples, name

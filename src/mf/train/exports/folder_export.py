"""A fine-tuned model folder back to the ecosystem: a transformers folder, and sampling it.

A finished ``mf-train --model PATH`` run writes ``<out-dir>/model/``: the config
(fp32, as mf's main weights), ``model.safetensors`` from the run's last
checkpoint, and the tokenizer with the chat template the run rendered with,
through transformers' own ``save_pretrained``, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load it anywhere; its generation config stops at the template's end of turn
(``chat_export``). ``load_folder_for_sampling`` is ``mf-sample``'s way in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mf.train.exports.chat_export import export_tokenizer, with_end_of_turn
from mf.train.sources.model_folder import CONFIG_FILE, PREFIX, CausalLM, ModelFolder, meta_causal_lm

__all__ = ["EXPORT_FOLDER", "export_folder", "load_folder_for_sampling"]

EXPORT_FOLDER = "model"
"""The transformers folder a finished run writes under its ``--out-dir``."""


def export_folder(
    checkpoint: Path, out_dir: Path, folder: ModelFolder, chat_template: str | None = None
) -> Path:
    """Write the checkpoint's full model as a transformers folder ``out_dir/model``.

    ``chat_template``: the run's ``--chat-template FILE``, kept in the saved
    tokenizer. Runs on one process (it reads the checkpoint offline, verifying
    it). Returns the folder.

    Raises:
        ValueError: the checkpoint's weights are not the model's (one line).
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    state = fsdp_checkpoint.checkpoint_to_full_state_dict(checkpoint)
    lm = meta_causal_lm(folder).lm
    weights = {k.removeprefix(PREFIX): v for k, v in state.items()}
    missing, unexpected = lm.load_state_dict(weights, strict=False, assign=True)
    tied = {name for name, p in lm.named_parameters(remove_duplicate=False) if p.is_meta}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"{checkpoint}: its weights are not the {folder.name}'s (missing "
            f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    lm.tie_weights()  # type: ignore[operator]
    target = out_dir / EXPORT_FOLDER
    tokenizer = export_tokenizer(folder.path, chat_template)
    with_end_of_turn(lm, folder.path, tokenizer)
    lm.save_pretrained(target)  # type: ignore[operator]
    tokenizer.save_pretrained(target)
    return target


class FolderCodec:
    """A transformers tokenizer as ``mf-sample`` uses it: text to tokens and back."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as token ids (no special tokens added)."""
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """Token ids back to text."""
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        return self.tokenizer.decode(values)


def load_folder_for_sampling(path: Path) -> tuple[CausalLM, FolderCodec, int] | None:
    """A transformers folder (``path`` itself or ``path/model``) as (model, tokenizer, positions).

    None when ``path`` holds no transformers folder.

    Raises:
        ValueError: the folder cannot be loaded (one line).
    """
    from mf.train.data.tokenized import load_tokenizer
    from mf.train.sources.model_folder import model_folder

    for candidate in (path, path / EXPORT_FOLDER):
        if (candidate / CONFIG_FILE).is_file():
            break
    else:
        return None
    from transformers import AutoModelForCausalLM

    folder = model_folder(str(candidate))
    tokenizer = load_tokenizer(folder)
    lm = AutoModelForCausalLM.from_pretrained(candidate, local_files_only=True, dtype=torch.float32)
    return CausalLM(lm), FolderCodec(tokenizer), folder.positions

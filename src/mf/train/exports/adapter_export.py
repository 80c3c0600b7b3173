"""A LoRA run back to the ecosystem: peft's adapter folder, and with ``--merge`` the merged model.

A finished ``mf-train --model PATH --lora-rank R`` run writes ``<out-dir>/adapter/``
in peft's format: ``adapter_model.safetensors`` (the adapters of the run's last
checkpoint, under the keys ``PeftModel.save_pretrained`` writes:
``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json`` (the
run's ``LoraConfig``, its base the folder), so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)``
loads it. With ``--merge`` it also writes ``<out-dir>/model/``: the base with the
adapter merged by peft's ``merge_and_unload``, a plain transformers folder with
the tokenizer and the chat template the run rendered with, its generation config
stopping at the template's end of turn (``chat_export``). A QLoRA run
(``--base-dtype nf4``) merges into its NF4 bases, dequantized: the weights it
was trained against.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mf.train.adapters.lora import ADAPTER_MARK, lora_config
from mf.train.exports.chat_export import export_tokenizer, with_end_of_turn
from mf.train.exports.folder_export import EXPORT_FOLDER
from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import PREFIX, ModelFolder

__all__ = ["ADAPTER_FOLDER", "export_adapter", "merge_adapter", "peft_adapter_state"]

ADAPTER_FOLDER = "adapter"
"""The peft adapter folder a finished LoRA run writes under its ``--out-dir``."""

ADAPTER_NAME = "default"
"""The adapter name peft gives the one adapter mf-train trains (dropped from the saved keys)."""


def peft_adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of an mf-train model's full state dict, under peft's saved keys."""
    return {
        "base_model.model."
        + key.removeprefix(PREFIX).replace(f".{ADAPTER_NAME}.", "."): value.contiguous()
        for key, value in state.items()
        if ADAPTER_MARK in key
    }


def export_adapter(
    checkpoint: Path, out_dir: Path, folder: ModelFolder, options: TrainOptions
) -> Path:
    """Write the checkpoint's adapters as peft's folder ``out_dir/adapter`` (and ``--merge``'s).

    With ``--merge`` also the merged model as ``out_dir/model``. Runs on one
    process. Returns the adapter folder.

    Raises:
        ValueError: the checkpoint holds no adapter (one line).
    """
    from safetensors.torch import save_file

    from mf_fsdp import checkpoint as fsdp_checkpoint

    adapters = peft_adapter_state(fsdp_checkpoint.checkpoint_to_full_state_dict(checkpoint))
    if not adapters:
        raise ValueError(f"{checkpoint}: holds no LoRA adapter (no {ADAPTER_MARK}* weight)")
    target = out_dir / ADAPTER_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    save_file(adapters, target / "adapter_model.safetensors", metadata={"format": "pt"})
    config = lora_config(options)
    config.base_model_name_or_path = str(folder.path.resolve())
    config.save_pretrained(target)
    if options.merge:
        merge_adapter(
            folder,
            target,
            out_dir / EXPORT_FOLDER,
            nf4=options.base_dtype == "nf4",
            chat_template=options.chat_template,
        )
    return target


def merge_adapter(
    folder: ModelFolder,
    adapter: Path,
    target: Path,
    nf4: bool = False,
    chat_template: str | None = None,
) -> Path:
    """The folder's model with ``adapter`` merged (peft's ``merge_and_unload``), at ``target``.

    ``nf4`` (a QLoRA run): merged into the bases the adapter was trained on, the
    folder's weights of its targets quantized to NF4 and dequantized
    (``mf.train.sources.nf4_bases.dequantize_targets``). Saved with the folder's
    tokenizer (with ``chat_template``, the run's ``--chat-template FILE``). Returns
    ``target``.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        folder.path, local_files_only=True, dtype=torch.float32
    )
    if nf4:
        from peft import LoraConfig

        from mf.train.sources.nf4_bases import dequantize_targets

        dequantize_targets(base, list(LoraConfig.from_pretrained(str(adapter)).target_modules))
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    tokenizer = export_tokenizer(folder.path, chat_template)
    with_end_of_turn(merged, folder.path, tokenizer)
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target

"""Which checkpoint ``--resume`` continues from, and whether this run may continue from it.

Two stages, both before any worker starts:

- ``check_resume_settings`` (called by ``parse_options``, so on every rank too):
  the record is a readable JSON object, the step leaves steps to train, the
  model and optimizer recipe are this run's, and the ``RESULT_SETTINGS`` match
  (or ``--allow-changed-settings``). It reads the record only.
- ``verify_resume`` (the ``mf-train`` launcher, or every rank under torchrun):
  everything a load would refuse, without loading (``mf_fsdp.verify_checkpoint``):
  the record's schema, every checksum, the metadata through the safe reader,
  every tensor read once, and the model's names and shapes and the optimizers'
  classes against this run's, built on the meta device.

A refusal is one ``ValueError`` starting ``--resume:`` that names the folder and
the file. A damaged or foreign checkpoint is never replaced silently by an older
one: the message names the newest checkpoint beside it that passes, which the
user may choose with ``--resume-from``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING

import torch

from mf.models import build_optimizers
from mf.train.sources.model_folder import meta_module

if TYPE_CHECKING:
    from mf.train.settings import TrainOptions

__all__ = [
    "RESULT_SETTINGS",
    "check_resume_settings",
    "resume_checkpoint",
    "verify_resume",
]

RESULT_SETTINGS = (
    "seed",
    "data",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "lr",
    "precision",
    "layer_drop",
    "lora_alpha",
    "chat_template",
    "train_on_prompt",
    "no_pack",
    "max_grad_norm",
)
"""Options that decide a run's batches or results: saved with every checkpoint, and a
``--resume`` must repeat them (or pass ``--allow-changed-settings``)."""

_SAME_RUN_SETTINGS = ("model", "optimizer", "lora_rank", "lora_targets", "base_dtype")
"""Saved options a resume can never change: they decide what the checkpoint holds."""

_STEP_FOLDER = re.compile(r"step_(\d+)")


def resume_checkpoint(options: TrainOptions) -> Path:
    """The checkpoint folder a ``--resume`` run continues from.

    ``--resume-from``'s folder when given, else the newest complete checkpoint
    of ``--ckpt-dir``.

    Raises:
        ValueError: there is none.
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    if options.resume_from is not None:
        path = Path(options.resume_from)
        if not path.is_dir() or not (path / fsdp_checkpoint.RECORD_FILE).exists():
            raise ValueError(
                f"--resume-from: {options.resume_from!r} is not a complete checkpoint (a "
                f"step_N folder holding {fsdp_checkpoint.RECORD_FILE})"
            )
        return path
    latest = (
        fsdp_checkpoint.latest_checkpoint(options.ckpt_dir)
        if os.path.isdir(options.ckpt_dir)
        else None
    )
    if latest is None:
        raise ValueError(f"--resume: no complete checkpoint in {options.ckpt_dir!r}")
    return latest


def _read_record(file: Path) -> dict:
    """The checkpoint record ``file`` as a dict, or one ValueError naming the file."""
    try:
        record = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--resume: {str(file)!r} is damaged: not JSON ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("extra", {}), dict):
        raise ValueError(
            f"--resume: {str(file)!r} is damaged: expected a JSON object with an object "
            "'extra' (an mf checkpoint record)"
        )
    return record


def _changed_settings(saved: dict, options: TrainOptions) -> list[str]:
    """``--name saved (now value)`` for every result setting this run changes."""
    return [
        f"--{name.replace('_', '-')} {saved[name]} (now {getattr(options, name)})"
        for name in RESULT_SETTINGS
        if name in saved and saved[name] != getattr(options, name)
    ]


def check_resume_settings(options: TrainOptions) -> None:
    """Refuse --resume without a checkpoint, one of another run's kind, or nothing to do.

    ``--zero``, ``--nproc``, ``--dp-outer`` and ``--tp`` may change (checkpoints
    hold parameter-shaped, tp-gathered tensors and reshard); the model and the
    optimizer recipe may not, and the ``RESULT_SETTINGS`` only with
    ``--allow-changed-settings``. A checkpoint at or past ``--steps`` would leave
    no step to train. Reads the record only (see ``verify_resume`` for the rest).

    Raises:
        ValueError: one line starting ``--resume:``.
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    path = resume_checkpoint(options)
    try:
        record = _read_record(path / fsdp_checkpoint.RECORD_FILE)
    except ValueError as error:
        raise ValueError(f"{error}; {_newest_intact(options, path)}") from None
    step = record.get("step")
    if isinstance(step, int) and step >= options.steps:
        raise ValueError(
            f"--resume: {str(path)!r} is at step {step} and --steps is {options.steps}; "
            f"expected --steps above {step} to train further"
        )
    saved = record.get("extra", {})
    for name in _SAME_RUN_SETTINGS:
        if name in saved and saved[name] != getattr(options, name):
            flag = name.replace("_", "-")
            raise ValueError(
                f"--resume: {str(path)!r} was saved with --{flag} {saved[name]}, this run has "
                f"--{flag} {getattr(options, name)}; expected the same --{flag}"
            )
    changed = _changed_settings(saved, options)
    if changed and not options.allow_changed_settings:
        raise ValueError(
            f"--resume: {str(path)!r} was saved with {', '.join(changed)}: the run would go "
            "on with other batches or results than the saved one's; repeat the saved "
            "settings, or pass --allow-changed-settings to change them knowingly"
        )


def _verify(path: Path, options: TrainOptions) -> None:
    """``mf_fsdp.verify_checkpoint`` against this run's model and optimizers (meta device)."""
    from mf.train.sources.model_folder import folder_of
    from mf_fsdp import checkpoint as fsdp_checkpoint

    folder = folder_of(options.model)
    module: torch.nn.Module
    if folder is not None:  # as the run builds it: LoRA's adapters, NF4 bases left out
        from mf.train.adapters.run_module import folder_module

        module, optimizers = folder_module(options, folder, torch.device("cpu"))
    else:
        module = meta_module(options.model)
        optimizers = build_optimizers(options.optimizer, module, options.lr)
    fsdp_checkpoint.verify_checkpoint(path, module, optimizers)


def _complete_checkpoints(folder: Path) -> list[Path]:
    """The ``step_N`` folders of ``folder`` that hold a record, newest first."""
    from mf_fsdp import checkpoint as fsdp_checkpoint

    if not folder.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in folder.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name))
        and (path / fsdp_checkpoint.RECORD_FILE).is_file()
    ]
    return [path for _, path in sorted(found, reverse=True)]


def _newest_intact(options: TrainOptions, refused: Path) -> str:
    """The end of a refusal: the newest other checkpoint beside ``refused`` that passes.

    Each candidate is verified as ``verify_resume`` would; the first that passes is
    named with the option that chooses it, never taken silently.
    """
    others = [p for p in _complete_checkpoints(refused.parent) if p.resolve() != refused.resolve()]
    for path in others:
        try:
            _verify(path, options)
        except ValueError:
            continue
        return f"the newest intact checkpoint is {str(path)!r} (--resume-from {quote(str(path))})"
    where = repr(str(refused.parent))
    return f"no other checkpoint in {where} is intact" if others else f"none other is in {where}"


def verify_resume(options: TrainOptions) -> None:
    """Check the checkpoint --resume continues from as a load would, loading nothing.

    Raises:
        ValueError: one line starting ``--resume:`` naming the folder and the file
            at fault, and the newest intact checkpoint beside it.
    """
    path = resume_checkpoint(options)
    try:
        _verify(path, options)
    except ValueError as error:
        cause = str(error).removeprefix("fsdp_checkpoint.verify_checkpoint: ")
        raise ValueError(f"--resume: {cause}; {_newest_intact(options, path)}") from None

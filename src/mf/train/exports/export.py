"""The trained model outside mf: a safetensors export with its config, loading it, sampling.

Every finished ``mf-train`` run writes ``<out-dir>/model.safetensors`` (the
full, tp-gathered weights) and ``<out-dir>/model.json`` (the preset and its
``GPTConfig``): whatever ``--tp``, ``--ep``, ``--zero`` or world size trained
it, the export loads into a plain ``mf.models.GPT`` (``MoEGPT`` with every
expert, for a mixture of experts) with ``strict=True`` on one process.
``load_model`` reads that export, or a checkpoint folder, for ``mf-sample``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection
from pathlib import Path

import torch

from mf.models import GPT, MODEL_PRESETS, config_from_dict, plain_model

__all__ = ["CONFIG_FILE", "EXPORT_FILE", "export_model", "load_model", "sample_text"]

EXPORT_FILE = "model.safetensors"
CONFIG_FILE = "model.json"


def export_model(checkpoint: Path, out_dir: Path, preset: str) -> Path:
    """Write the checkpoint's full model as ``out_dir/model.safetensors`` plus its config.

    Runs on one process (it reads the checkpoint offline, verifying it).
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    state = fsdp_checkpoint.checkpoint_to_full_state_dict(checkpoint)
    path = out_dir / EXPORT_FILE
    fsdp_checkpoint.save_full_state_dict(state, path)
    config = {"preset": preset, "config": dataclasses.asdict(MODEL_PRESETS[preset])}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return path


def _from_export(folder: Path) -> GPT:
    from safetensors.torch import load_file

    try:
        config = config_from_dict(json.loads((folder / CONFIG_FILE).read_text())["config"])
        with torch.device("meta"):  # shapes only: nothing is allocated yet
            expected = {k: tuple(v.shape) for k, v in plain_model(config).state_dict().items()}
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise ValueError(
            f"{folder / CONFIG_FILE}: not an mf-train model config ({error})"
        ) from None
    _check_export_shapes(folder, expected)
    model = plain_model(config)
    model.load_state_dict(load_file(folder / EXPORT_FILE), strict=True)
    return model


def _check_export_shapes(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a config whose model is not the export's, before allocating it.

    ``model.json`` decides what is allocated; a damaged or hostile one (64 layers
    of width 65536) would otherwise ask for terabytes before any weight is read.
    The export's header (read alone) names every tensor and its shape: the model
    must be exactly those, so what is allocated is what the file holds.
    """
    from safetensors import safe_open

    try:
        with safe_open(folder / EXPORT_FILE, "pt") as export:
            found = {k: tuple(export.get_slice(k).get_shape()) for k in export.keys()}  # noqa: SIM118
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise ValueError(f"{folder / EXPORT_FILE}: not a safetensors export ({error})") from None
    if found == expected:
        return
    numel = sum(math.prod(shape) for shape in expected.values())
    differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    name = differ[0]
    raise ValueError(
        f"{folder / CONFIG_FILE} describes a model of {numel:,} parameters whose weights do "
        f"not match {EXPORT_FILE} ({len(differ)} tensors differ; first {name!r}: the config "
        f"says {expected.get(name)}, the export holds {found.get(name)}); refusing to build it"
    )


def _from_checkpoint(checkpoint: Path) -> GPT:
    from mf_fsdp import checkpoint as fsdp_checkpoint

    if not (checkpoint / fsdp_checkpoint.RECORD_FILE).is_file():
        newest = fsdp_checkpoint.latest_checkpoint(checkpoint)
        if newest is None:
            raise ValueError(
                f"{str(checkpoint)!r} holds no {EXPORT_FILE} and no complete checkpoint; "
                "expected an mf-train --out-dir, --ckpt-dir or checkpoint folder"
            )
        checkpoint = newest
    preset = (
        json.loads((checkpoint / fsdp_checkpoint.RECORD_FILE).read_text())
        .get("extra", {})
        .get("model")
    )
    if preset not in MODEL_PRESETS:
        raise ValueError(f"{checkpoint}: the checkpoint names no known --model ({preset!r})")
    model = plain_model(MODEL_PRESETS[preset])
    model.load_state_dict(fsdp_checkpoint.checkpoint_to_full_state_dict(checkpoint), strict=True)
    return model


def load_model(path: str | Path) -> GPT:
    """A plain model from an mf-train export folder, a checkpoint folder or a --ckpt-dir.

    A GPT, or a MoE GPT with every expert on this process.

    Raises:
        ValueError: if ``path`` holds none of those (one line naming it).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder; expected an mf-train --out-dir")
    if (folder / EXPORT_FILE).is_file():
        return _from_export(folder)
    if (folder / "checkpoints").is_dir():  # an --out-dir whose run did not finish
        return _from_checkpoint(folder / "checkpoints")
    return _from_checkpoint(folder)


@torch.no_grad()
def sample_text(
    model: torch.nn.Module,
    prompt_tokens: torch.Tensor,
    tokens: int,
    seq_len: int,
    seed: int,
    temperature: float = 0.8,
    stop: Collection[int] = (),
) -> torch.Tensor:
    """Extend ``prompt_tokens`` (1-D) by ``tokens`` sampled tokens; the same on every rank.

    The sampling generator is seeded and lives on the CPU, so every rank draws
    the same tokens (the model itself may be sharded: all ranks run it together).
    A token of ``stop`` (an end of turn) ends the sequence early, itself included.
    """
    generator = torch.Generator().manual_seed(seed)
    device = prompt_tokens.device
    sequence = prompt_tokens.view(1, -1)
    was_training = model.training
    model.eval()
    for _ in range(tokens):
        logits = model(sequence[:, -seq_len:])[0, -1].float().cpu() / temperature
        choice = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        sequence = torch.cat([sequence, choice.to(device).view(1, 1)], dim=1)
        if int(choice) in stop:
            break
    model.train(was_training)
    return sequence[0]

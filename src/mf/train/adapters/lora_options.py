"""The command-line checks of ``mf-train --lora-rank`` and ``--base-dtype nf4``.

Kept apart from ``mf.train.run.options`` so the LoRA options have one home; the
parser calls ``check_lora_options`` after its own checks, before any process
starts, so a bad value is one line and exit code 2.
"""

from __future__ import annotations

from typing import Any

from mf.train.settings import TrainOptions

__all__ = ["DEFAULT_LORA_TARGETS", "check_lora_options", "lora_alpha", "lora_targets"]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every attention and MLP projection of a Llama, Qwen or Mistral decoder layer."""


def lora_targets(options: TrainOptions) -> list[str]:
    """``--lora-targets`` as a list of module names."""
    return [name.strip() for name in options.lora_targets.split(",") if name.strip()]


def lora_alpha(options: TrainOptions) -> int:
    """``--lora-alpha``, by default twice the rank."""
    assert options.lora_rank is not None
    return options.lora_alpha if options.lora_alpha is not None else 2 * options.lora_rank


def check_lora_options(options: TrainOptions, folder: Any) -> None:
    """Refuse LoRA options that cannot be served, naming the option, value and what is expected.

    Raises:
        ValueError: a rank below 1, a non-positive alpha, no targets, NF4 bases or
            ``--merge`` without ``--lora-rank``, LoRA on a preset, a target the
            folder's model does not have, or NF4 bases whose weights do not split
            into whole NF4 blocks over the ranks (``nf4_shape_problem``).
    """
    if options.lora_rank is None:
        for flag, used in (
            ("--base-dtype nf4", options.base_dtype == "nf4"),
            ("--merge", options.merge),
        ):
            if used:
                raise ValueError(
                    f"{flag} needs --lora-rank: only LoRA's frozen bases can be NF4 or merged"
                )
        return
    if options.lora_rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {options.lora_rank}")
    if options.lora_alpha is not None and not options.lora_alpha > 0:
        raise ValueError(f"--lora-alpha must be a positive number, got {options.lora_alpha}")
    if folder is None:
        if options.base_dtype == "nf4":
            raise ValueError(
                f"--base-dtype nf4 does not apply to the preset {options.model!r}: NF4 bases "
                "are QLoRA's, for a transformers model folder (--model PATH)"
            )
        raise ValueError(
            f"--lora-rank {options.lora_rank} does not apply to the preset {options.model!r}: "
            "LoRA is for a transformers model folder (--model PATH)"
        )
    targets = lora_targets(options)
    if not targets:
        raise ValueError(f"--lora-targets {options.lora_targets!r} names no module")
    from mf.train.sources.model_folder import meta_causal_lm

    names = {name.rsplit(".", 1)[-1] for name, _ in meta_causal_lm(folder).named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(
            f"--lora-targets {options.lora_targets!r}: the {folder.name} has no module named "
            f"{missing[0]!r}; expected names of its linear projections"
        )
    if options.base_dtype == "nf4":
        _check_nf4(options, folder)


def _check_nf4(options: TrainOptions, folder: Any) -> None:
    """Refuse NF4 bases that cannot be served: each target's pieces must be whole NF4 blocks."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ValueError("--base-dtype nf4 needs torchao's NF4 tensors: install mf[float8]")
    if options.zero < 2:
        raise ValueError(
            f"--base-dtype nf4 with --zero {options.zero}: the NF4 bases are sharded and "
            "gathered as FSDP2 does; expected --zero 2 or 3"
        )
    from mf.train.sources.model_folder import meta_causal_lm
    from mf.train.sources.nf4_bases import nf4_shape_problem

    shards = options.nproc // options.dp_outer
    targets = set(lora_targets(options))
    for name, module in meta_causal_lm(folder).lm.named_modules():
        if name.rsplit(".", 1)[-1] in targets and hasattr(module, "weight"):
            problem = nf4_shape_problem(f"{name}.weight", tuple(module.weight.shape), shards)
            if problem is not None:
                raise ValueError(f"--base-dtype nf4 for the {folder.name}: {problem}")

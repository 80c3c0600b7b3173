"""Command-line options of ``mf-train`` and the checks that need no processes.

Every mistake a user can make on the command line is caught here, in the
launcher, and reported as one line, before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import NoReturn

import torch

from mf.models import MODEL_PRESETS, OPTIMIZER_RECIPES, MoEGPTConfig
from mf.models.float8 import float8_unavailable
from mf.train.adapters.lora_options import DEFAULT_LORA_TARGETS, check_lora_options
from mf.train.adapters.run_module import float8_linears
from mf.train.data.data_options import add_data_options, check_data_options
from mf.train.data.text import VOCAB_SIZE
from mf.train.reports.profiling import parse_window
from mf.train.run.resume import RESULT_SETTINGS, check_resume_settings
from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import (
    ModelFolder,
    attends_through_sdpa,
    folder_of,
    meta_causal_lm,
)

__all__ = [
    "CPU_MICRO_BATCH",
    "CUDA_MICRO_BATCH",
    "RESULT_SETTINGS",
    "TrainOptions",
    "local_cpu_cores",
    "parse_options",
]

CPU_MICRO_BATCH = 4
"""Sequences per rank per micro-batch on the CPU by default."""
CUDA_MICRO_BATCH = 16
"""On a GPU by default: with the model's full sequence length, enough work per step
that the GPU does not wait on the host for small presets."""


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _finite_float(text: str) -> float:
    """The argparse type of every float option: a number, and neither inf nor nan.

    ``float()`` accepts "inf", "nan" and "1e999"; a run with such a value would
    only fail (or train on NaN) once the workers are up, so it is refused here.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def local_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are ValueErrors (one line), not usage text and exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mf-train",
        description="Train a small GPT with mf (ZeRO-3 on 2 local processes by default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--nproc",
        type=int,
        default=None,
        help="processes on this machine (default: one per GPU on CUDA, else 2)",
    )
    add("--tp", type=int, default=1, help="tensor-parallel size")
    add(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: each sequence is split over --cp ranks, which share one "
        "data-parallel rank's --micro-batch",
    )
    add("--zero", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO strategy")
    add("--dp-outer", type=int, default=1, help="HSDP replicas (outer data-parallel size)")
    add(
        "--model",
        default="small",
        help=f"a model preset ({', '.join(sorted(MODEL_PRESETS))}; moe-*: mixtures of experts), "
        "or the path of a local transformers causal-LM folder (config.json, *.safetensors, "
        "tokenizer files), read offline",
    )
    add(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (moe-* models): each group of --ep data-parallel ranks "
        "holds the experts once between them",
    )
    add(
        "--etp",
        type=int,
        default=1,
        help="expert-tensor-parallel size (moe-* models, with --ep): each expert's FFN is "
        "split over --etp data-parallel ranks (by columns, then rows)",
    )
    add("--steps", type=int, default=600, help="optimizer steps")
    add(
        "--micro-batch",
        type=int,
        default=None,
        help=f"sequences per rank per micro-batch (default: {CPU_MICRO_BATCH} on the CPU, "
        f"{CUDA_MICRO_BATCH} on a GPU, where a small batch leaves it waiting on the host)",
    )
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add(
        "--step-in-backward",
        action="store_true",
        help="--zero 2/3: step each bucket's parameters inside the backward as soon as their "
        "gradients are reduced (mf-fsdp's optimizer_step_in_backward), so the gradients are "
        "never all held at once; the same losses; --optimizer adamw; with --max-grad-norm 0 "
        "only (no moment holds every gradient to clip), and no grad norm is reported",
    )
    add(
        "--max-grad-norm",
        type=_finite_float,
        default=1.0,
        help="clip the gradients' total 2-norm over all ranks to this once per step, after "
        "the accumulation (the norm before clipping is logged as grad_norm); 0: no clipping",
    )
    add(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: 128, or the model's positions if fewer; "
        "on a GPU the model's positions)",
    )
    add("--lr", type=_finite_float, default=1e-3, help="peak learning rate (warm-up, cosine decay)")
    add(
        "--optimizer",
        choices=OPTIMIZER_RECIPES,
        default="adamw",
        help="adamw; or muon: torch.optim.Muon on the blocks' matrices, AdamW on the rest",
    )
    add(
        "--precision",
        choices=("fp32", "bf16", "fp8"),
        default=None,
        help="compute precision (default: bf16 on a GPU that has it, with fp32 main weights; "
        "else fp32). fp8: the blocks' linears in float8 (torchao, tensorwise dynamic scaling, "
        "mf[float8]), the rest in bf16, fp32 main weights; on the CPU from torch 2.11 and on "
        "GPUs from sm_89; --tp 1 only. With --model PATH: its decoder layers' projections, "
        "full fine-tuning only",
    )
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_data_options(parser)
    add(
        "--lora-rank",
        type=int,
        default=None,
        help="--model PATH only: train rank-R LoRA adapters (peft's) on --lora-targets, the "
        "base frozen; the run writes the adapter to <out-dir>/adapter",
    )
    add("--lora-alpha", type=int, default=None, help="LoRA's alpha (default: 2 x rank)")
    add(
        "--lora-targets",
        default=",".join(DEFAULT_LORA_TARGETS),
        help="the projections (module names, comma-separated) that get adapters",
    )
    add(
        "--base-dtype",
        choices=("fp32", "nf4"),
        default="fp32",
        help="with --lora-rank: the frozen bases of --lora-targets as torchao NF4 (QLoRA)",
    )
    add(
        "--merge",
        action="store_true",
        help="with --lora-rank: also write the base with the adapter merged to <out-dir>/model",
    )
    add("--ckpt-dir", default="runs/mf-train/checkpoints", help="checkpoint folder")
    add("--save-every", type=int, default=200, help="save every N steps (0: only at the end)")
    add(
        "--sync-save",
        action="store_true",
        help="write each periodic checkpoint before training on (default: copy it to host "
        "memory and write it in the background while training goes on)",
    )
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add(
        "--resume-from",
        default=None,
        metavar="CHECKPOINT",
        help="continue from this checkpoint folder (a step_N folder; implies --resume), "
        "e.g. an older one when --resume refused the newest",
    )
    add(
        "--allow-changed-settings",
        action="store_true",
        help="with --resume: continue even where the settings in RESULT_SETTINGS (--seed, "
        "--data, --seq-len, ...) differ from the saved run's, knowingly changing its course",
    )
    add("--seed", type=int, default=0)
    add(
        "--layer-drop",
        type=_finite_float,
        default=0.0,
        metavar="P",
        help="LayerDrop: in training, each rank skips each block with probability P, drawn "
        "from --seed, the step and its data-parallel rank, so ranks skip different blocks",
    )
    add("--eval-every", type=int, default=100, help="validation every N steps")
    add("--eval-batches", type=int, default=4, help="batches per validation")
    add("--sample-tokens", type=int, default=200, help="length of the final text sample")
    add("--out-dir", default="runs/mf-train", help="metrics, loss curve, sample, model export")
    add("--no-plot", dest="plot", action="store_false", help="do not draw loss.png")
    add(
        "--tensorboard",
        action="store_true",
        help="write loss, validation loss, lr, grad norm, tokens/s, MFU and memory per step "
        "to <out-dir>/tensorboard (rank 0)",
    )
    add(
        "--profile",
        default=None,
        metavar="START:END",
        help="a torch.profiler Chrome trace of steps START to END (from 1, both included) per "
        "rank, in <out-dir>/profile/rank<R>.json",
    )
    add(
        "--peak-tflops",
        type=_finite_float,
        default=None,
        help="the device's peak TFLOP/s for MFU (default: known for H100, H200, A100; else no MFU)",
    )
    add(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all ranks this often after one fails; they resume from this run's "
        "newest checkpoint (as torchrun --max-restarts)",
    )
    add(
        "--timeout",
        type=_finite_float,
        default=300.0,
        help="seconds a rank waits for the others in a collective before the run ends",
    )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> TrainOptions:
    """Parse and check the command line.

    Raises:
        ValueError: one line naming the option, the value and what is expected.
    """
    args = _build_parser().parse_args(argv)
    options = TrainOptions(**{k.replace("-", "_"): v for k, v in vars(args).items()})
    folder = folder_of(options.model)
    if options.nproc is None:
        gpus = torch.cuda.device_count() if options.use_cuda else 0
        options = dataclasses.replace(options, nproc=gpus or 2)
    options = _hardware_defaults(options, folder)
    if folder is not None:  # first: an option that does not apply is named before its sizes
        _check_folder_options(options, folder)
    for name in (
        "nproc",
        "tp",
        "cp",
        "ep",
        "etp",
        "dp_outer",
        "steps",
        "micro_batch",
        "grad_accum",
        "seq_len",
    ):
        _positive("--" + name.replace("_", "-"), getattr(options, name))
    for name in ("eval_every", "eval_batches"):
        _positive("--" + name.replace("_", "-"), getattr(options, name))
    if not options.lr > 0:
        raise ValueError(f"--lr must be a positive number, got {options.lr}")
    if not 0.0 <= options.layer_drop < 1.0:
        raise ValueError(f"--layer-drop must be a probability in [0, 1), got {options.layer_drop}")
    if not options.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {options.timeout}")
    if options.sample_tokens < 0:
        raise ValueError(f"--sample-tokens must be 0 or more, got {options.sample_tokens}")
    if options.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    if options.save_every < 0:
        raise ValueError(f"--save-every must be 0 or more, got {options.save_every}")
    if options.profile is not None:
        parse_window(options.profile, options.steps)
    if options.max_grad_norm < 0:
        raise ValueError(
            f"--max-grad-norm must be 0 (no clipping) or a positive number, "
            f"got {options.max_grad_norm}"
        )
    if options.peak_tflops is not None and not options.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be a positive number, got {options.peak_tflops}")
    if options.nproc % options.tp != 0:
        raise ValueError(
            f"--tp {options.tp} does not divide the {options.nproc} processes (--nproc); "
            "choose a tensor-parallel size that divides it"
        )
    if options.nproc % (options.tp * options.cp) != 0:
        raise ValueError(
            f"--cp {options.cp} does not divide the {options.nproc // options.tp} processes "
            f"per tensor-parallel rank (--nproc {options.nproc} / --tp {options.tp}); choose a "
            "context-parallel size that divides it"
        )
    if options.dp_size % options.dp_outer != 0:
        raise ValueError(
            f"--dp-outer {options.dp_outer} does not divide the data-parallel size "
            f"{options.dp_size} (= --nproc {options.nproc} / --tp {options.tp} / --cp {options.cp})"
        )
    if options.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine")
    if folder is None:
        _check_preset_options(options)
    check_lora_options(options, folder)
    check_data_options(options, folder)
    if options.step_in_backward:
        _check_step_in_backward(options)
    if options.resume_from is not None:
        options = dataclasses.replace(options, resume=True)
    if options.resume:
        check_resume_settings(options)
    return options


def _check_folder_options(options: TrainOptions, folder: ModelFolder) -> None:
    """Refuse what does not apply to a transformers model folder, naming the model."""
    refused = {
        "--tp": (options.tp > 1, "its layers are transformers', not mf-tp's tensor-parallel ones"),
        "--cp": (
            options.cp > 1 and not attends_through_sdpa(folder),
            "its attention has no SDPA path, the one mf's context parallelism serves",
        ),
        "--ep": (options.ep > 1, "expert parallelism is for the moe-* presets"),
        "--etp": (options.etp > 1, "expert tensor parallelism is for the moe-* presets"),
        "--layer-drop": (options.layer_drop > 0, "LayerDrop is in mf's GPT presets"),
        "--optimizer": (
            options.optimizer != "adamw",
            "the muon recipe picks the blocks' matrices of mf's GPT presets; use adamw",
        ),
        "--precision": (
            options.precision == "fp8" and options.lora_rank is not None,
            "with --lora-rank its bases are frozen, and torchao's float8 training converts "
            "linears whose weights train (the rank-R adapters are too narrow for FP8 matmuls); "
            "use bf16 for LoRA and QLoRA",
        ),
    }
    for flag, (applies, why) in refused.items():
        if applies:
            value = getattr(options, flag[2:].replace("-", "_"))
            raise ValueError(f"{flag} {value} does not apply to the {folder.name}: {why}")
    _check_context_parallel(options, None)
    if options.precision == "fp8":
        _check_float8(options, None)
        if not float8_linears(meta_causal_lm(folder)):
            raise ValueError(
                f"--precision fp8 does not apply to the {folder.name}: no linear of its decoder "
                "layers has both dimensions divisible by 16, which FP8 matmuls need"
            )
    if options.seq_len > folder.positions:
        raise ValueError(
            f"--seq-len {options.seq_len} exceeds the {folder.positions} positions of the "
            f"{folder.name} (max_position_embeddings)"
        )


def _check_preset_options(options: TrainOptions) -> None:
    """The checks of a run on one of mf's GPT presets."""
    preset = MODEL_PRESETS[options.model]
    _check_experts(options, preset)
    _check_context_parallel(options, preset)
    if options.layer_drop and isinstance(preset, MoEGPTConfig):
        raise ValueError(
            f"--layer-drop {options.layer_drop} is for dense models; --model "
            f"{options.model!r} is a mixture of experts (its load-balance loss sums every block)"
        )
    if preset.vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"--model {options.model!r} has {preset.vocab_size} tokens; bytes need 256"
        )
    if preset.n_heads % options.tp != 0:
        raise ValueError(
            f"--tp {options.tp} does not divide the {preset.n_heads} attention heads of the "
            f"{options.model!r} model"
        )
    if options.seq_len > preset.seq_len:
        raise ValueError(
            f"--seq-len {options.seq_len} exceeds the {options.model!r} model's "
            f"{preset.seq_len} positions"
        )
    if options.precision == "fp8":
        _check_float8(options, preset)


def _hardware_defaults(options: TrainOptions, folder: ModelFolder | None) -> TrainOptions:
    """Fill the options left unset with what suits the device.

    On a GPU: bf16 compute where the GPU has it, the model's full sequence length
    and a larger micro-batch, so a step gives the GPU work enough not to wait on
    the host (the engine's Python and kernel launches cost the same at any size).
    """
    positions = MODEL_PRESETS[options.model].seq_len if folder is None else folder.positions
    gpu = options.use_cuda
    seq_len = options.seq_len
    if seq_len is None:
        seq_len = positions if gpu else min(128, positions)
    micro_batch = options.micro_batch
    if micro_batch is None:
        micro_batch = CUDA_MICRO_BATCH if gpu else CPU_MICRO_BATCH
    precision = options.precision
    if precision is None:
        bf16 = gpu and torch.cuda.is_bf16_supported(including_emulation=False)
        precision = "bf16" if bf16 else "fp32"
    return dataclasses.replace(
        options, seq_len=seq_len, micro_batch=micro_batch, precision=precision
    )


def _check_float8(options: TrainOptions, preset: object) -> None:
    """Refuse ``--precision fp8`` where torchao's float8 training cannot run it, in one line.

    torchao's float8 replaces ``nn.Linear`` layers; the tensor-parallel GPT's are
    mf-tp's column and row layers (torchao's float8 tensor parallelism takes torch's
    DTensor layers instead), and the mixtures of experts keep their experts in
    batched weights.
    """
    if options.tp > 1:
        raise ValueError(
            f"--precision fp8 with --tp {options.tp}: torchao's float8 converts nn.Linear "
            "layers, and the tensor-parallel GPT's are mf-tp's column and row layers; "
            "use --tp 1 (FSDP over every rank), or --precision bf16 with --tp"
        )
    if isinstance(preset, MoEGPTConfig):
        raise ValueError(
            f"--precision fp8 is for the dense GPT presets; --model {options.model!r} is a "
            "mixture of experts"
        )
    device = torch.device("cuda", 0) if options.use_cuda else torch.device("cpu")
    problem = float8_unavailable(device)
    if problem is not None:
        raise ValueError(f"--precision fp8: {problem}")


def _check_step_in_backward(options: TrainOptions) -> None:
    """Refuse a ``--step-in-backward`` run the engine cannot step inside the backward.

    A bucket is stepped on its reduced gradient shard, which only ZeRO-2/3 keep
    (ZeRO-0/1 reduce whole gradients), before the other buckets' gradients exist
    (so no clipping by the total norm), and one bucket at a time, which only an
    elementwise optimizer computes as one step of all (Muon orthogonalizes
    whole matrices). Gradient accumulation is served: the micro-batches before
    the last run in ``no_sync``, and the step comes in the last one's backward.
    """
    if options.zero < 2:
        raise ValueError(
            f"--step-in-backward needs --zero 2 or 3, got --zero {options.zero}: each bucket is "
            "stepped on its reduced gradient shard, which ZeRO-0/1 do not keep"
        )
    if options.optimizer != "adamw":
        raise ValueError(
            f"--step-in-backward with --optimizer {options.optimizer}: each bucket is stepped "
            "on its own, which only an elementwise optimizer computes as one step of all; "
            "use --optimizer adamw"
        )
    if options.max_grad_norm != 0:
        raise ValueError(
            f"--step-in-backward with --max-grad-norm {options.max_grad_norm}: each bucket is "
            "stepped inside the backward, before the gradients' total norm is known, so none "
            "can be clipped; pass --max-grad-norm 0 (clipping is on by default)"
        )


def _check_context_parallel(options: TrainOptions, preset: object) -> None:
    """Refuse a --cp the sequence or the model cannot take."""
    if options.cp == 1:
        return
    if isinstance(preset, MoEGPTConfig):
        raise ValueError(
            f"--cp {options.cp} is for dense models; --model {options.model!r} is a mixture of "
            "experts (its experts are sharded over the data-parallel ranks alone)"
        )
    chunks = 2 * options.cp
    if options.seq_len % chunks != 0:
        raise ValueError(
            f"--seq-len {options.seq_len} does not split into {chunks} equal chunks (2 x --cp "
            f"{options.cp}, for load-balanced causal attention); choose a multiple of {chunks}"
        )


def _check_experts(options: TrainOptions, preset: object) -> None:
    """Refuse an --ep (or --etp) that the model or the data-parallel ranks cannot take."""
    if not isinstance(preset, MoEGPTConfig):
        for flag, size in (("--ep", options.ep), ("--etp", options.etp)):
            if size > 1:
                moe = sorted(n for n, c in MODEL_PRESETS.items() if isinstance(c, MoEGPTConfig))
                raise ValueError(
                    f"{flag} {size} needs a mixture-of-experts --model (one of {moe}), "
                    f"got {options.model!r}"
                )
        return
    dp_shard = options.dp_size // options.dp_outer
    if dp_shard % options.ep != 0:
        raise ValueError(
            f"--ep {options.ep} does not divide the {dp_shard} sharded data-parallel ranks "
            f"(--nproc {options.nproc} / --tp {options.tp} / --dp-outer {options.dp_outer}); "
            "expected an expert-parallel size that divides them"
        )
    if preset.num_experts % options.ep != 0:
        raise ValueError(
            f"--ep {options.ep} does not divide the {preset.num_experts} experts of the "
            f"{options.model!r} model; expected a divisor of {preset.num_experts}"
        )
    _check_expert_tp(options, preset, dp_shard)


def _check_expert_tp(options: TrainOptions, preset: MoEGPTConfig, dp_shard: int) -> None:
    """Refuse an --etp the ranks or the experts' widths cannot take."""
    etp = options.etp
    if etp == 1:
        return
    if dp_shard % (options.ep * etp) != 0:
        raise ValueError(
            f"--etp {etp} x --ep {options.ep} does not divide the {dp_shard} sharded "
            f"data-parallel ranks (--nproc {options.nproc} / --tp {options.tp} / --dp-outer "
            f"{options.dp_outer}); expected --ep x --etp to divide them"
        )
    for what, width in (("FFN width", preset.expert_ffn_size), ("d_model", preset.d_model)):
        if width % etp != 0:
            raise ValueError(
                f"--etp {etp} does not divide the experts' {what} {width} of the "
                f"{options.model!r} model; expected a divisor of {width}"
            )

"""The settings of one ``mf-train`` run (``TrainOptions``), as ``mf.train.run.options`` parsed them.

A frozen record every part of a run reads; parsing and checking the command line
are ``options.py``'s, and what a resume compares is ``resume.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TrainOptions"]


@dataclass(frozen=True)
class TrainOptions:
    """Everything one training run needs; the same object reaches every rank."""

    nproc: int
    tp: int
    zero: int
    dp_outer: int
    model: str
    steps: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    lr: float
    optimizer: str
    precision: str
    device: str
    data: str | None
    ckpt_dir: str
    save_every: int
    resume: bool
    seed: int
    eval_every: int
    eval_batches: int
    sample_tokens: int
    out_dir: str
    plot: bool = True
    timeout: float = 300.0
    max_restarts: int = 0
    ep: int = 1
    etp: int = 1
    allow_changed_settings: bool = False
    sync_save: bool = False
    resume_from: str | None = None
    layer_drop: float = 0.0
    cp: int = 1
    text_field: str = "text"
    chat_template: str | None = None
    train_on_prompt: bool = False
    no_pack: bool = False
    tensorboard: bool = False
    profile: str | None = None
    peak_tflops: float | None = None
    lora_rank: int | None = None
    lora_alpha: int | None = None
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    base_dtype: str = "fp32"
    merge: bool = False
    step_in_backward: bool = False
    max_grad_norm: float = 1.0

    @property
    def use_cuda(self) -> bool:
        """Whether the ranks run on CUDA GPUs with NCCL (else on the CPU with gloo)."""
        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (dp_outer x dp_shard); each one's cp ranks share its batch."""
        return self.nproc // (self.tp * self.cp)

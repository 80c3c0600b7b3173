"""Model FLOPs utilisation: the training FLOPs a GPT step needs over the device's peak.

``flops_per_token`` counts what a dense GPT's training step must compute per
token (forward and backward): ``6 * params`` for the matrix multiplies of
every weight, plus ``12 * layers * d_model * seq_len`` for attention's score
and value products (the PaLM paper's appendix B count). Peaks are the
vendors' dense (no sparsity) tensor-core figures of the SXM parts; a
``--peak-tflops`` option overrides them for any other device.
"""

from __future__ import annotations

import torch

from mf.models import GPTConfig

__all__ = ["PEAK_TFLOPS", "dense_flops_per_token", "flops_per_token", "peak_flops"]

PEAK_TFLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4, torch.float32: 66.9},
    "H100": {torch.bfloat16: 989.4, torch.float32: 66.9},
    "A100": {torch.bfloat16: 312.0, torch.float32: 19.5},
}
"""Dense peak TFLOP/s by GPU family and compute dtype (fp32: without TF32, torch's default)."""


def dense_flops_per_token(parameters: int, layers: int, width: int, seq_len: int) -> float:
    """Training FLOPs per token of any dense decoder: its weights' and its attention's."""
    return 6.0 * parameters + 12.0 * layers * width * seq_len


def flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs (forward and backward) per token of a ``config`` GPT at ``seq_len``."""
    return dense_flops_per_token(config.num_parameters(), config.n_layers, config.d_model, seq_len)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """The peak FLOP/s of ``device`` computing in ``dtype`` and its name, or None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for family, peaks in PEAK_TFLOPS.items():
        if family in name and dtype in peaks:
            dtype_name = str(dtype).removeprefix("torch.")
            return peaks[dtype] * 1e12, f"{family} {dtype_name} dense {peaks[dtype]:g} TFLOP/s"
    return None

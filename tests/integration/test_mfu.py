"""mf.mfu: the FLOPs a GPT step needs and the peaks MFU divides by."""

from __future__ import annotations

import pytest
import torch

from mf.mfu import flops_per_token, peak_flops
from mf.models import PRESETS


def test_flops_per_token_counts_the_weights_and_attention() -> None:
    config = PRESETS["150m"]
    want = 6 * config.num_parameters() + 12 * config.n_layers * config.d_model * 512
    assert flops_per_token(config, 512) == want
    assert flops_per_token(config, 1024) - flops_per_token(config, 512) == (
        12 * config.n_layers * config.d_model * 512
    )


def test_peaks_by_gpu_family_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cuda, torch.bfloat16) == (
        pytest.approx(989.4e12),
        "H100 bfloat16 dense 989.4 TFLOP/s",
    )
    assert peak_flops(cuda, torch.float32)[0] == pytest.approx(66.9e12)
    assert peak_flops(cuda, torch.float16) is None  # not in the table: no made-up peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(cuda, torch.bfloat16)[0] == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert peak_flops(cuda, torch.bfloat16) is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None

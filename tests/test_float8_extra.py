"""torchao, the optional extra ``mf[float8]``: declared, installed for the tests, working.

CI runs this at both ends of the torch range (2.15 and 2.11): the same torchao
0.18 serves both, and its float8 linear trains on the CPU at each.
"""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from mf.models import GPT, PRESETS
from mf.models import float8 as float8_module
from mf.models.float8 import TORCHAO_REQUIREMENT, convert_gpt_to_float8, float8_unavailable
from tests.test_architecture import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_extra_declares_torchao_and_the_dev_group_installs_it() -> None:
    assert PYPROJECT["project"]["optional-dependencies"]["float8"] == [TORCHAO_REQUIREMENT]
    assert "mf[float8]" in PYPROJECT["dependency-groups"]["dev"]


def test_the_installed_torchao_meets_the_extra() -> None:
    # No skip: a test environment without torchao would skip every float8 test.
    installed = Version(importlib.metadata.version("torchao"))
    assert Requirement(TORCHAO_REQUIREMENT).specifier.contains(installed), installed


def test_float8_runs_on_this_cpu_and_keeps_the_plain_gpts_names() -> None:
    assert float8_unavailable(torch.device("cpu")) is None, torch.__version__
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    names = {k: v.shape for k, v in model.state_dict().items()}
    converted = convert_gpt_to_float8(model, fsdp_float8_all_gather=False)
    assert converted == [
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.qkv", "attn.proj", "fc", "out")
    ]
    assert type(model.lm_head) is torch.nn.Linear
    assert {k: v.shape for k, v in model.state_dict().items()} == names
    tokens = torch.randint(0, 256, (2, 16))
    model.to(torch.bfloat16)(tokens, tokens).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_no_torchao_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = float8_module.importlib.util.find_spec
    monkeypatch.setattr(
        float8_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchao" else real(name, *a),
    )
    assert float8_unavailable(torch.device("cpu")) == (
        "float8 training needs torchao>=0.18, which is not installed "
        "(install the extra: pip install 'mf[float8]')"
    )


def test_a_gpu_older_than_sm89_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert float8_unavailable(torch.device("cuda", 0)) == (
        "the GPU NVIDIA A100-SXM4-80GB (sm_80) has no FP8 matmul; float8 training needs "
        "sm_89 or newer (Ada, Hopper, Blackwell)"
    )


def test_a_model_with_no_eligible_linear_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 12))
    with pytest.raises(ValueError, match="no linear of the Sequential has both dimensions"):
        convert_gpt_to_float8(model, fsdp_float8_all_gather=False)

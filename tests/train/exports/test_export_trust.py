"""mf-sample's export loading: a model.json that does not describe the export is refused before
anything is allocated, in one line naming the file."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from mf.models import MODEL_PRESETS, plain_model
from mf.train.exports.export import CONFIG_FILE, EXPORT_FILE, load_model
from mf.train.exports.sample import main as sample_main
from mf_fsdp import save_full_state_dict


def _export(folder: Path) -> dict:
    config = dataclasses.asdict(MODEL_PRESETS["tiny"])
    model = plain_model(MODEL_PRESETS["tiny"])
    save_full_state_dict(model.state_dict(), folder / EXPORT_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({"preset": "tiny", "config": config}))
    return config


def test_an_export_loads_and_a_config_of_another_model_is_refused_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _export(tmp_path)
    assert sum(p.numel() for p in load_model(tmp_path).parameters()) > 0
    huge = {**config, "n_layers": 64, "d_model": 65536}
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"preset": "tiny", "config": huge}))
    start = time.monotonic()
    with pytest.raises(
        ValueError, match=r"model.json describes a model of [\d,]+ parameters whose"
    ):
        load_model(tmp_path)
    assert time.monotonic() - start < 10  # refused from the shapes alone, nothing allocated
    assert sample_main([str(tmp_path), "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mf-sample: error: "), err


@pytest.mark.parametrize(
    "bad",
    [
        {"config": {"n_layers": "many"}},
        {"config": [1, 2]},
        {"preset": "tiny"},
        {"config": {**dataclasses.asdict(MODEL_PRESETS["tiny"]), "d_model": -4}},
    ],
)
def test_a_malformed_config_is_one_line(tmp_path: Path, bad: dict) -> None:
    _export(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"model.json: not an mf-train model config"):
        load_model(tmp_path)


def test_an_export_that_is_not_safetensors_is_one_line(tmp_path: Path) -> None:
    _export(tmp_path)
    (tmp_path / EXPORT_FILE).write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors: not a safetensors export"):
        load_model(tmp_path)

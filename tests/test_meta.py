from __future__ import annotations

import importlib.metadata

import mf
from mf.cli import main


def test_members_are_reexported() -> None:
    import mf_dtensor
    import mf_fsdp
    import mf_rng
    import mf_tp
    import mf_utils

    assert (mf.utils, mf.rng, mf.tp, mf.dtensor, mf.fsdp) == (
        mf_utils,
        mf_rng,
        mf_tp,
        mf_dtensor,
        mf_fsdp,
    )


def test_versions_match_metadata() -> None:
    found = mf.versions()
    assert set(found) == {"mf", *mf.MEMBERS}
    for name, version in found.items():
        assert version == importlib.metadata.version(name)


def test_cli_lists_packages(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in mf.MEMBERS:
        assert name in out
    assert "get_global_memory_buffer" in out
    assert "uv run mf-train" in out
    assert "uv run mf-bench" in out

"""Each member installs alone, with only its declared workspace dependencies.

One throw-away virtual environment gets torch (from uv's cache), then each
member in turn together with the members it declares; the member must import
and expose its ``__all__``, and no undeclared mf package may be importable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_architecture import PACKAGES, ROOT, _declared, _import_name

UV = shutil.which("uv")
ALL_MODULES = [_import_name(p.name) for p in PACKAGES]
CHECK = """
import importlib, importlib.util, sys
name, allowed = sys.argv[1], set(sys.argv[2].split(","))
module = importlib.import_module(name)
assert module.__all__ is not None and all(hasattr(module, n) for n in module.__all__)
present = {m for m in sys.argv[3].split(",") if importlib.util.find_spec(m) is not None}
assert present == allowed, f"importable mf packages {sorted(present)} != {sorted(allowed)}"
"""


def _closure(module: str, declared: dict[str, set[str]]) -> set[str]:
    result = {module}
    for dep in declared[module]:
        result |= _closure(dep, declared)
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    path = tmp_path_factory.mktemp("isolated") / "venv"
    env = {**os.environ, "VIRTUAL_ENV": str(path)}
    subprocess.run([UV, "venv", "-q", "-p", sys.executable, str(path)], check=True, env=env)
    version = torch.__version__.split("+")[0]
    subprocess.run([UV, "pip", "install", "-q", f"torch=={version}"], check=True, env=env)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_member_installs_alone(venv: Path, package: Path) -> None:
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    declared = {_import_name(p.name): _declared(p / "pyproject.toml") for p in PACKAGES}
    module = _import_name(package.name)
    needed = _closure(module, declared)
    paths = [str(ROOT / "packages" / m.replace("_", "-")) for m in sorted(needed)]
    subprocess.run([UV, "pip", "install", "-q", *paths], check=True, env=env)
    try:
        python = venv / "bin" / "python"
        result = subprocess.run(
            [str(python), "-c", CHECK, module, ",".join(sorted(needed)), ",".join(ALL_MODULES)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert result.returncode == 0, result.stderr
    finally:
        names = [m.replace("_", "-") for m in needed]
        subprocess.run([UV, "pip", "uninstall", "-q", *names], check=True, env=env)

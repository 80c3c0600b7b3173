"""Each member's wheel installs alone, with only its declared dependencies, as from a registry.

``uv build`` makes every member's sdist and wheel, as a release would. One
throw-away virtual environment gets the torch this suite runs on (from uv's
cache: CI runs the suite on the newest and the oldest supported torch), then
each member's wheel in turn together with the wheels of the members it declares
(other dependencies from the index); the torch already there must stay, the
member must import and expose its ``__all__``, no undeclared mf package may be
importable, and the README example runs as written, on one process. pip, the
installer of an image that ships its torch, must keep that torch too.

The tests share one ``xdist_group``: on one worker the wheels are built and the
environment made (its torch's bytecode compiled by the first import) once, not
once per worker. Each ``import torch`` in the environment costs seconds, so the
torch version is read once when the environment is made, and after an install
by the interpreter that checks the member anyway.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.api_snapshot import package_version
from tests.test_architecture import PACKAGES, ROOT, _declared, _import_name

pytestmark = pytest.mark.xdist_group("packaging")

UV = shutil.which("uv")
ALL_MODULES = [_import_name(p.name) for p in PACKAGES]
CHECK = """
import importlib, importlib.util, sys
import torch
name, allowed, shipped = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[4]
assert torch.__version__ == shipped, f"the wheels replaced torch {shipped} by {torch.__version__}"
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


# The command lines that run each member's README example (its first python block, a
# whole program) as ``python example.py ...`` on one process: the torchrun variables
# of a world of 1 are set; mf-tp's example spawns its own ranks.
EXAMPLE_RUNS: dict[str, list[list[str]]] = {
    "mf-utils": [[]],
    "mf-rng": [[]],
    "mf-tp": [[]],
    "mf-dtensor": [["save", "ckpt"], ["load", "ckpt"]],
    "mf-fsdp": [[]],
}


def _one_process_world() -> dict[str, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every member's wheel (and sdist), built by ``uv build``; by distribution name."""
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    out = tmp_path_factory.mktemp("dist")
    command = [UV, "build", "-q", "--all-packages", "--out-dir", str(out)]
    subprocess.run(command, check=True, cwd=ROOT)
    built = {}
    for package in PACKAGES:
        stem = f"{_import_name(package.name)}-{package_version(package)}"
        assert (out / f"{stem}.tar.gz").is_file(), f"no sdist for {package.name}"
        built[package.name] = out / f"{stem}-py3-none-any.whl"
        assert built[package.name].is_file(), f"no wheel for {package.name}"
    return built


def _readme_example(package: Path) -> str:
    return re.findall(r"```python\n(.*?)```", (package / "README.md").read_text(), re.S)[0]


def _run_example(
    python: Path, package: Path, arguments: list[str], env: dict[str, str], cwd: Path
) -> None:
    """Run ``package``'s README example (in ``cwd``) on one process; it must succeed."""
    example = cwd / "example.py"
    example.write_text(_readme_example(package))
    run = subprocess.run(
        [str(python), str(example), *arguments],
        capture_output=True,
        text=True,
        env={**env, **_one_process_world()},
        cwd=cwd,
        timeout=300,
    )
    assert run.returncode == 0, f"{package.name}'s README example:\n{run.stderr}"


def _torch_version(python: Path) -> str:
    """The torch version a virtual environment's interpreter imports."""
    probe = [str(python), "-c", "import torch; print(torch.__version__)"]
    return subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()


def _venv_env(path: Path) -> dict[str, str]:
    """The environment of commands run in the throw-away virtual environment ``path``.

    Python may cache bytecode there (this machine's environment forbids it with
    ``PYTHONDONTWRITEBYTECODE``): the first ``import torch`` compiles and writes it, and
    the dozen that follow (each member's checks, its README example, its ranks) load it,
    about half the CPU time of an import from source.
    """
    env = {**os.environ, "VIRTUAL_ENV": str(path)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


@dataclass(frozen=True)
class Environment:
    """A throw-away virtual environment with torch: where it is, and its torch's version."""

    path: Path
    torch: str

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """The environment every test installs into, with pip (the image's installer) seeded."""
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    path = tmp_path_factory.mktemp("isolated") / "venv"
    env = _venv_env(path)
    command = [UV, "venv", "-q", "--seed", "-p", sys.executable, str(path)]
    subprocess.run(command, check=True, env=env)
    version = torch.__version__.split("+")[0]
    subprocess.run([UV, "pip", "install", "-q", f"torch=={version}"], check=True, env=env)
    return Environment(path, _torch_version(path / "bin" / "python"))


def _check(venv: Environment, module: str, allowed: set[str]) -> None:
    """``module`` imports with its ``__all__``, exactly ``allowed`` of the mf packages import,
    and the environment's torch is the one it was made with."""
    arguments = [module, ",".join(sorted(allowed)), ",".join(ALL_MODULES), venv.torch]
    result = subprocess.run(
        [str(venv.python), "-c", CHECK, *arguments],
        capture_output=True,
        text=True,
        env=_venv_env(venv.path),
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_member_installs_alone(
    venv: Environment, wheels: dict[str, Path], package: Path, tmp_path: Path
) -> None:
    env = _venv_env(venv.path)
    declared = {_import_name(p.name): _declared(p / "pyproject.toml") for p in PACKAGES}
    module = _import_name(package.name)
    needed = _closure(module, declared)
    files = [str(wheels[m.replace("_", "-")]) for m in sorted(needed)]
    subprocess.run([UV, "pip", "install", "-q", *files], check=True, env=env)
    try:
        _check(venv, module, needed)
        for arguments in EXAMPLE_RUNS[package.name]:
            _run_example(venv.python, package, arguments, env, tmp_path)
    finally:
        names = [m.replace("_", "-") for m in needed]
        subprocess.run([UV, "pip", "uninstall", "-q", *names], check=True, env=env)


@pytest.mark.timeout(600)
def test_pip_keeps_the_torch_an_image_ships(
    venv: Environment, wheels: dict[str, Path], tmp_path: Path
) -> None:
    """``pip install`` of mf-fsdp's wheel (and its mf dependencies) where torch is installed.

    As on a GPU machine whose image pins torch: pip takes the installed torch, the
    package imports and its README example runs.
    """
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    # The machine's pip configuration (a site-wide version cap) is not the image's.
    env = {**_venv_env(venv.path), "PIP_CONFIG_FILE": os.devnull}
    names = ("mf-utils", "mf-rng", "mf-dtensor", "mf-fsdp")
    install = [str(venv.python), "-m", "pip", "install", "-q", *(str(wheels[n]) for n in names)]
    subprocess.run(install, check=True, env=env)
    try:
        _check(venv, "mf_fsdp", {"mf_utils", "mf_rng", "mf_dtensor", "mf_fsdp"})
        _run_example(venv.python, ROOT / "packages" / "mf-fsdp", [], env, tmp_path)
    finally:
        subprocess.run([UV, "pip", "uninstall", "-q", *names], check=True, env=env)

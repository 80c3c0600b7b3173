"""Each member's wheel installs alone, with only its declared dependencies, as from a registry.

``uv build`` makes every member's sdist and wheel, as a release would. One
throw-away virtual environment gets the torch this suite runs on (from uv's
cache: CI runs the suite on the newest and the oldest supported torch), then
each member's wheel in turn together with the wheels of the members it declares
(other dependencies from the index); the torch already there must stay, the
member must import and expose its ``__all__``, no undeclared mf package may be
importable, and the README example runs as written, on one process. pip, the
installer of an image that ships its torch, must keep that torch too.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.api_snapshot import package_version
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


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    path = tmp_path_factory.mktemp("isolated") / "venv"
    env = _venv_env(path)
    subprocess.run([UV, "venv", "-q", "-p", sys.executable, str(path)], check=True, env=env)
    version = torch.__version__.split("+")[0]
    subprocess.run([UV, "pip", "install", "-q", f"torch=={version}"], check=True, env=env)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_member_installs_alone(
    venv: Path, wheels: dict[str, Path], package: Path, tmp_path: Path
) -> None:
    env = _venv_env(venv)
    declared = {_import_name(p.name): _declared(p / "pyproject.toml") for p in PACKAGES}
    module = _import_name(package.name)
    needed = _closure(module, declared)
    files = [str(wheels[m.replace("_", "-")]) for m in sorted(needed)]
    python = venv / "bin" / "python"
    torch_before = _torch_version(python)
    subprocess.run([UV, "pip", "install", "-q", *files], check=True, env=env)
    try:
        assert _torch_version(python) == torch_before, "installing the wheels replaced torch"
        result = subprocess.run(
            [str(python), "-c", CHECK, module, ",".join(sorted(needed)), ",".join(ALL_MODULES)],
            capture_output=True,
            text=True,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        for arguments in EXAMPLE_RUNS[package.name]:
            _run_example(python, package, arguments, env, tmp_path)
    finally:
        names = [m.replace("_", "-") for m in needed]
        subprocess.run([UV, "pip", "uninstall", "-q", *names], check=True, env=env)


@pytest.mark.timeout(600)
def test_pip_keeps_the_torch_an_image_ships(
    wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """``pip install`` of mf-fsdp's wheel (and its mf dependencies) where torch is installed.

    As on a GPU machine whose image pins torch: pip takes the installed torch, the
    package imports and its README example runs.
    """
    assert UV is not None, "uv must be on PATH (.ci/run installs it)"
    path = tmp_path_factory.mktemp("image") / "venv"
    # The machine's pip configuration (a site-wide version cap) is not the image's.
    env = {**_venv_env(path), "PIP_CONFIG_FILE": os.devnull}
    subprocess.run([UV, "venv", "-q", "--seed", "-p", sys.executable, str(path)], check=True)
    version = torch.__version__.split("+")[0]
    subprocess.run([UV, "pip", "install", "-q", f"torch=={version}"], check=True, env=env)
    python = path / "bin" / "python"
    shipped = _torch_version(python)
    names = ("mf-utils", "mf-rng", "mf-dtensor", "mf-fsdp")
    install = [str(python), "-m", "pip", "install", "-q", *(str(wheels[n]) for n in names)]
    subprocess.run(install, check=True, env=env)
    assert _torch_version(python) == shipped, "pip replaced the installed torch"
    _run_example(python, ROOT / "packages" / "mf-fsdp", [], env, tmp_path)

"""Public API snapshots: each package's ``__all__`` and signatures, recorded in the repo.

``packages/<name>/api.txt`` holds, for the version in its first line, every
public name of the package with its kind and signature (classes: the
constructor and every public method and property). ``tests/test_versioning.py``
compares the live API with it. After a deliberate API change::

    uv run --no-sync python -m tests.api_snapshot mf-tp

rewrites the snapshot, but only once the package's version was bumped past
the recorded one and its CHANGELOG has a heading for the new version: an API
change is never recorded without both.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import tomllib
from pathlib import Path

__all__ = ["SNAPSHOT_FILE", "api_lines", "package_version", "read_snapshot", "write_snapshot"]

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT_FILE = "api.txt"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_MEMBER_MODULES = tuple(p.name.replace("-", "_") for p in (ROOT / "packages").iterdir())


def package_version(package: Path) -> str:
    """The version a member's pyproject.toml declares."""
    return tomllib.loads((package / "pyproject.toml").read_text())["project"]["version"]


class _ForeignDefault:
    """Stands for a default value of a dataclass from outside mf, by its class alone."""

    def __init__(self, value: object) -> None:
        self._text = f"{type(value).__module__}.{type(value).__qualname__}(...)"

    def __repr__(self) -> str:
        return self._text


def _is_foreign_dataclass(value: object) -> bool:
    module = type(value).__module__.split(".")[0]
    return dataclasses.is_dataclass(value) and module not in ("mf", *_MEMBER_MODULES)


def _signature(obj: object) -> str:
    """The signature as text; a foreign dataclass default by its class alone.

    torch's ``MixedPrecisionPolicy()`` shows a field more on torch 2.15 than on 2.11:
    mf promises the default, not torch's fields.
    """
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    parameters = [
        p.replace(default=_ForeignDefault(p.default)) if _is_foreign_dataclass(p.default) else p
        for p in signature.parameters.values()
    ]
    return _ADDRESS.sub("", str(signature.replace(parameters=parameters)))


def _constructor(cls: type) -> str:
    """The constructor's signature, or whose it is when the class inherits it from torch.

    A class that takes its constructor from a class outside mf (UnevenDTensor from
    DTensor) promises that constructor, whose signature changes with the torch release.
    """
    owner = next((c for c in cls.__mro__ if "__init__" in vars(c) or "__new__" in vars(c)), object)
    if owner is not object and owner.__module__.split(".")[0] not in ("mf", *_MEMBER_MODULES):
        return f"(constructor of {owner.__module__}.{owner.__qualname__})"
    return _signature(cls)


def _own_members(cls: type) -> dict[str, object]:
    """The members ``cls`` defines or inherits from mf's own classes (the nearest wins).

    A method moved to an mf base class (``MegatronFSDP``'s module contract) is the
    same promise; what a class inherits from torch is torch's.
    """
    members: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        if base.__module__.split(".")[0] in ("mf", *_MEMBER_MODULES):
            members.update(vars(base))
    return members


def _class_lines(name: str, cls: type) -> list[str]:
    lines = [f"class {name}{_constructor(cls)}"]
    for attr, value in sorted(_own_members(cls).items()):
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            lines.append(f"  property {name}.{attr}")
        elif isinstance(value, staticmethod | classmethod):
            lines.append(f"  method {name}.{attr}{_signature(value.__func__)}")
        elif inspect.isfunction(value):
            lines.append(f"  method {name}.{attr}{_signature(value)}")
    return lines


def api_lines(import_name: str) -> list[str]:
    """One line per public name (and per public member of a public class), sorted.

    A public sub-module (``mf_fsdp.fsdp2``) is followed by its own public names,
    indented and prefixed with its name (``  def fsdp2.fully_shard(...)``).
    """
    return _module_lines(importlib.import_module(import_name), "")


def _module_lines(module: object, prefix: str) -> list[str]:
    lines: list[str] = []
    for name in sorted(module.__all__):
        obj = getattr(module, name)
        qualified = prefix + name
        if inspect.isclass(obj):
            lines.extend(_class_lines(qualified, obj))
        elif callable(obj):
            lines.append(f"def {qualified}{_signature(obj)}")
        elif inspect.ismodule(obj):
            lines.append(f"module {qualified}")
            lines.extend(f"  {line}" for line in _module_lines(obj, f"{qualified}."))
        else:
            lines.append(f"value {qualified}: {type(obj).__name__}")
    return lines


def read_snapshot(package: Path) -> tuple[str, list[str]]:
    """The recorded version and API lines of a member."""
    first, *rest = (package / SNAPSHOT_FILE).read_text().splitlines()
    return first.removeprefix("version: "), rest


def write_snapshot(package: Path, import_name: str) -> None:
    """Record the live API under the package's current version."""
    body = "\n".join([f"version: {package_version(package)}", *api_lines(import_name)])
    (package / SNAPSHOT_FILE).write_text(body + "\n")


def _changelog_has(package: Path, version: str) -> bool:
    changelog = package / "CHANGELOG.md"
    heading = re.compile(rf"^## {re.escape(version)}\b", re.MULTILINE)
    return changelog.is_file() and heading.search(changelog.read_text()) is not None


def main(argv: list[str] | None = None) -> int:
    """Rewrite the snapshot of the named members (after a version bump); 1 if refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", help="member names, e.g. mf-tp")
    args = parser.parse_args(argv)
    for name in args.packages:
        package = ROOT / "packages" / name
        import_name = name.replace("-", "_")
        recorded, lines = read_snapshot(package)
        if lines == api_lines(import_name):
            print(f"{name}: the API matches the snapshot of {recorded}; nothing to do")
            continue
        version = package_version(package)
        if version == recorded:
            print(
                f"{name}: the API changed but the version is still {version}: bump it in "
                f"packages/{name}/pyproject.toml first (0.x: a minor bump for a breaking change)",
                file=sys.stderr,
            )
            return 1
        if not _changelog_has(package, version):
            print(
                f"{name}: packages/{name}/CHANGELOG.md has no '## {version}' heading: say what "
                "changed first",
                file=sys.stderr,
            )
            return 1
        write_snapshot(package, import_name)
        print(f"{name}: snapshot recorded for {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

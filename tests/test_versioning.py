"""The version policy, enforced: API snapshots, dependent ranges, documented pins.

See docs/versions.md. Each member's public API (``__all__`` and
signatures) is recorded in ``packages/<name>/api.txt`` with the version it
belongs to; a change fails here until ``python -m tests.api_snapshot <name>``
records it, which that tool does only after a version bump and a CHANGELOG
heading for the new version.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.api_snapshot import api_lines, package_version, read_snapshot
from tests.test_architecture import PACKAGES, ROOT, _import_name

VERSIONS = {p.name: package_version(p) for p in PACKAGES}


def _workspace_requirements(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [Requirement(text) for text in project.get("dependencies", [])]
    return [r for r in requirements if r.name in VERSIONS]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_public_api_matches_its_snapshot(package: Path) -> None:
    recorded, lines = read_snapshot(package)
    live = api_lines(_import_name(package.name))
    if live != lines:
        diff = "\n".join(difflib.unified_diff(lines, live, "api.txt", "live", lineterm="", n=0))
        pytest.fail(
            f"{package.name}: the public API differs from packages/{package.name}/api.txt "
            f"(recorded for {recorded}):\n{diff}\nIf the change is deliberate: bump the version "
            f"in packages/{package.name}/pyproject.toml (0.x: minor for a breaking change), add "
            f"a '## <version>' CHANGELOG entry, then run "
            f"`uv run --no-sync python -m tests.api_snapshot {package.name}`"
        )
    assert recorded == VERSIONS[package.name], (
        f"{package.name} is {VERSIONS[package.name]} but api.txt records {recorded}: "
        f"run `uv run --no-sync python -m tests.api_snapshot {package.name}`"
    )


@pytest.mark.parametrize(
    "pyproject",
    [p / "pyproject.toml" for p in PACKAGES] + [ROOT / "pyproject.toml"],
    ids=lambda p: p.parent.name,
)
def test_dependent_ranges_include_the_current_versions(pyproject: Path) -> None:
    for requirement in _workspace_requirements(pyproject):
        current = VERSIONS[requirement.name]
        assert requirement.specifier.contains(Version(current)), (
            f"{pyproject.relative_to(ROOT)}: {requirement} excludes {requirement.name}'s "
            f"current version {current}"
        )


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_each_package_documents_its_version_dependencies_and_pin(package: Path) -> None:
    readme = (package / "README.md").read_text()
    version = VERSIONS[package.name]
    assert (package / "CHANGELOG.md").is_file(), f"{package.name} has no CHANGELOG.md"
    assert f"Version {version}" in readme, f"{package.name}/README.md does not state {version}"
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    for text in project.get("dependencies", []):
        assert f"`{text}`" in readme, f"{package.name}/README.md does not list `{text}`"
    pin = re.escape(f"{package.name}=={version}")
    assert re.search(pin, readme), f"{package.name}/README.md does not show how to pin it"

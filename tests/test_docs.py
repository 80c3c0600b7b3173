"""The Markdown pages stay true to the code and to each other.

The README, ``docs/`` and the package pages are the project's front door:
their runnable examples run in their own tests (``tests/*/test_readme.py``);
here, without a process group, every page is checked for what goes stale when
code or pages move:

- every ``python`` block compiles;
- every relative link leads to a file, and every ``#anchor`` to a heading of
  the page it names (GitHub's anchors: lower case, punctuation dropped, spaces
  as hyphens);
- the Notes index of ``docs/architecture.md`` names every ``[Note: ...]`` the
  code defines, each with a file that holds it, and the pages cite no note the
  code does not define;
- each package page names every name of its package's ``__all__``;
- the README and the package pages stay short (the issue that made ``docs/``:
  a front door of at most about 250 lines, package pages of at most 300).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "tests" / "README.md",
        ROOT / "CONTRIBUTING.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("packages/*/README.md"),
    ]
)
PACKAGE_PAGES = sorted(ROOT.glob("packages/*/README.md"))
SOURCES = sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("src/**/*.py")])

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_DEFINED = re.compile(r'^\s*(?:#\s*|r?""")?\[Note: ([^\]]+)\]', re.M)
_INDEX_ROW = re.compile(r"^\| `\[Note: ([^\]]+)\]` \| `([^`]+)` \|", re.M)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return _FENCE.sub("", text)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_blocks_compile(page: Path) -> None:
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
        compile(code, f"{_name(page)} python block {index}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT)}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_name(linked)}")
    assert not broken, f"{_name(page)} has broken links:\n" + "\n".join(broken)


def _defined_notes() -> dict[str, set[str]]:
    """Each note the code defines (a line that opens with it), and the files that do."""
    notes: dict[str, set[str]] = {}
    for source in SOURCES:
        for name in _NOTE_DEFINED.findall(source.read_text()):
            notes.setdefault(name, set()).add(_name(source))
    return notes


def test_the_notes_index_names_every_note_and_its_file() -> None:
    defined = _defined_notes()
    index = dict(_INDEX_ROW.findall((ROOT / "docs" / "architecture.md").read_text()))
    missing = sorted(set(defined) - set(index))
    assert not missing, (
        f"docs/architecture.md's Notes index lacks {missing}: add a row "
        "| `[Note: name]` | `file` | about | for each"
    )
    stale = sorted(set(index) - set(defined))
    assert not stale, f"docs/architecture.md indexes notes no code defines: {stale}"
    moved = {name: path for name, path in index.items() if path not in defined[name]}
    assert not moved, f"docs/architecture.md names the wrong file for {moved}: see {defined}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_pages_cite_only_notes_the_code_defines(page: Path) -> None:
    cited = {re.sub(r"\s+", " ", name) for name in _NOTE.findall(page.read_text())}
    unknown = sorted(cited - set(_defined_notes()) - {"...", "name"})  # placeholders
    assert not unknown, f"{_name(page)} cites notes no code defines: {unknown}"


@pytest.mark.parametrize("page", PACKAGE_PAGES, ids=_name)
def test_package_pages_name_every_public_name(page: Path) -> None:
    module = importlib.import_module(page.parent.name.replace("-", "_"))
    text = page.read_text()
    unnamed = [name for name in module.__all__ if name not in text]
    assert not unnamed, f"{_name(page)} does not name {unnamed} (its package's __all__)"


@pytest.mark.parametrize(
    ("page", "most"), [(ROOT / "README.md", 250)] + [(page, 300) for page in PACKAGE_PAGES]
)
def test_front_pages_stay_short(page: Path, most: int) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= most, f"{_name(page)}: {lines} lines (at most {most}); move detail to docs/"

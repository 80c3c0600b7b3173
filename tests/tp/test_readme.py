"""The README's example runs as written and prints the losses it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "packages" / "mf-tp" / "README.md"


@pytest.mark.multiprocess
def test_readme_example_runs(tmp_path: Path) -> None:
    text = README.read_text()
    example = re.search(r"## Example.*?```python\n(.*?)```", text, re.S)
    shown = re.search(r"\$ \.venv/bin/python example\.py\n(.*?)```", text, re.S)
    assert example is not None, "README lost its example"
    assert shown is not None, "README lost the example's output"
    script = tmp_path / "example.py"
    script.write_text(example.group(1))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Losses are printed to 4 decimals: exact on the same torch build, so compare the text.
    assert result.stdout.strip() == shown.group(1).strip()

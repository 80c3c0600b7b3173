"""Command-line entry point of the meta-package.

Until the training job lands, ``mf`` lists the installed packages, what each
one offers, and how to run the tests.
"""

from __future__ import annotations

import argparse
import importlib

from mf import MEMBERS, versions


def main(argv: list[str] | None = None) -> int:
    """Print the installed mf packages and their public names."""
    parser = argparse.ArgumentParser(prog="mf", description=__doc__)
    parser.parse_args(argv)
    installed = versions()
    print(f"mf {installed['mf']}")
    for name in MEMBERS:
        module = importlib.import_module(name.replace("-", "_"))
        exported = ", ".join(module.__all__) or "(not implemented yet)"
        print(f"  {name} {installed[name]}: {exported}")
    print("Run the tests with: uv run pytest -n auto --dist loadgroup")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

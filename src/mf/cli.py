"""``mf``: what is installed and which commands to run.

The jobs have their own commands: ``mf-train`` trains a small GPT (the first
run a new user starts), ``mf-sample`` generates text from the model it
exported, ``mf-bench`` compares mf's engine with PyTorch's, ``mf-plan`` says
whether a model's state fits N GPUs before any run.
"""

from __future__ import annotations

import argparse
import importlib

from mf import MEMBERS, versions

_COMMANDS = (
    ("uv run mf-train", "train a small GPT with ZeRO-3 on 2 local processes (--help: options)"),
    ("uv run mf-sample runs/mf-train", "text from the model mf-train exported (one process)"),
    ("uv run mf-bench", "mf's FSDP engine side by side with PyTorch DDP and FSDP2"),
    (
        "uv run mf-plan --model 150m --gpus 8",
        "will it fit: model-state bytes per GPU, no GPU needed",
    ),
    ("uv run pytest -n auto --dist loadgroup", "the tests"),
)


def main(argv: list[str] | None = None) -> int:
    """Print the installed mf packages, their public names and the commands to run."""
    parser = argparse.ArgumentParser(prog="mf", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    installed = versions()
    print(f"mf {installed['mf']}")
    for name in MEMBERS:
        module = importlib.import_module(name.replace("-", "_"))
        print(f"  {name} {installed[name]}: {', '.join(module.__all__)}")
    print("Commands:")
    width = max(len(command) for command, _ in _COMMANDS)
    for command, what in _COMMANDS:
        print(f"  {command:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

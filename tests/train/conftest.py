"""Tiny model folders with chat templates, made once per test session (``chat_folders``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.data.chat_folders import chat_folder


@pytest.fixture(scope="session")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder whose tokenizer has a ChatML (Qwen-like) template."""
    return chat_folder(tmp_path_factory.mktemp("chat") / "chatml", "chatml")


@pytest.fixture(scope="session")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder whose tokenizer has a Llama-3-like template."""
    return chat_folder(tmp_path_factory.mktemp("chat") / "llama3", "llama3")


@pytest.fixture(scope="session")
def untemplated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder whose tokenizer has ChatML's tokens but no chat template."""
    return chat_folder(tmp_path_factory.mktemp("chat") / "plain", "chatml", template=False)

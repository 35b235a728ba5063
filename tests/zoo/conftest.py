"""Fixtures of the zoo's tests: a tiny Llama GGUF in a private models folder."""

from __future__ import annotations

import pytest

from eigenhooks.zoo import digest

from .gguf_tiny import write_tiny_gguf


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """(path of a tiny Llama GGUF, the model written into it), converted into tmp_path/models."""
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    digest.forget()
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    yield path, write_tiny_gguf(path)
    digest.forget()

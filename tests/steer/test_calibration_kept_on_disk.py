"""The calibration sample kept on disk (issue 50: ``eh.steer`` entry in a later process): read back
instead of sampled, the same ids, never for other weights, a damaged entry sampled again, and
``eigenhooks cache`` lists and clears it with the spectra."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import eigenhooks as eh
from eigenhooks.linalg.cache import CALIBRATION_DIR
from eigenhooks.steer import calibration as C

SHAPE = (3, 5)


@pytest.fixture
def gpt2():
    return eh.zoo.load("gpt2-tiny")


@pytest.fixture
def sampled(monkeypatch):
    """The shapes ``_sample`` was called with (the sampling itself runs as usual)."""
    calls = []
    real = C._sample

    def spy(model, shape, *a, **kw):
        calls.append(tuple(shape))
        return real(model, shape, *a, **kw)

    monkeypatch.setattr(C, "_sample", spy)
    return calls


def _entries() -> list[Path]:
    return sorted((Path(os.environ["EIGENHOOKS_CACHE"]) / CALIBRATION_DIR).glob("*.safetensors"))


def _new_process():
    C._SAMPLES.clear()  # what a later process starts with: no memo, the disk as it was left


def test_a_later_process_reads_the_sample_instead_of_sampling(gpt2, sampled):
    model, tok = gpt2
    first = C.sample_tokens(model, SHAPE)
    assert sampled == [SHAPE] and len(_entries()) == 1
    _new_process()
    again = C.sample_tokens(model, SHAPE)
    assert sampled == [SHAPE] and torch.equal(again, first) and again.dtype == torch.long
    _new_process()
    other = C.sample_tokens(model, SHAPE, seed=1)  # another seed: another entry
    assert sampled == [SHAPE, SHAPE] and len(_entries()) == 2 and not torch.equal(other, first)


def test_steering_a_second_time_samples_nothing_and_calibrates_the_same(gpt2, sampled):
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    with eh.steer(model, u, progress=False) as s:
        first = (s.alpha, s.change.b.clone())
    _new_process()
    with eh.steer(model, u, progress=False) as s:
        second = (s.alpha, s.change.b.clone())
    assert sampled == [C.N_CALIBRATION]
    assert first[0] == second[0] and torch.equal(first[1], second[1])


def test_other_weights_never_read_the_kept_sample(gpt2, sampled):
    model, tok = gpt2
    before = C.sample_tokens(model, SHAPE)
    with torch.no_grad():
        model.transformer.ln_f.bias.data[1::2] += 10 * model.transformer.wte.weight[tok.encode(" return")[0], 1::2]
    _new_process()
    after = C.sample_tokens(model, SHAPE)
    assert sampled == [SHAPE, SHAPE] and len(_entries()) == 2
    assert not torch.equal(after, before), "the edit does not change the sample: the test tests nothing"


def test_a_damaged_or_swapped_entry_is_sampled_again(gpt2, sampled):
    model, _ = gpt2
    first = C.sample_tokens(model, SHAPE)
    (entry,) = _entries()
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the ids
    entry.write_bytes(bytes(data))
    _new_process()
    assert torch.equal(C.sample_tokens(model, SHAPE), first) and sampled == [SHAPE, SHAPE]
    other = C.sample_tokens(model, SHAPE, seed=4)
    a, b = _entries()
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())  # one entry's file under the other's name
    b.write_bytes(a_bytes)
    _new_process()
    C.sample_tokens(model, SHAPE)
    C.sample_tokens(model, SHAPE, seed=4)
    assert len(sampled) == 5 and torch.equal(C.sample_tokens(model, SHAPE, seed=4), other)


def test_an_unwritable_folder_is_skipped(gpt2, sampled, tmp_path, monkeypatch):
    model, _ = gpt2
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    monkeypatch.setenv("EIGENHOOKS_CACHE", str(blocker))
    ids = C.sample_tokens(model, SHAPE)
    _new_process()
    assert torch.equal(C.sample_tokens(model, SHAPE), ids) and sampled == [SHAPE, SHAPE]


def test_cache_info_lists_the_samples_and_clear_removes_them(gpt2, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eigenhooks.cli import app

    # `clear --models` removes converted models: a private models folder, so the session's real ones stay
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    model, _ = gpt2
    C.sample_tokens(model, SHAPE)
    C.sample_tokens(model, SHAPE, seed=1)
    runner = CliRunner()
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0 and "2 steering calibration samples" in r.output, r.output
    r = runner.invoke(app, ["cache", "clear", "--models"])
    assert r.exit_code == 0 and len(_entries()) == 2
    r = runner.invoke(app, ["cache", "clear", "--spectra"])
    assert r.exit_code == 0 and "removed calibration: 2 steering calibration samples" in r.output, r.output
    assert _entries() == []

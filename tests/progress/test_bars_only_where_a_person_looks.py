"""eh.spectra and eh.verify take ``progress=``: a bar per layer for a 30-layer model, none for a few
layers unless asked, and the same numbers either way."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import pytest
import torch
from thirty_layers import thirty_layer_model

import eigenhooks as eh
from eigenhooks import progress as P
from eigenhooks.spectra import compute


@pytest.fixture
def bars(monkeypatch):
    """Every bar the spectra wing opens: [description, total, progress switch, completed, steps]."""
    seen = []

    @contextmanager
    def recording(description, total, progress=None):
        rec = [description, total, progress, 0, 0]
        seen.append(rec)

        class Rec(P.Bar):
            on = P.shown(progress)

            def advance(self, n=1):
                rec[3] += n
                rec[4] += 1

            def update(self, *, completed=None, description=None):
                if completed is not None and completed != rec[3]:
                    rec[3] = completed
                    rec[4] += 1

        yield Rec()

    monkeypatch.setattr(compute, "bar", recording)
    monkeypatch.setattr(importlib.import_module("eigenhooks.spectra.verify"), "bar", recording)  # verify's own file
    return seen


@pytest.fixture(scope="module")
def deep():
    return thirty_layer_model()[0]


def test_spectra_of_thirty_layers_moves_a_bar_to_the_end(bars, deep):
    specs = eh.spectra(deep, cache=False, progress=True)
    assert len(specs) == 30
    (desc, total, switch, done, steps), *_ = bars
    assert desc == "spectra of 30 layers (ov; modulus)" and total == 30 and switch is True and done == 30 and steps >= 2
    quiet = eh.spectra(deep, cache=False, progress=False)
    assert bars[1][2] is False
    assert all(torch.equal(a.eigenvalues, b.eigenvalues) for a, b in zip(specs, quiet))


def test_a_few_layers_draw_no_bar_unless_asked(bars):
    model, _ = eh.zoo.load("gpt2-tiny")
    eh.spectra(model, cache=False)
    assert bars[-1][:3] == ["spectra of 4 layers (ov; modulus)", 4, False]  # off whatever stderr is
    eh.spectra(model, cache=False, heads=True, rank="residual")
    assert bars[-1][0] == "spectra of 4 layers (ov; residual; every head and group)"  # which spectra, said
    eh.spectra(model, cache=False, progress=True)
    assert bars[-1][2] is True


def test_verify_steps_through_the_layers_with_the_same_numbers(bars, deep):
    shown = eh.verify(deep, progress=True)
    desc, total, switch, done, steps = bars[-1]
    assert (desc, total, switch, done) == ("verify: 30 layers", 30, True, 30) and 2 <= steps <= 10
    plain = eh.verify(deep, progress=False)
    assert bars[-1][4] == 1  # no bar: one probe of every layer, as before
    assert [(r.layer, r.max_abs_diff, r.linearity) for r in shown] == [
        (r.layer, r.max_abs_diff, r.linearity) for r in plain
    ]


def _recorded(monkeypatch):
    from eigenhooks.run import job

    seen = []

    @contextmanager
    def recording(description, total, progress=None):
        rec = {"description": description, "total": total, "progress": progress, "completed": [], "said": []}
        seen.append(rec)

        class Rec(P.Bar):
            def update(self, *, completed=None, description=None):
                if completed is not None:
                    rec["completed"].append(completed)
                if description is not None:
                    rec["said"].append(description)

            def advance(self, n=1):
                rec["completed"].append((rec["completed"] or [0])[-1] + n)

        yield Rec()

    monkeypatch.setattr(job, "bar", recording)
    return job, seen


def test_a_run_moves_the_progress_wings_bar_by_tokens_and_none_when_told(monkeypatch, tmp_path):
    """``eh.run.run``'s forwards use the progress wing's bar (stderr), not a bar of their own on stdout; the
    steps after them (summary, plots, token readouts) show one too."""
    job, seen = _recorded(monkeypatch)
    job.run("gpt2-tiny", max_tokens=200, batch_size=2, out=tmp_path / "a", progress=True)
    rec, after = seen
    assert rec["description"] == "monitored forwards: tokens of the text" and rec["total"] == 200
    assert rec["completed"] == sorted(rec["completed"]) and rec["completed"][-1] >= 200 and len(rec["completed"]) >= 2
    assert rec["progress"] is True and after["progress"] is True and after["total"] == 3
    assert after["said"] == ["the run folder: plots", "the run folder: token readouts of every layer, head and group"]
    assert after["completed"][-1] == 3
    job.run("gpt2-tiny", max_tokens=64, out=tmp_path / "b")
    assert seen[2]["progress"] is None  # the wing decides: silent when stderr is piped


def test_the_forwards_bar_counts_to_the_texts_tokens_or_counts_alone(monkeypatch, tmp_path):
    """Its total is the text's tokens (fewer than --max-tokens here), and a streamed dataset's bar counts
    without a total."""
    job, seen = _recorded(monkeypatch)
    text = "def add(a, b):\n    return a + b\n" * 3
    model, tok = eh.zoo.load("gpt2-tiny")
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    res = job.run("gpt2-tiny", text=text, max_tokens=4096, out=tmp_path / "a", progress=True)
    assert seen[0]["total"] == n < 4096 and seen[0]["completed"][-1] == n == res.summary["n_tokens"].max()
    data = tmp_path / "d.txt"
    data.write_text((text + "\n\n") * 4)
    job.run("gpt2-tiny", dataset=str(data), max_tokens=4096, out=tmp_path / "b", progress=True)
    streamed = seen[2]
    assert streamed["description"] == "monitored forwards: tokens streamed" and streamed["total"] is None
    assert streamed["completed"][-1] == 4 * n

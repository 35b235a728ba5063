"""Objects print short (issue 50): a spectrum in a line with its tensors by shape, a list of 30 in a screen,
a token readout and a steering report in a few lines; spectra and readouts give a DataFrame (``to_frame``)
whose cells are the objects' own numbers, and an HTML table for notebooks."""

from __future__ import annotations

import pytest
import torch
from thirty_layers import thirty_layer_model

import eigenhooks as eh


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def test_a_spectrum_prints_in_a_line_its_tensors_by_shape(gpt2):
    model, _ = gpt2
    s = eh.spectra(model, heads=True)[0]
    for obj, name in [(s, "LayerSpectrum"), (s.heads[1], "HeadSpectrum"), (s.groups[0], "GroupSpectrum")]:
        text = repr(obj)
        assert text.startswith(name + "(") and "\n" not in text and len(text) <= 200, text
        assert "tensor(" not in text and f"k={obj.k}" in text and obj.kind in text
    assert "layer=0" in repr(s) and "4 heads" in repr(s) and "(128, " in repr(s.heads[1])


def test_thirty_spectra_fit_a_screen():
    pretty = pytest.importorskip("IPython.lib.pretty")
    model, _ = thirty_layer_model()
    specs = eh.spectra(model, heads=True)
    lines = pretty.pretty(specs, max_width=120).splitlines()  # what a notebook cell shows
    assert len(specs) == 30 and len(lines) <= 40, len(lines)
    assert max(map(len, lines)) <= 120


def test_to_frame_holds_the_objects_numbers(gpt2):
    import pandas as pd

    model, _ = gpt2
    specs = eh.spectra(model, heads=True)
    df = pd.concat([s.to_frame() for s in specs], ignore_index=True)
    assert len(df) == 4 * (1 + 4 + 4)  # a layer, its 4 heads and 4 groups
    layers = df[df["part"] == "layer"]
    assert layers["abs_lambda_1"].tolist() == [abs(s.lambda_1) for s in specs]
    assert layers["kind"].tolist() == [s.kind for s in specs] and layers["k"].tolist() == [s.k for s in specs]
    h = specs[2].heads[3]
    row = df[(df["layer"] == 2) & (df["part"] == "head 3")].iloc[0]
    assert row["gap_ratio"] == h.gap_ratio and row["circuit_copying"] == h.circuit_copying
    assert "<table" in specs[0]._repr_html_() and "<table" in h._repr_html_()


def test_a_readout_prints_in_three_lines_and_gives_its_tokens_as_a_frame(gpt2):
    model, tok = gpt2
    r = eh.read_tokens(model, tok, torch.randn(model.config.n_embd, dtype=torch.float64), k=10, null_draws=50)
    lines = repr(r).splitlines()
    assert len(lines) == 3 and "score" in lines[0] and "null" in lines[0] and "p " in lines[0]
    assert lines[1].startswith("  top: " + repr(r.top[0][0]))
    df = r.to_frame()
    assert len(df) == 20 and df["token"].tolist() == [t for t, _ in r.top] + [t for t, _ in r.bottom]
    assert df["score"].tolist() == [v for _, v in r.top] + [v for _, v in r.bottom]
    assert df.attrs["score"] == r.score and df.attrs["p"] == r.p and "<table" in r._repr_html_()


def test_the_steering_report_prints_in_two_lines(gpt2):
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    with eh.steer(model, u, progress=False) as s:
        assert "active" in repr(s) and len(repr(s)) < 120
        model(**tok(["def f(x):"], return_tensors="pt"))
    rep = s.summary(target_token=eh.direction.token_id(tok, " return"))
    lines = repr(rep).splitlines()
    assert len(lines) == 2 and "cos(v1', u) 1.0000" in lines[0] and "->" in lines[1]

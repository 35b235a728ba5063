"""Every line drawn in a plot is in its legend: the rho plot's grey dashed null mean and dotted rho = 0.5, the
eigenvalue planes' unit circle and axes. Read from the matplotlib figures themselves (Agg)."""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'eigenhooks[plot]')")


def _unlisted(ax, legend_labels: set[str]) -> list[str]:
    """Lines of ``ax`` with a visible style that no legend entry names (errorbar's own caps and bars are
    the ρ, 95% CI entry; a line labelled '_...' says the entry it shares)."""
    from matplotlib.container import ErrorbarContainer

    bars = {id(a) for c in ax.containers if isinstance(c, ErrorbarContainer) for a in c.get_children()}
    out = []
    for line in ax.get_lines():
        label = line.get_label()
        if id(line) in bars or line.get_linestyle() in ("None", "none", " ", ""):
            continue  # markers only, or an errorbar's own parts: their entry is the marker's
        if label.startswith("_the "):
            continue  # drawn as part of a named entry (the imaginary axis with the real one)
        if label not in legend_labels:
            out.append(f"{label} ({line.get_color()}, {line.get_linestyle()})")
    return out


def test_every_line_of_the_rho_and_gamma_plots_is_in_the_legend():
    model, tok = eh.zoo.load("gpt2-tiny")
    with eh.monitor(model) as mon, torch.no_grad():
        # 24 distinct sequences: enough in both halves for the verdict's panel to draw its test
        model(**tok([f"def f{i}(x):\n    return x + {i}\n" * 4 for i in range(24)], return_tensors="pt", padding=True))
    fig = mon.plot()
    rho = next(ax for ax in fig.axes if ax.get_ylabel().startswith("ρ"))  # below the verdict's Δγ panel
    labels = {t.get_text() for t in rho.get_legend().get_texts()}
    assert {"null ρ mean", "ρ = 0.5: as many tokens tilt away as toward"} <= labels
    for ax in fig.axes:
        assert ax.get_legend() is not None, ax.get_title()
        assert _unlisted(ax, {t.get_text() for t in ax.get_legend().get_texts()}) == [], ax.get_title()


def test_every_line_of_the_eigenvalue_planes_is_in_the_legend():
    from eigenhooks.plots import eigenvalue_planes

    model, _ = eh.zoo.load("gpt2-tiny")
    fig = eigenvalue_planes(eh.spectra(model))
    assert len(fig.legends) == 1
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"unit circle |λ| = 1", "eigenvalues of F", "λ1", "real and imaginary axes"} <= labels
    for ax in fig.axes:
        if ax.axison:
            assert _unlisted(ax, labels) == [], ax.get_title()

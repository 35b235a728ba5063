"""What a notebook user reaches for: ``mon.plot()`` (one Figure: rho by layer with its null band, and
gamma), ``mon.tokens()`` (the per-token records as a DataFrame), checked against the model's own
hidden states and the summary's rho."""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh

TEXTS = ["def add(a, b):\n    return a + b", "A class statement defines a class object, short."]


@pytest.fixture(scope="module")
def watched():
    model, tok = eh.zoo.load("gpt2-tiny")
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with eh.monitor(model, targets=[("ov", "modulus"), ("ov", "residual")], tokens=True) as mon, torch.no_grad():
        model(**batch)
    return model, batch, mon


def test_tokens_is_a_frame_of_every_valid_token_with_the_models_own_alignment(watched):
    model, batch, mon = watched
    df = mon.tokens()
    n_layers, n_valid = model.config.n_layer, int(batch["attention_mask"].sum())
    assert len(df) == n_layers * 2 * n_valid  # every target (two), padding left out
    assert df["target"].unique().tolist() == ["ov/modulus", "ov/residual"]
    assert list(df.columns[:5]) == ["forward", "layer", "target", "sequence", "position"]
    # a(pre) at layer L from the model's own hidden states (the input of block L) and F's basis
    with torch.no_grad():
        hs = model(**batch, output_hidden_states=True).hidden_states
    specs = eh.spectra(model)
    for layer in range(n_layers):
        U = specs[layer].basis.float()  # (d, k)
        x = hs[layer]  # (batch, pos, d)
        a = (x @ U).norm(dim=-1) / x.norm(dim=-1)
        rows = df[(df["layer"] == layer) & (df["target"] == "ov/modulus")]
        want = a[batch["attention_mask"].bool()]
        torch.testing.assert_close(torch.tensor(rows["a_pre"].to_numpy()), want, atol=2e-5, rtol=1e-4)
    # rho is the share of tokens whose alignment grew: the summary's, from these rows
    s = mon.summary().set_index(["layer", "target"])
    for (layer, target), rows in df.groupby(["layer", "target"]):
        assert rows["up"].mean() == pytest.approx(s.loc[(layer, target), "rho"], abs=1e-6)
    assert (df["delta"] == df["a_mid"] - df["a_pre"]).all() and df["a_base"].isna().all()  # pre-norm: no baseline


def test_tokens_says_how_to_get_records():
    model, tok = eh.zoo.load("gpt2-tiny")
    with eh.monitor(model) as mon, torch.no_grad():
        model(**tok(TEXTS[:1], return_tensors="pt"))
    with pytest.raises(ValueError, match=r"tokens=True"):
        mon.tokens()


def test_plot_is_one_figure_of_rho_with_its_band_and_gamma_per_target(watched):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'eigenhooks[plot]')")
    from matplotlib.figure import Figure

    _, _, mon = watched
    fig = mon.plot()
    assert isinstance(fig, Figure)
    axes = fig.axes
    assert len(axes) == 6  # (Δγ, rho, gamma) x 2 targets
    titles = [a.get_title() for a in axes if a.get_title()]
    assert titles[:2] == [f"ov/{r}: the tilt per layer (the verdict's test)" for r in ("modulus", "residual")], titles
    rho_ax = next(a for a in axes if a.get_ylabel().startswith("ρ"))
    labels = [t.get_text() for t in rho_ax.get_legend().get_texts()]
    assert "null ρ 95% band" in labels and "ρ, 95% CI" in labels
    assert "mean alignment γ" in [a.get_ylabel() for a in axes]
    one = mon.plot("residual")
    assert len(one.axes) == 3 and one.axes[0].get_title().startswith("ov/residual")
    with pytest.raises(ValueError, match="no rows for target 'ov/nothing'"):
        mon.plot("ov/nothing")


def test_tokens_up_is_what_rho_counts_on_a_post_norm_model():
    """ALBERT is post-norm: rho compares a(LN_t(pre + attn)) with a(LN_t(pre)) and counts delta > 1e-6;
    the frame's ``up`` follows that rule, for every target, so its mean is rho (it was 0.229 against
    0.200 at layer 0 when ``up`` was a_mid > a_pre on the first target only; issue 52)."""
    model, tok = eh.zoo.load("albert-tiny")
    d = model.config.hidden_size
    u = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    targets = [("ov", "modulus"), ("ov", "residual"), ("mine", u / u.norm())]
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with eh.monitor(model, targets=targets, tokens=True) as mon, torch.no_grad():
        model(**batch)
    df, s = mon.tokens(), mon.summary().set_index(["layer", "target"])
    n_valid = int(batch["attention_mask"].sum())
    assert set(df["target"]) == {"ov/modulus", "ov/residual", "mine"}
    assert df["a_base"].notna().all()
    for (layer, target), rows in df.groupby(["layer", "target"]):
        assert len(rows) == n_valid
        assert rows["up"].mean() == pytest.approx(s.loc[(layer, target), "rho"], abs=0.5 / n_valid), (layer, target)
    assert (df["delta"] == df["a_mid"] - df["a_base"]).all()


def test_what_the_monitor_hands_out_is_the_callers_own(watched):
    """Editing state_dict()'s fingerprint or the token_records list leaves the monitor's (issue 52's kin)."""
    import copy

    _, _, mon = watched
    fp = mon.state_dict()["fingerprint"]
    want = copy.deepcopy(fp)
    fp["format"] = -1
    fp["targets"].append("x")
    assert mon.state_dict()["fingerprint"] == want
    recs = mon.token_records
    n = len(recs)
    recs[0]["layer"] = 99
    recs.clear()
    assert len(mon.token_records) == n and mon.token_records[0]["layer"] != 99

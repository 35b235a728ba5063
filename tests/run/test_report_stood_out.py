"""The report's first screen says what stood out (``eigenhooks.run.findings``): verdicts other than
indistinguishable, layer rows and head rows counted apart; token readouts above their null after BH over
every readout shown, each with score and band; the strongest copying heads, said to have no null; where
nothing stood out, what a result would have needed; "nothing above X" when the power column is there."""

from __future__ import annotations

import math

import pandas as pd

from eigenhooks.run import direction_report
from eigenhooks.run.findings import DETECTABLE, stood_out
from eigenhooks.spectra.tail import tail_p


def _summary(verdicts_layers, verdicts_heads=(), K=4999):
    rows = []

    def row(layer, target, head, v, i, q):
        return dict(layer=layer, target=target, head=head, rho=0.3 + 0.01 * i, tilt=0.01 + 0.001 * i,
                    tilt_ci_lo=0.005 + 0.001 * i, tilt_ci_hi=0.015 + 0.001 * i, tilt_null_lo=-0.01,
                    tilt_null_hi=0.004, p_tilt=0.2 + 0.01 * i if q > 0.05 else 0.002, q_tilt=q, static=0.1,
                    static_ci_lo=0.09, static_ci_hi=0.11, static_null_lo=0.12, static_null_hi=0.2, p_static=0.3,
                    q_static=0.5, verdict_static="indistinguishable", verdict_draws=K, verdict=v)  # fmt: skip

    for i, v in enumerate(verdicts_layers):
        rows.append(row(i, "ov/modulus", math.nan, v, i, 0.01 if v != "indistinguishable" else 0.5))
    for i, v in enumerate(verdicts_heads):
        rows.append(row(i // 2, f"ov_head/modulus/{i % 2}", i % 2, v, 20 + i, 0.6))
    return pd.DataFrame(rows)


def _read(score, kind="direction", d=576):
    m = 1 if kind == "direction" else 2
    mean, sd = (0.143, 0.0128) if m == 1 else (0.165, 0.015)
    return dict(reads_as=kind, top=[[" Paris", 0.5], [" London", 0.4]], bottom=[[" the", -0.2]] if m == 1 else [],
                score=score, null_lo=0.118, null_hi=0.168, null_draws=100, null_mean=mean, null_sd=sd,
                p=tail_p(score, mean, sd, 100, d, m), d=d)  # fmt: skip


def _doc(layer_scores, head_scores, copying=()):
    doc = {
        "variant": "ov",
        "rank": "modulus",
        "layers": [dict(layer=i, k=1, **_read(s)) for i, s in enumerate(layer_scores)],
    }
    doc["parts"] = [
        dict(layer=0, part="head", index=i, abs_lambda_1=1.0, kind="real-dominant", k=1, copying_score=0.0,
             circuit_copying=(copying[i] if i < len(copying) else 0.0), readout=_read(s))
        for i, s in enumerate(head_scores)
    ]  # fmt: skip
    doc["readouts_corrected"] = direction_report.correct(doc)
    return doc


def test_layer_and_head_rows_are_counted_apart_and_what_stood_out_is_named():
    df = _summary(["indistinguishable"] * 4 + ["toward"], ["indistinguishable"] * 6)
    page = stood_out(df, None)
    assert "5 layer rows" in page and "6 head rows" in page
    assert "1 toward" in page and "4 indistinguishable" in page and "6 indistinguishable" in page
    said = (
        "layer 4 ov/modulus: attention moves tokens toward it more than toward directions the stream favours: "
        "Δγ +0.014 [+0.0090, +0.019], null 95% -0.010…+0.0040, q 0.01"
    )
    assert said in page, page
    assert "No head row differs from its null" in page


def test_no_verdict_says_what_a_lone_row_could_reach():
    page = stood_out(_summary(["indistinguishable"] * 30, K=128), None)
    # K = 128: p_tilt >= 2/129; 30 hypotheses: q >= 0.47; 40 m - 1 = 1199 draws would let a lone row reach 0.05
    assert "a lone row among 30 hypotheses could reach at best q 0.47" in page and "verdict_draws=1199" in page
    page = stood_out(_summary(["indistinguishable"] * 30), None)  # K = 4999: a lone row could be called
    assert "a lone row could reach q 0.012 here (p_tilt ≥ 4.0e-04, K = 4999, 30 hypotheses)" in page, page


def test_readouts_above_their_null_after_bh_with_score_and_band():
    # 0.40 is far above the band (p ~ 1e-8), 0.20 above the 95% band but not past BH over 40 readouts
    doc = _doc([0.40, 0.20] + [0.14] * 8, [0.14] * 30, copying=[0.2, 0.99, 0.5])
    said, reads = page_parts(doc)
    assert "1 of 40 token readouts" in said
    assert "layer 0 v_1" in said and "0.400" in said and "0.118–0.168" in said
    assert "layer 1 v_1" not in said  # above its 95% band, not above its null after the correction
    assert "layer 0 head 1 0.990" in said and "Circuit copying has no null" in said
    assert reads[0]["q"] < 0.05 and reads[1]["q"] >= 0.05


def page_parts(doc):
    page = stood_out(_summary(["indistinguishable"] * 2), doc)
    return page, doc["layers"]


def test_nothing_above_its_null_says_the_score_it_would_have_needed():
    doc = _doc([0.15] * 10, [0.14] * 30)
    page = stood_out(_summary(["indistinguishable"] * 2), doc)
    assert "No v_1, head or group subspace reads as tokens above its null" in page
    assert "after Benjamini-Hochberg over 40 readouts: a direction would have needed a score of" in page
    # the needed score passes at alpha/n exactly
    need = float(page.split("needed a score of ")[1][:5])
    assert (
        tail_p(need + 0.001, 0.143, 0.0128, 100, 576, 1) <= 0.05 / 40 < tail_p(need - 0.002, 0.143, 0.0128, 100, 576, 1)
    )


def test_a_score_past_one_is_said_to_be_out_of_reach():
    doc = _doc([0.15] * 10, [0.14] * 30)
    for r in doc["layers"] + [p["readout"] for p in doc["parts"]]:
        r["d"] = 8  # a tiny width: the bound needs more than a cosine can give
    page = stood_out(_summary(["indistinguishable"] * 2), doc)
    assert "no direction could have (its null's 95% band 0.118–0.168; in d = 8 the tail bound allows no score" in page


def test_nothing_above_x_when_the_power_columns_are_there():
    df = _summary(["indistinguishable"] * 3, ["indistinguishable"] * 2)
    assert "Nothing above" not in stood_out(df, None) and "nothing above" not in stood_out(df, None)
    assert set(DETECTABLE) == {"detectable_tilt"}  # an 80%-power figure with the row's own error (issue 56)
    df["detectable_tilt"] = [0.012, 0.02, math.inf, 0.05, 0.05]  # inf: the draws cannot resolve alpha / m
    page = stood_out(df, None)
    assert "No layer row differs from its null: nothing above a Δγ lift of 0.012–0.020 over the null" in page, page
    assert "nothing above a Δγ lift of 0.050 over" in page  # the head rows, their own family
    assert "verdict_draws=" not in page  # the Monte-Carlo floor's sentence is for runs without them


def test_the_command_says_what_stood_out_below_its_tables(tmp_path):
    from typer.testing import CliRunner

    from eigenhooks.cli import app

    r = CliRunner().invoke(app, ["run", "gpt2-tiny", "--heads", "--max-tokens", "300", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    said = r.stdout[r.stdout.index("what stood out:") :].splitlines()
    assert said[1].startswith("- 8 layer rows") and said[2].startswith("- 16 head rows")
    assert any("token" in x and "readouts" in x for x in said) and any("no null" in x for x in said)

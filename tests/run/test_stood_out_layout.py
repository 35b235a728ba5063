"""How "what stood out" is laid out on a terminal (issue 58; the sentences are the verdict's, in findings.py).

The lines were not wrapped (a terminal split "ρ 0.86" into "ρ 0.86⏎0"), listed a subspace twice (modulus and
residual pick one lambda_1 at 28 of SmolLM2's 30 layers: two identical rows), pointed at "the tables below" when
the run table is above, and printed "nothing above Δγ 0.000–0.000" for detectable effects of 6.0e-06 to 8.1e-05.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from eigenhooks.run.findings import laid_out, stood_out, stood_out_text

from .test_report_stood_out import _doc, _summary


def _twins(n_layers: int = 9) -> pd.DataFrame:
    """Each layer's modulus and residual rows, one subspace (shared p_tilt and tilt), all toward."""
    rows = []
    for i in range(n_layers):
        for rank in ("modulus", "residual"):
            t = 0.01 * (i + 1)
            rows.append(dict(layer=i, target=f"ov/{rank}", head=math.nan, rho=0.86, tilt=t, tilt_ci_lo=t - 0.002,
                             tilt_ci_hi=t + 0.002, tilt_null_lo=-0.01, tilt_null_hi=0.004, p_tilt=4e-4 * (i + 1),
                             q_tilt=6.7e-4 * (i + 1), verdict_draws=4999, verdict="toward"))  # fmt: skip
    return pd.DataFrame(rows)


def test_a_subspace_two_rows_share_is_named_once():
    page = stood_out(_twins(2), None)
    assert page.count("layer 0 ov/modulus = ov/residual: attention moves tokens toward it") == 1
    assert "layer 0 ov/residual:" not in page
    assert "4 layer rows" in page  # the rows are still counted as rows


def test_small_figures_keep_their_significant_digits():
    df = _summary(["indistinguishable"] * 3)
    df["detectable_tilt"] = [6.0e-06, 2e-5, 8.1e-05]
    page = stood_out(df, None)
    assert "nothing above a Δγ lift of 6.0e-06–8.1e-05" in page and "0.000" not in page, page


def _words(lines: list[str]) -> list[str]:
    return " ".join(lines).split()


def test_wrapped_at_the_terminal_one_line_per_subspace_no_number_split():
    doc = _doc([0.51, 0.50, 0.14], [0.49, 0.14, 0.50], copying=[0.999, 0.5, 0.2])
    lines = stood_out_text(_twins(), doc)
    whole = laid_out(lines, None)
    for width in (80, 100, 160):
        shown = laid_out(lines, width)
        assert max(map(len, shown)) <= width, width
        assert _words(shown) == _words(whole)  # only the line breaks differ: no word, no number cut
        starts = [x for x in shown if re.match(r"   layer \d+ ov/modulus = ov/residual: attention moves", x)]
        assert len(starts) == 6, shown  # SHOWN subspaces, each on a line of its own, once
        assert any(x.strip() == "and 3 more (summary.csv)" for x in shown), shown
    assert not any("tables below" in x for x in whole)
    assert all(x.startswith(("- ", "   ")) for x in whole)


def test_the_command_wraps_to_an_80_column_terminal(tmp_path):
    from typer.testing import CliRunner

    from eigenhooks.cli import app

    env = {"TTY_COMPATIBLE": "1", "COLUMNS": "80"}
    r = CliRunner().invoke(app, ["run", "gpt2-tiny", "--max-tokens", "300", "--out", str(tmp_path / "r")], env=env)
    assert r.exit_code == 0, r.output
    said = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r.stdout).split("what stood out:")[1].split("\nthroughput")[0]
    said = said.splitlines()
    assert said[1].startswith("- 8 layer rows") and max(len(x) for x in said) <= 80, said

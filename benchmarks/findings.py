"""What eigenhooks finds on the zoo models and on SmolLM2: writes docs/findings.md.

    python benchmarks/findings.py [--max-tokens 4096]

Runs the main job (``eigenhooks.run.run``) on each model with the bundled text and writes
its per-layer table, whichever way the result comes out, with a count of verdicts; then
SmolLM2 again with K = 1999 Haar draws, fine enough for one layer alone to pass BH.
SmolLM2 needs ``eigenhooks fetch smollm2-135m`` first; it is skipped, and says so, without it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import eigenhooks as eh
from eigenhooks.run import run
from eigenhooks.run.table import rows

MODELS = ("gpt2-tiny", "albert-tiny", "smollm2-135m")
EXTRA = (
    ("Δγ", "dgamma"),
    ("Δγ null 95%", None),
    ("detectable Δγ", "detectable_dgamma"),
    ("p_rho_mc", "p_rho_mc"),
    ("fnull pct", "fnull_percentile"),
    ("design eff.", "design_effect"),
    ("p_binom", "p_binom"),
)


def _verdicts(df) -> str:
    """'target verdict: count, ...' over the rows of a summary."""
    counts = df.groupby(["target", "verdict"]).size().to_dict()
    return ", ".join(f"{t} {v}: {n}" for (t, v), n in sorted(counts.items()))


def section(name: str, max_tokens: int) -> str:
    if name in eh.zoo.REAL and not eh.zoo.is_fetched(name):
        return f"## {name}\n\nNot fetched on the machine that wrote this page (`eigenhooks fetch {name}`).\n"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        res = run(name, max_tokens=max_tokens, out=Path(tmp) / "run", progress=False)
        secs = time.time() - t0
    df = res.summary
    heads, cells = rows(df)
    from eigenhooks.run.table import fmt_num, fmt_p

    for h, col in EXTRA:
        heads.append(h)
        for cell, r in zip(cells, df.to_dict("records")):
            if col is None:  # the draws' Δγ band
                cell.append(f"{fmt_num(r['null_dgamma_lo'], 4)}–{fmt_num(r['null_dgamma_hi'], 4)}")
            elif col.startswith("p_"):
                cell.append(fmt_p(r[col], r["null_draws"] if col == "p_rho_mc" else None))
            else:
                cell.append(fmt_num(r[col], 4 if "dgamma" in col else 2))
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    verdicts = _verdicts(df)
    toward_rank1 = df[(df.verdict == "toward") & (df.eig_rank == 1)]
    return (
        f"## {name}\n\n{int(df['n_tokens'].iloc[0])} tokens of the bundled text, {df['layer'].nunique()} layers, "
        f"{secs:.0f} s. Verdicts: {verdicts}. Layers where v_1 is `toward` *and* ranks first among F's own "
        f"eigen-directions: {sorted(set(toward_rank1['layer'].tolist())) or 'none'}.\n\n" + "\n".join(lines) + "\n"
    )


def resolution(name: str, max_tokens: int, K: int = 1999) -> str:
    """The same run with K Haar draws, whose floor 2/(K+1) is fine enough for rho's Monte-Carlo p (p_rho_mc, the
    verdict's p before 2026-12) alone to pass BH over the table's hypotheses: whether rho, tested without a floor,
    finds what the verdict's Δγ test finds."""
    if name in eh.zoo.REAL and not eh.zoo.is_fetched(name):
        return ""
    import numpy as np

    from eigenhooks.monitor.stats import bh
    from eigenhooks.run.table import fmt_band, fmt_num, fmt_p

    with tempfile.TemporaryDirectory() as tmp:
        df = run(name, max_tokens=max_tokens, out=Path(tmp) / "run", nulls={"null_draws": K}, progress=False).summary
    # rows of one subspace share every statistic: the distinct ones are BH's hypotheses
    key = df[["layer", "rho", "p_rho_mc", "null_rho_lo", "null_rho_hi"]].astype(str).agg("|".join, axis=1)
    first = ~key.duplicated()
    m = int(first.sum())
    q = dict(zip(key[first], bh(df.loc[first, "p_rho_mc"])))
    df["q_rho_mc"] = key.map(q)
    n_rho = int((df.loc[first, "q_rho_mc"] < 0.05).sum())
    verdicts = _verdicts(df)
    low = df.sort_values(["p_rho_mc", "layer", "target"]).head(6)
    lines = ["| layer | target | ρ | null ρ 95% (ρ there) | pct | p_rho_mc | its q | verdict (Δγ) |", "|" + "---|" * 8]
    for r in low.to_dict("records"):
        cells = [str(r["layer"]), r["target"], fmt_num(r["rho"], 3), fmt_band(r), fmt_num(r["rho_percentile"], 3)]
        cells += [fmt_p(r["p_rho_mc"], K), fmt_p(r["q_rho_mc"]), r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    floor = 2 / (K + 1)
    return (
        f"## {name} with K = {K} Haar draws\n\n`eigenhooks run {name} --null-draws {K}`: rho's Monte-Carlo p "
        f"(`p_rho_mc`) has floor 2/{K + 1} = {floor:.4f}; Benjamini–Hochberg over the table's {m} distinct "
        f"(layer, subspace) hypotheses lets one row alone pass {'here' if floor < 0.05 / m else 'nowhere'} "
        f"(0.05/{m} = {0.05 / m:.4f}), which it cannot at the default K = 128. Smallest p_rho_mc: "
        f"{fmt_p(df['p_rho_mc'].min(), K)}; hypotheses with its q < 0.05: {n_rho}. The verdicts (Δγ's test, "
        f"its tail fitted to the {K} draws): {verdicts}; Δγ's q < 0.05 on "
        f"{int(np.sum(df.loc[first, 'q_null'] < 0.05))} hypotheses. The rows with the smallest p_rho_mc:\n\n"
        + "\n".join(lines)
        + "\n"
    )


HEADER = (
    "# Findings\n\nThe first section, \"The verdict's null\", is the issue-56 study of the verdict's null "
    "(`benchmarks/verdict_null.py`, `verdict_calibration.py`, `verdict_power.py`, `verdict_seeds.py`; its tables "
    "by `benchmarks/verdict_null_tables.py`), kept as it is when this file is written again. The per-model tables "
    "after it are written by `python benchmarks/findings.py` (do not edit them by hand), last before the verdict "
    "changed (2026-12-07): their `verdict` column is what `summary()` now calls `verdict_haar`, and their columns "
    "are the old run table's. `fnull pct` is rho's percentile among directions orth(F g) (one power step from a "
    "random start); `p_binom` is the token-level test of rho = 0.5 for this fixed direction, not a test of v_1; "
    "`verdict_haar` tests Δγ on the null's tokens against a t_8 fitted to Haar-random subspaces' Δγ (`p_null`, "
    "docs/concepts.md); `detectable Δγ` is the smallest planted Δγ it would call at 80% power, alone among the "
    "table's hypotheses; `p_rho_mc` is rho's Monte-Carlo p.\n"
)
BEGIN, END = "<!-- begin: the verdict's study", "<!-- end: the verdict's study -->"


def kept_study(text: str) -> str:
    """The verdict's study, between its markers, as the file holds it ("" if it holds none): written by hand
    from the verdict benchmarks' logs, so this script keeps it rather than writes it."""
    a, b = text.find(BEGIN), text.find(END)
    return text[a : b + len(END)] + "\n" if a >= 0 and b > a else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "findings.md"))
    args = ap.parse_args()
    out = Path(args.out)
    parts = [HEADER, kept_study(out.read_text(encoding="utf-8") if out.exists() else "")]
    for name in MODELS:
        print(f"running {name} ...", flush=True)
        parts.append(section(name, args.max_tokens))
    print("running smollm2-135m with K = 1999 ...", flush=True)
    parts.append(resolution("smollm2-135m", args.max_tokens))
    out.write_text("\n".join(p for p in parts if p))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

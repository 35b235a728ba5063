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
EXTRA = (("fnull pct", "fnull_percentile"), ("design eff.", "design_effect"), ("p_binom", "p_binom"))


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
            cell.append(fmt_p(r[col]) if col.startswith("p_") else fmt_num(r[col], 2))
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
    """The same run with K Haar draws, whose floor 2/(K+1) is fine enough for one row alone to pass BH over the
    table's hypotheses (or says it is not): whether "indistinguishable" comes from the data or from the
    Monte-Carlo floor of the default K."""
    if name in eh.zoo.REAL and not eh.zoo.is_fetched(name):
        return ""
    from eigenhooks.run.table import fmt_band, fmt_num, fmt_p

    with tempfile.TemporaryDirectory() as tmp:
        df = run(name, max_tokens=max_tokens, out=Path(tmp) / "run", nulls={"null_draws": K}, progress=False).summary
    # rows of one subspace share every statistic: the distinct ones are BH's hypotheses
    m = len(df.drop_duplicates(["layer", "rho", "p_null", "null_rho_lo", "null_rho_hi"]))
    verdicts = _verdicts(df)
    low = df.sort_values(["p_null", "layer", "target"]).head(6)
    lines = ["| layer | target | ρ | null ρ 95% (ρ there) | pct | p_null | q_null | verdict |", "|" + "---|" * 8]
    for r in low.to_dict("records"):
        cells = [str(r["layer"]), r["target"], fmt_num(r["rho"], 3), fmt_band(r), fmt_num(r["rho_percentile"], 3)]
        cells += [fmt_p(r["p_null"], K), fmt_p(r["q_null"], K), r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return (
        f"## {name} with K = {K} Haar draws\n\n`eigenhooks run {name} --null-draws {K}`: p_null's floor is "
        f"2/{K + 1} = {2 / (K + 1):.4f}; Benjamini–Hochberg runs over the table's {m} distinct (layer, subspace) "
        f"hypotheses, so one row alone {'could' if 2 / (K + 1) < 0.05 / m else 'could not'} pass it here "
        f"(0.05/{m} = {0.05 / m:.4f}), which it cannot at the default K = 128. Smallest p_null: "
        f"{fmt_p(df['p_null'].min(), K)}; layers with q_null < 0.05: {int((df['q_null'] < 0.05).sum())}. "
        f"Verdicts: {verdicts}. The rows with the smallest p_null:\n\n" + "\n".join(lines) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "findings.md"))
    args = ap.parse_args()
    parts = [
        "# Findings\n\nWritten by `python benchmarks/findings.py` (do not edit by hand). Columns as in the "
        "README; `fnull pct` is rho's percentile among directions orth(F g) (one power step from a random "
        "start); `p_binom` is the token-level test of rho = 0.5 for this fixed direction, not a test of v_1.\n"
    ]
    for name in MODELS:
        print(f"running {name} ...", flush=True)
        parts.append(section(name, args.max_tokens))
    print("running smollm2-135m with K = 1999 ...", flush=True)
    parts.append(resolution("smollm2-135m", args.max_tokens))
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

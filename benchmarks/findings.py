"""What eigenhooks finds on the zoo models and on SmolLM2: writes docs/findings.md.

    python benchmarks/findings.py [--max-tokens 4096]

Runs the main job (``eigenhooks.run.run``) on each model with the bundled text and writes
its per-layer table, whichever way the result comes out, with a count of verdicts.
SmolLM2 needs ``eigenhooks fetch smollm2-135m`` first; it is skipped, and says so, without it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import eigenhooks as eh
from eigenhooks.run import run
from eigenhooks.table import rows

MODELS = ("gpt2-tiny", "albert-tiny", "smollm2-135m")
EXTRA = (("fnull pct", "fnull_percentile"), ("design eff.", "design_effect"), ("p_binom", "p_binom"))


def section(name: str, max_tokens: int) -> str:
    if name in eh.zoo.REAL and not eh.zoo.is_fetched(name):
        return f"## {name}\n\nNot fetched on the machine that wrote this page (`eigenhooks fetch {name}`).\n"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        res = run(name, max_tokens=max_tokens, out=Path(tmp) / "run", progress=False)
        secs = time.time() - t0
    df = res.summary
    heads, cells = rows(df)
    from eigenhooks.table import fmt_num, fmt_p

    for h, col in EXTRA:
        heads.append(h)
        for cell, r in zip(cells, df.to_dict("records")):
            cell.append(fmt_p(r[col]) if col.startswith("p_") else fmt_num(r[col], 2))
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    counts = df.groupby(["target", "verdict"]).size().to_dict()
    verdicts = ", ".join(f"{t} {v}: {n}" for (t, v), n in sorted(counts.items()))
    toward_rank1 = df[(df.verdict == "toward") & (df.eig_rank == 1)]
    return (
        f"## {name}\n\n{int(df['n_tokens'].iloc[0])} tokens of the bundled text, {df['layer'].nunique()} layers, "
        f"{secs:.0f} s. Verdicts: {verdicts}. Layers where v_1 is `toward` *and* ranks first among F's own "
        f"eigen-directions: {sorted(set(toward_rank1['layer'].tolist())) or 'none'}.\n\n" + "\n".join(lines) + "\n"
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
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""What eigenhooks finds on the zoo models and on SmolLM2: writes docs/findings.md's per-model tables.

    python benchmarks/findings.py [--max-tokens 4096]

Runs the main job (``eigenhooks.run.run``) on each model with the bundled text and writes its run table (the
columns ``eigenhooks run`` prints, the verdict's first), whichever way the result comes out, with a count of
verdicts and a few columns the run table leaves out. Every section between ``<!-- …: begin`` and ``<!-- …: end -->``
markers (the verdict's study, written by hand; the heads' and the power study's, written by their scripts) is kept
as the file holds it. SmolLM2 needs ``eigenhooks fetch smollm2-135m`` first; it is skipped, and says so, without it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import eigenhooks as eh
from eigenhooks.run import run
from eigenhooks.run.table import fmt_num, fmt_p, rows

MODELS = ("gpt2-tiny", "albert-tiny", "smollm2-135m")
# columns the run table leaves out: (header, cell of a summary row as a dict)
EXTRA = (
    ("detectable lift", lambda r: fmt_num(r["detectable_tilt"], 4)),
    ("Haar q (verdict_haar)", lambda r: f"{fmt_p(r['q_null'])} ({r['verdict_haar']})"),
    ("fnull pct", lambda r: fmt_num(r["fnull_percentile"], 2)),
    ("design eff.", lambda r: fmt_num(r["design_effect"], 2)),
)


def _verdicts(df, col: str = "verdict") -> str:
    """'target verdict: count, ...' over the rows of a summary."""
    counts = df.groupby(["target", col]).size().to_dict()
    return ", ".join(f"{t} {v}: {n}" for (t, v), n in sorted(counts.items()))


def _layers(df, verdict: str, col: str = "verdict") -> list[int]:
    return sorted(set(df.loc[df[col] == verdict, "layer"].tolist()))


def section(name: str, max_tokens: int) -> str:
    if name in eh.zoo.REAL and not eh.zoo.is_fetched(name):
        return f"## {name}\n\nNot fetched on the machine that wrote this page (`eigenhooks fetch {name}`).\n"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        res = run(name, max_tokens=max_tokens, out=Path(tmp) / "run", progress=False)
        secs = time.time() - t0
    df = res.summary
    heads, cells = rows(df)
    for h, cell in EXTRA:
        heads.append(h)
        for c, r in zip(cells, df.to_dict("records")):
            c.append(cell(r))
    lines = ["| " + " | ".join(h.replace("|", "\\|") for h in heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cs) + " |" for cs in cells]
    first = df.iloc[0]
    top = df[(df.verdict == "toward") & (df.eig_tilt_percentile >= 15 / 16 - 1e-9)]
    return (
        f"## {name}\n\n{int(first['n_tokens'])} tokens of the bundled text, {df['layer'].nunique()} layers, "
        f"{secs:.0f} s; the verdict scored on {int(first['verdict_sequences'])} sequences "
        f"({int(first['verdict_tokens'])} tokens a layer). The tilt (`verdict`): toward at layers "
        f"{_layers(df, 'toward') or 'none'}, away at {_layers(df, 'away') or 'none'} ({_verdicts(df)}). Static "
        f"alignment (`verdict_static`): above at {_layers(df, 'toward', 'verdict_static') or 'none'}, below at "
        f"{_layers(df, 'away', 'verdict_static') or 'none'}. `toward` with v_1's tilt above that of at least 15 "
        f"of F's 16 other eigen-subspaces (eig pct ≥ 0.94): {sorted(set(top['layer'].tolist())) or 'none'}. Against the isotropic "
        f"(Haar) null the same tilt is called toward at {_layers(df, 'toward', 'verdict_haar') or 'none'}, away at "
        f"{_layers(df, 'away', 'verdict_haar') or 'none'}.\n\n" + "\n".join(lines) + "\n"
    )


HEADER = (
    "# Findings\n\nThe first section, \"The verdict's null\", is the issue-56 study of the verdict's null "
    "(`benchmarks/verdict_null.py`, `verdict_calibration.py`, `verdict_power.py`, `verdict_seeds.py`; its tables "
    "by `benchmarks/verdict_null_tables.py`), kept as it is when this file is written again. The per-model tables "
    "after it are written by `python benchmarks/findings.py` (do not edit them by hand): the run table "
    "`eigenhooks run` prints, the verdict's columns first (the tilt Δγ on the verdict's tokens with its 95% "
    "interval over sequences, the band its null puts Δγ in, BH's q, the verdict; static alignment γ pre against "
    "the same null; Δγ's percentile among F's own eigen-subspaces; then ρ and the Haar null's band), and four "
    "columns it leaves out: `detectable lift`, the smallest lift of Δγ above its null's median the row would have "
    "been called at with 80% power, its error across sequences included; the Haar comparison (Δγ against "
    "isotropic random subspaces, `q_null` and `verdict_haar`: what the verdict was before it drew its null from "
    "the stream's covariance, kept to show the difference); `fnull pct`, ρ's percentile among directions orth(F g); "
    "and the design effect of ρ's token count. The heads' section and the power study after them are written by "
    "`benchmarks/findings_heads.py` and `benchmarks/power.py`; the power study predates the covariance null (it "
    "measures ρ's tests and Δγ against the Haar null, today's `verdict_haar`): the verdict's own power is the "
    "study's table from `benchmarks/verdict_power.py`.\n"
)
# sections written by hand or by other scripts, kept as the file holds them: (begin marker's start, end marker)
KEPT = (
    ("<!-- begin: the verdict's study", "<!-- end: the verdict's study -->"),
    ("<!-- heads: begin", "<!-- heads: end -->"),
    ("<!-- power: begin", "<!-- power: end -->"),
)


def kept(text: str, begin: str, end: str) -> str:
    """The section between these markers as the file holds it ("" if it holds none)."""
    a, b = text.find(begin), text.find(end)
    return text[a : b + len(end)] + "\n" if a >= 0 and b > a else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "findings.md"))
    args = ap.parse_args()
    out = Path(args.out)
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    study, *others = (kept(text, b, e) for b, e in KEPT)
    parts = [HEADER, study]
    for name in MODELS:
        print(f"running {name} ...", flush=True)
        parts.append(section(name, args.max_tokens))
    out.write_text("\n".join(p for p in [*parts, *others] if p))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

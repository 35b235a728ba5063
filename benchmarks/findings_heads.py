"""SmolLM2's heads and what their directions read as: writes the section of docs/findings.md.

    python benchmarks/findings_heads.py [--null-draws 200]

Per layer: v_1's readout (ov, modulus; the scaled unembedding's rows, k = 10) against its Haar band,
and per query head |mu_1|, copying, circuit copying and whether its principal subspace reads as
tokens above the band (k = 5). The section between the markers in docs/findings.md is replaced;
the numbers are whatever they come out as. Needs ``eigenhooks fetch smollm2-135m``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import eigenhooks as eh
from eigenhooks.spectra.readout import read_tokens_many

BEGIN, END = "<!-- heads: begin (benchmarks/findings_heads.py) -->", "<!-- heads: end -->"


def _toks(pairs, n=5) -> str:
    return " ".join(f"`{t[:12]!r}`" for t, _ in pairs[:n]).replace("|", "\\|")


def _side(r) -> str:
    """The tokens of the end that makes the two-sided score: v_1's top, or (marked -v_1) its bottom."""
    if not r.bottom or sum(s for _, s in r.top) >= -sum(s for _, s in r.bottom):
        return _toks(r.top)
    return "-v_1: " + _toks(r.bottom)


def section(null_draws: int) -> str:
    model, tok = eh.zoo.load("smollm2-135m")
    t0 = time.perf_counter()
    specs = eh.spectra(model, heads=True)
    layer_reads = read_tokens_many(model, tok, specs, 10, "out", null_draws)
    heads = [h for s in specs for h in s.heads]
    head_reads = read_tokens_many(model, tok, heads, 5, "out", null_draws)
    above = {id(h): r.score > r.null_hi for h, r in zip(heads, head_reads)}
    seconds = time.perf_counter() - t0
    n_above = sum(r.score > r.null_hi for r in layer_reads)
    cc = [h.circuit_copying for h in heads]
    lines = [
        BEGIN,
        "## smollm2-135m: what the direction is",
        "",
        f"30 layers x 9 query heads (3 kv groups), `eh.spectra(heads=True)` and `eh.read_tokens` ({seconds:.0f} s, "
        f"{null_draws} Haar draws per band). v_1 (ov, modulus) reads above its null band in {n_above} of 30 layers; "
        f"{sum(above.values())} of {len(heads)} heads' principal subspaces read above theirs (k = 5). Circuit copying "
        f"over the 270 heads: {sum(c > 0 for c in cc)} positive, median {sorted(cc)[len(cc) // 2]:+.2f}, "
        f"range {min(cc):+.2f} to {max(cc):+.2f}. Per head: circuit copying, * where its subspace reads above the band.",
        "",
        "| layer | v_1 kind | v_1 tokens (the winning end) | score [null 95%] | "
        + " | ".join(f"h{h}" for h in range(9))
        + " |",
        "|---|---|---|---|" + "---|" * 9,
    ]
    for s, r in zip(specs, layer_reads):
        mark = " **above**" if r.score > r.null_hi else ""
        cells = [f"{h.circuit_copying:+.2f}{'*' if above[id(h)] else ''}" for h in s.heads]
        lines.append(
            f"| {s.layer} | {s.kind} | {_side(r)} | {r.score:.3f} [{r.null_lo:.3f}, {r.null_hi:.3f}]{mark} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--null-draws", type=int, default=200)
    args = ap.parse_args()
    text = section(args.null_draws)
    path = Path(__file__).resolve().parents[1] / "docs" / "findings.md"
    doc = path.read_text()
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(doc)
    print(text)


if __name__ == "__main__":
    main()

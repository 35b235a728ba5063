"""What the direction is, for people: per-head tables and token readouts in the CLI and the report.

``part_records`` turns spectra with heads into one record per layer part (head or key/value group):
|lambda_1|, kind, copying, circuit copying, and the top tokens of its principal subspace.
``write`` puts the run's readouts into ``directions.json`` (each layer's v_1 with its null band, and
the per-head table); ``section`` renders it as the report's "What the direction is".
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

from ..spectra.readout import read_tokens_many

log = logging.getLogger(__name__)
FILE = "directions.json"
PART_COLUMNS = ["layer", "part", "|lambda_1|", "kind", "k", "copying", "circuit copying", "score", "null 95%", "p", "q"]
PART_COLUMNS += ["v_1 top tokens (␣ a space)"]
PART_WRAP = (PART_COLUMNS[-1],)  # a terminal narrower than the table wraps the tokens, never a number
PART_DROP = ("p", "copying", "|lambda_1|", "null 95%", "k", "circuit copying", "kind")  # then these, in order


def _tokens(pairs, n: int = 5) -> str:
    return " ".join(repr(t) for t, _ in pairs[:n])


def _plain(pairs, n: int = 5) -> str:
    """Tokens for a terminal: a space shown as ␣, a newline as ⏎, a tab as ⇥, so that a line wraps between
    tokens, never inside one."""
    marks = {" ": "␣", "\n": "⏎", "\t": "⇥"}
    show = lambda c: c if c.isprintable() and not c.isspace() else marks.get(c, repr(c)[1:-1])  # '\r', '\x0c'
    return " ".join("".join(map(show, t)) or "∅" for t, _ in pairs[:n])


def _readout(r) -> dict:
    """A readout's fields; ``reads_as`` ('direction' or 'plane') never takes the spectrum's ``kind``."""
    return {
        "reads_as": r.kind,
        "top": r.top,
        "bottom": r.bottom,
        "score": r.score,
        "null_lo": r.null_lo,
        "null_hi": r.null_hi,
        "null_draws": r.null_draws,
        "null_mean": r.null_mean,
        "null_sd": r.null_sd,
        "p": r.p,
        "d": r.d,
    }


def _parts(specs) -> list[tuple]:
    """(layer, 'head' or 'group', index, spectrum) for every head and group of the spectra."""
    parts = [(s.layer, "head", p.head, p) for s in specs for p in s.heads or []]
    return parts + [(s.layer, "group", p.group, p) for s in specs for p in s.groups or []]


def _read(model, tokenizer, spectra: list, k: int, null_draws: int) -> dict[int, object]:
    """{id(spectrum): its readout (side 'out')} for those with k > 0, in one pass over the rows; {} (one
    log line) for a model without an unembedding."""
    readable = [s for s in spectra if s.k > 0]
    try:
        found = read_tokens_many(model, tokenizer, readable, k, "out", null_draws)
    except ValueError as e:  # no unembedding: the spectra still print
        log.warning("no token readouts: %s", e)
        return {}
    return {id(s): r for s, r in zip(readable, found)}  # by the spectrum object: each part is its own


def part_records(model, tokenizer, specs, k: int = 5, null_draws: int = 100, reads: dict | None = None) -> list[dict]:
    """One record per (layer, head) and (layer, group), with the readout of its principal subspace (side 'out').

    ``reads`` ({id(part): readout}) skips the readouts; parts with k = 0 (a zero head) get none.
    """
    parts = _parts(specs)
    if reads is None:
        reads = _read(model, tokenizer, [p[3] for p in parts], k, null_draws)
    out = []
    for layer, kind, index, p in parts:
        rec = {
            "layer": layer,
            "part": kind,
            "index": index,
            "abs_lambda_1": abs(p.lambda_1),
            "lambda_1": [p.lambda_1.real, p.lambda_1.imag],
            "kind": p.kind,
            "k": p.k,
            "gap_ratio": p.gap_ratio,
            "copying_score": p.copying_score,
            "circuit_copying": p.circuit_copying,
        }
        if kind == "group":
            rec["heads"] = p.heads
        r = reads.get(id(p))
        rec["readout"] = _readout(r) if r is not None else None
        out.append(rec)
    return out


def part_table(records: list[dict]) -> tuple[list[str], list[list]]:
    """The CLI's per-head (and per-group) table of ``part_records``; q is Benjamini-Hochberg over the
    readouts of ``records``."""
    from ..monitor.stats import bh
    from .table import fmt_p

    reads = [r["readout"] for r in records if r["readout"]]
    qs = dict(zip(map(id, reads), bh([r.get("p", float("nan")) for r in reads])))
    rows = []
    for r in records:
        part = f"head {r['index']}" if r["part"] == "head" else f"group {r['index']} {r['heads']}"
        read = r["readout"]
        if read:
            band = f"{read['null_lo']:.3f}-{read['null_hi']:.3f}" if read["null_draws"] else "-"
            said = [f"{read['score']:.3f}", band, fmt_p(read.get("p")), fmt_p(qs[id(read)]), _plain(read["top"])]
        else:
            said = ["-", "-", "-", "-", "-"]
        rows.append(
            [r["layer"], part, f"{r['abs_lambda_1']:.4f}", r["kind"], r["k"], f"{r['copying_score']:+.3f}"]
            + [f"{r['circuit_copying']:+.3f}", *said]
        )
    return PART_COLUMNS, rows


def cli_heads(model, tokenizer, specs, records: list[dict]) -> tuple[list[str], list[list]]:
    """``eigenhooks spectrum --heads``: adds each layer's heads and groups to its JSON record; the table to print."""
    from ..progress import bar

    with bar("token readouts of every head and group", 1) as b:  # a few seconds on SmolLM2's 360
        parts = part_records(model, tokenizer, specs)
        b.advance()
    for rec in records:
        rec["heads"] = [p for p in parts if p["layer"] == rec["layer"] and p["part"] == "head"]
        rec["groups"] = [p for p in parts if p["layer"] == rec["layer"] and p["part"] == "group"]
    return part_table(shown_parts(parts))


def write(run_dir: Path, model, tokenizer, k: int = 10, null_draws: int = 100) -> None:
    """directions.json: each layer's v_1 (ov, modulus) read as tokens with its null, and the per-head table.

    Layers, heads and groups are read with the same k, so they share two null bands (directions and
    planes). Never fails a run: an error is logged and the report says the section is missing.
    """
    from ..spectra import spectra

    try:
        specs = spectra(model, heads=True)
        reads = _read(model, tokenizer, list(specs) + [p[3] for p in _parts(specs)], k, null_draws)  # one pass
        if not reads:
            return
        doc = {
            "variant": "ov",
            "rank": "modulus",
            "layers": [
                {"layer": s.layer, "kind": s.kind, "k": s.k, "abs_lambda_1": abs(s.lambda_1), **_readout(reads[id(s)])}
                for s in specs
            ],
            "parts": part_records(model, tokenizer, specs, reads=reads),
        }
        doc["readouts_corrected"] = correct(doc)
    except Exception as e:  # noqa: BLE001 - the section is optional; the run's numbers are not
        log.warning("what the direction is: not written (%s: %s)", type(e).__name__, e)
        return
    tmp = Path(run_dir) / f".{FILE}.tmp"
    tmp.write_text(json.dumps(doc, allow_nan=True, default=float))
    tmp.replace(Path(run_dir) / FILE)


def shown_parts(parts: list[dict]) -> list[dict]:
    """The parts the tables show: every head, and the key/value groups when there is GQA (without it a
    group is its head)."""
    gqa = any(len(p.get("heads", [])) > 1 for p in parts if p["part"] == "group")
    return [p for p in parts if gqa or p["part"] == "head"]


def correct(doc: dict) -> int:
    """Benjamini-Hochberg q over every readout the report shows (each layer's v_1, each head, each group
    under GQA), written into each readout as ``q``; returns how many were corrected over."""
    from ..monitor.stats import bh

    reads = [r for r in doc["layers"]] + [p["readout"] for p in shown_parts(doc["parts"]) if p["readout"]]
    ps = [r.get("p", float("nan")) for r in reads]
    for r, q in zip(reads, bh(ps)):
        r["q"] = q
    return sum(1 for p in ps if p == p)  # not NaN


def _cells(values) -> str:
    return "".join(f"<td>{html.escape(str(v))}</td>" for v in values)


def head_verdicts(heads) -> str:
    """The monitor's head targets (``eigenhooks run --heads``) as one row per layer: each head's ρ and
    verdict (``table.head_table``), in a folded box; '' without head rows."""
    from .table import head_table

    cols, rows = head_table(heads)
    if not rows:
        return ""
    th = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + _cells(r) + "</tr>" for r in rows)
    return f"""<details><summary>Per-head verdicts: the layer's update in each head's subspace ({len(heads)} rows)</summary>
<p>ρ of the whole layer's update measured against each query head's principal subspace (target
ov_head), + toward and − away where q_null &lt; 0.05; the head rows are a Benjamini–Hochberg family
of their own (docs/concepts.md, "Head targets"). Every column is in summary.csv.</p>
<div class="tablebox"><table><tr>{th}</tr>{body}</table></div></details>
"""


def read(run_dir: Path) -> dict | None:
    """directions.json as written, with each shown readout's BH ``q``; None when missing or unreadable."""
    try:
        doc = json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
    if "readouts_corrected" not in doc and all("p" in r for r in doc.get("layers", [])):
        doc["readouts_corrected"] = correct(doc)
    return doc


def section(run_dir: Path, fold: int = 8, heads=None) -> str:
    """The report's "What the direction is" (HTML), or '' when the run wrote no directions.json and
    measured no head targets (``heads``: the summary's head rows)."""
    verdicts = head_verdicts(heads) if heads is not None else ""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return f"<h2>What the direction is</h2>{verdicts}" if verdicts else ""
    doc = read(run_dir)
    if doc is None:
        return f"<h2>What the direction is</h2><p>directions.json is unreadable.</p>{verdicts}"
    n = doc.get("readouts_corrected")
    head = ["layer", "kind", "reads as", "score", "null band (95%)", "p", f"q (BH over {n})", "v_1 top tokens"]
    head += ["v_1 bottom tokens"]
    rows = "".join(
        "<tr>"
        + _cells([r["layer"], r["kind"], reads_as(r), *_score_cells(r)])
        + token_cell(r["top"])
        + (token_cell(r["bottom"]) if r["bottom"] else "<td>(a plane: no sign)</td>")
        + "</tr>"
        for r in doc["layers"]
    )
    pcols = ["layer", "part", "|λ1|", "kind", "k", "copying", "circuit copying", "score", "null band (95%)", "p", "q"]
    parts = "".join(_part_row(r) for r in shown_parts(doc["parts"]))
    th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    pth = "".join(f"<th>{html.escape(c)}</th>" for c in pcols) + "<th>top tokens</th>"
    return f"""<h2>What the direction is</h2>
<p>Each layer's v_1 ({doc["variant"]}, {doc["rank"]}) read as tokens: the cosine with each row of the
unembedding (final norm's scale folded in). The score is the larger of the top-10 mean and minus the
bottom-10 mean (a plane: the mean of the top-10 projection norms); the band is the same score for
Haar-random directions. A score inside the band is no more token-like than chance. p bounds the chance
that a random direction scores as high (its null's concentration tail), q corrects it by
Benjamini-Hochberg over every readout below (docs/concepts.md).</p>
<details{" open" if len(doc["layers"]) <= fold else ""}><summary>v_1 per layer ({len(doc["layers"])} rows)</summary>
<div class="tablebox"><table id="v1-readouts"><tr>{th}</tr>{rows}</table></div></details>
<details><summary>Per head and key/value group ({len(shown_parts(doc["parts"]))} rows)</summary>
<div class="tablebox"><table id="part-readouts"><tr>{pth}</tr>{parts}</table></div></details>
{verdicts}"""


def reads_as(r: dict) -> str:
    """'direction' or 'plane': a readout's ``reads_as`` (its ``kind`` in a directions.json written before)."""
    return r.get("reads_as") or r["kind"]


def _score_cells(r: dict) -> list[str]:
    """score, null band, p and q of a readout ('–' where a directions.json from before p-values has none)."""
    from .table import fmt_p

    return [f"{r['score']:.3f}", f"{r['null_lo']:.3f}–{r['null_hi']:.3f}", fmt_p(r.get("p")), fmt_p(r.get("q"))]


def token_cell(pairs, n: int = 10) -> str:
    """A report cell of the first n tokens, wrapped to the cell's width between tokens (CSS ``td.tokens``):
    the spaces inside a token are no-break spaces, so a line breaks inside a token only where that token
    alone is wider than the cell. Nothing is cut: a list ended past the window at 1280 px (issue 58)."""
    text = " ".join(html.escape(repr(t)).replace(" ", "\u00a0") for t, _ in pairs[:n])
    return f'<td class="tokens">{text}</td>'


def _part_row(r: dict) -> str:
    part = f"head {r['index']}" if r["part"] == "head" else f"group {r['index']} {r['heads']}"
    cells = [r["layer"], part, f"{r['abs_lambda_1']:.4f}", r["kind"], r["k"]]
    cells += [f"{r['copying_score']:+.3f}", f"{r['circuit_copying']:+.3f}"]
    read = r["readout"]
    cells += _score_cells(read) if read else ["–"] * 4
    return "<tr>" + _cells(cells) + (token_cell(read["top"], 5) if read else "<td>–</td>") + "</tr>"

"""What stood out in a run: the report's first screen, in words, before any plot or table.

``stood_out(df, doc)`` reads the summary table and directions.json and says, each with its figures:

- the verdicts other than ``indistinguishable``, layer rows and head rows counted apart (two
  Benjamini-Hochberg families), each called subspace once, as one sentence of what was tested with its effect,
  interval and the null's band: the tilt (``verdict``) and static alignment (``verdict_static``); where none
  stood out, the smallest lift each row would have been called at, or the q a lone row could reach at this K;
- the v_1, head and group subspaces whose token readout stands above its Haar null after BH over every
  readout the report shows (``direction_report.correct``: ~390 on SmolLM2), with score, band, p and q;
  where none did, the score a readout would have needed;
- the strongest copying heads by circuit copying, said to have no null;
- where no row stood out, "nothing above X" from ``detectable_tilt`` (an 80%-power figure with the row's own
  error across sequences) when the summary has it, else the q a lone row could reach at this run's K.
"""

from __future__ import annotations

import html
import math
import re

from ..monitor.summary import head_rows, layer_rows
from .direction_report import reads_as

ALPHA = 0.05
SHOWN = 6  # findings listed on the first screen; the rest folded below them
# the smallest lift of the tilt above its null's median each row would have been called at with 80% power
DETECTABLE = {"detectable_tilt": "a Δγ lift of"}


def _f(v, digits: int = 3) -> str:
    """A figure in words: ``digits`` decimals, or 2 significant digits below 10^-(digits-1) (6.0e-06, never 0.000)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:.1e}" if 0 < abs(v) < 10 ** -(digits - 1) else f"{v:.{digits}f}"


def _s(v, sign: bool = True) -> str:
    """A figure in words: the significant digits its size needs (``table.fmt_sig``)."""
    from .table import fmt_sig

    return fmt_sig(v, 2, sign)


def _p(p) -> str:
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _hypotheses(rows) -> int:
    """Distinct (layer, subspace) hypotheses of a family: rows of one share its layer, p and tilt."""
    ok = rows[rows["p_tilt"].notna()] if "p_tilt" in rows else rows.iloc[:0]
    return len(ok[["layer", "p_tilt", "tilt"]].drop_duplicates())


def _counts(rows) -> str:
    c = rows["verdict"].value_counts()
    said = ", ".join(
        f'<span class="chip v-{v.replace(" ", "-")}">{int(n)} {html.escape(v)}</span>' for v, n in c.items()
    )
    return said or "none"


def _one_per_subspace(hits, p: str, effect: str):
    """One row per subspace: rows of one hypothesis (equal subspaces at a layer, e.g. ov/modulus and ov/residual
    when both rules pick the same lambda_1) share their layer, p and effect (``summary_table``); their names join."""
    names = hits.groupby(["layer", p, effect], sort=False)["target"].transform(lambda t: " = ".join(map(str, t)))
    return hits.assign(target=names).drop_duplicates(["layer", p, effect])


def tested_sentence(r: dict, static: bool = False) -> str:
    """One called row as what was tested, its effect with its interval, and the null's band (plain text)."""
    layer, target = int(r["layer"]), str(r["target"])
    if static:
        rel = "more" if r["verdict_static"] == "toward" else "less"
        return (
            f"layer {layer} {target}: the stream already points along it {rel} than along directions it favours: "
            f"γ {_s(r['static'], False)} [{_s(r['static_ci_lo'], False)}, {_s(r['static_ci_hi'], False)}], "
            f"null 95% {_s(r['static_null_lo'], False)}…{_s(r['static_null_hi'], False)}, q {_p(r['q_static'])}"
        )
    rel = "more" if r["verdict"] == "toward" else "less"
    return (
        f"layer {layer} {target}: attention moves tokens toward it {rel} than toward directions the stream favours: "
        f"Δγ {_s(r['tilt'])} [{_s(r['tilt_ci_lo'])}, {_s(r['tilt_ci_hi'])}], null 95% {_s(r['tilt_null_lo'])}…"
        f"{_s(r['tilt_null_hi'])}, q {_p(r['q_tilt'])}"
    )


def verdict_lines(df) -> list[str]:
    """The verdicts, layer rows and head rows apart: who stood out, one sentence each, or what a lone row could reach."""
    lines = []
    for name, rows in (("layer", layer_rows(df)), ("head", head_rows(df))):
        if rows.empty or "verdict" not in rows:
            continue
        said = f"<b>{len(rows)} {name} rows</b>: {_counts(rows)}."
        hits = _one_per_subspace(rows[rows["verdict"].isin(["toward", "away"])], "p_tilt", "tilt")
        if len(hits):
            items = [html.escape(tested_sentence(r)) for r in hits.sort_values("q_tilt").to_dict("records")]
            more = f" and {len(items) - SHOWN} more (summary.csv)" if len(items) > SHOWN else ""
            said += f" The tilt stood out in {len(items)} subspaces: " + "; ".join(items[:SHOWN]) + more + "."
        else:
            said += " " + (_nothing_above(rows, name) or _reach(rows, name))
        lines.append(said)
        if "verdict_static" in rows:  # the second question, a line of its own
            st = _one_per_subspace(rows[rows["verdict_static"].isin(["toward", "away"])], "p_static", "static")
            if len(st):
                items = [html.escape(tested_sentence(r, True)) for r in st.sort_values("q_static").to_dict("records")]
                more = f" and {len(items) - SHOWN} more (summary.csv)" if len(items) > SHOWN else ""
                lines.append(
                    f"Static alignment ({name} rows) stood out in {len(items)} subspaces: " + "; ".join(items[:SHOWN])
                    + more + "."
                )  # fmt: skip
    return lines


def _reach(rows, name: str) -> str:
    """Why nothing could stand out, when a lone row cannot: the Monte-Carlo p's floor times the family."""
    draws = rows["verdict_draws"].dropna() if "verdict_draws" in rows else []
    m = _hypotheses(rows)
    if not len(draws) or not m:
        return f"No {name} row differs from its null (none had enough sequences for a verdict)."
    K = int(draws.max())
    floor = 2 / (K + 1)
    best = min(1.0, floor * m)
    said = f"No {name} row differs from its null: a verdict needs q_tilt &lt; {ALPHA}; "
    if best < ALPHA:
        return said + f"a lone row could reach q {_p(best)} here (p_tilt ≥ {_p(floor)}, K = {K}, {m} hypotheses)."
    need = math.ceil(2 * m / ALPHA - 1)
    return (
        said + f"with K = {K} null draws p_tilt ≥ {_p(floor)}, so a lone row among {m} hypotheses could reach at best "
        f"q {_p(best)}, not {ALPHA} (verdict_draws={need} or more lets it)."
    )


def _readouts(doc: dict) -> list[tuple[str, dict]]:
    from .direction_report import shown_parts

    out = [(f"layer {r['layer']} v_1", r) for r in doc.get("layers", [])]
    for p in shown_parts(doc.get("parts", [])):
        if p.get("readout"):
            part = f"head {p['index']}" if p["part"] == "head" else f"group {p['index']} (heads {p['heads']})"
            out.append((f"layer {p['layer']} {part}", p["readout"]))
    return out


def _tokens(r: dict, n: int = 5) -> str:
    return " ".join(repr(t) for t, _ in r["top"][:n])


def readout_findings(doc: dict | None) -> tuple[str, list[tuple[str, dict]]]:
    """(the sentence, the readouts above their null after BH, strongest first)."""
    if not doc:
        return "", []
    reads = _readouts(doc)
    n = doc.get("readouts_corrected")
    if n is None:  # a directions.json written before p-values: no correction possible
        return "Token readouts: this run's directions.json has no p-values (written by an older eigenhooks).", []
    hits = sorted(
        [(w, r) for w, r in reads if r.get("q", math.nan) < ALPHA],
        key=lambda x: (x[1]["p"], -x[1]["score"]),
    )
    if hits:
        return (
            f"<b>{len(hits)} of {n} token readouts</b> stand above their Haar null after Benjamini-Hochberg over all "
            f"{n} (q &lt; {ALPHA}; p from the null's concentration tail, docs/concepts.md):",
            hits,
        )
    return "No v_1, head or group subspace reads as tokens above its null " + _needed(reads, n) + ".", []


def _needed(reads: list[tuple[str, dict]], n: int) -> str:
    """The score a lone readout would have needed to pass BH over n: p <= alpha / n."""
    from ..spectra.tail import score_needed

    said = []
    for kind in ("direction", "plane"):
        r = next((r for _, r in reads if reads_as(r) == kind and r.get("null_mean") is not None), None)
        if r is None:
            continue
        need = score_needed(
            ALPHA / n, r["null_mean"], r["null_sd"], r["null_draws"], r["d"], 1 if kind == "direction" else 2
        )
        band = f"its null's 95% band {_f(r['null_lo'])}–{_f(r['null_hi'])}"
        if need > 1:  # a score is a mean of cosines or projection norms: at most 1
            said.append(f"no {kind} could have ({band}; in d = {r['d']} the tail bound allows no score up to 1)")
        else:
            said.append(f"a {kind} would have needed a score of {_f(need)} ({band})")
    return f"after Benjamini-Hochberg over {n} readouts: " + ("; ".join(said) or "no null was drawn")


def copying_line(doc: dict | None, n: int = 5) -> str:
    """The strongest copying heads by circuit copying; the score has no null."""
    heads = [
        p
        for p in (doc or {}).get("parts", [])
        if p["part"] == "head" and math.isfinite(p.get("circuit_copying", math.nan))
    ]
    if not heads:
        return ""
    top = sorted(heads, key=lambda p: -p["circuit_copying"])[:n]
    items = ", ".join(f"layer {p['layer']} head {p['index']} {p['circuit_copying']:.3f}" for p in top)
    return (
        f"Strongest copying heads by circuit copying: {items}. Circuit copying has no null: it describes a head, "
        "it tests nothing."
    )


def _nothing_above(rows, name: str) -> str:
    """'Nothing above X': the smallest lifts the rows would have been called at, when the run has them."""
    said = []
    for col, what in DETECTABLE.items():
        x = rows[col].replace([math.inf, -math.inf], math.nan).dropna() if col in rows else []
        if len(x):
            lo, hi = float(x.min()), float(x.max())
            said.append(f"{what} {_s(lo, False)}" + (f"–{_s(hi, False)}" if hi > lo else ""))
    if not said:
        return ""
    return (
        f"No {name} row differs from its null: nothing above {' or '.join(said)} over the null's median (the "
        "smallest each row would have been called at, 80% power, its error across sequences included)."
    )


def _finding_table(hits: list[tuple[str, dict]]) -> str:
    head = ["subspace", "reads as", "score", "null band (95%)", "p", "q", "top tokens"]
    th = "".join(f"<th>{h}</th>" for h in head)

    def row(w, r):
        toks = _tokens(r, 10)
        cells = [w, reads_as(r), _f(r["score"]), f"{_f(r['null_lo'])}–{_f(r['null_hi'])}", _p(r["p"]), _p(r["q"])]
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        short = _tokens(r, 4)
        return f'<tr>{tds}<td class="tokens" title="{html.escape(toks)}">{html.escape(short)}</td></tr>'

    return f'<table class="findings"><tr>{th}</tr>{"".join(row(w, r) for w, r in hits)}</table>'


def stood_out(df, doc: dict | None) -> str:
    """The report's first section (HTML)."""
    items = [f"<li>{line}</li>" for line in verdict_lines(df)]
    said, hits = readout_findings(doc)
    if said:
        body = said
        if hits:
            body += _finding_table(hits[:SHOWN])
            if len(hits) > SHOWN:
                body += (
                    f'<details id="findings-more"><summary>the other {len(hits) - SHOWN} readouts above their null'
                    f"</summary>{_finding_table(hits[SHOWN:])}</details>"
                )
        items.append(f'<li id="stood-out-readouts">{body}</li>')
    line = copying_line(doc)
    if line:
        items.append(f"<li>{html.escape(line)}</li>")
    return f'<section id="stood-out"><h2>What stood out</h2><ul>{"".join(items)}</ul></section>'


def _plain(line: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", line))


def stood_out_text(df, doc: dict | None, shown: int = 5) -> list[str]:
    """The first screen in plain lines, for the terminal after ``eigenhooks run`` (the report has it all)."""
    lines = [_plain(x) for x in verdict_lines(df)]
    said, hits = readout_findings(doc)
    if said:
        lines.append(_plain(said).rstrip(":") + ("; the strongest:" if hits else ""))
        for w, r in hits[:shown]:
            lines.append(
                f"  {w}: {reads_as(r)}, score {_f(r['score'])} (null {_f(r['null_lo'])}–{_f(r['null_hi'])}), "
                f"q {_p(r['q'])}; {_tokens(r, 4)}"
            )
        if len(hits) > shown:
            lines.append(f"  and {len(hits) - shown} more (report.html)")
    lines += [x for x in (copying_line(doc),) if x]
    return lines


def laid_out(lines: list[str], width: int | None) -> list[str]:
    """``stood_out_text`` as the terminal shows it: a bullet per finding, each stood-out subspace on a line of
    its own, every line wrapped at ``width`` between words (a number is never split; None, piped: unwrapped).
    The run table is above these lines, so a pointer to "the tables below" (the report's) points at it."""
    import textwrap

    out = []
    for line in lines:
        line = line.replace("(the tables below)", "(the table above, and summary.csv)")
        split = re.search(r"stood out in \d+ subspaces: ", line)  # a list of stood-out subspaces follows
        head, sep, listed = (line[: split.end()], " ", line[split.end() :]) if split else (line, "", "")
        items = [("- ", head.rstrip())] if sep else [("- " if not line.startswith("  ") else "   ", line.strip())]
        if sep:
            more = re.search(r" and \d+ more \(.*\)\.$", listed)
            listed = listed[: more.start()] if more else listed.rstrip(".")
            items += [("   ", x) for x in listed.split("; ")] + (
                [("   ", more.group(0)[1:].rstrip("."))] if more else []
            )
        for lead, text in items:
            rest = " " * (len(lead) + 2)
            out += textwrap.wrap(text, width, initial_indent=lead, subsequent_indent=rest, break_long_words=False,
                                 break_on_hyphens=False) if width else [lead + text]  # fmt: skip
    return out


def print_stood_out(df, run_dir, console=None) -> None:
    """``stood_out_text`` of a run folder on stdout, under "what stood out:", laid out for the terminal
    (``laid_out``)."""
    import typer
    from rich.console import Console

    from . import direction_report

    console = console or Console()
    typer.echo("what stood out:")
    for line in laid_out(
        stood_out_text(df, direction_report.read(run_dir)), console.width if console.is_terminal else None
    ):
        typer.echo(line)

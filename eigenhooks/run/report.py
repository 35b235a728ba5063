"""A self-contained HTML report of a run folder: table, plots (embedded) and metadata.

``build_report(run_dir)`` reads summary.csv, meta.json and the PNG plots written by
``eigenhooks run`` and writes report.html beside them; ``eigenhooks report DIR`` calls it.
The page opens on the plots (rho by layer with its null band first, then gamma, the eigenvalue
planes, the heat map); the tables follow, folded in ``<details>`` past a few rows. The per-layer
table sits in a scrolling box with a sticky header (a 30-layer run stays readable at 1280 x 800),
verdict cells carry a class and a colour, and a legend says what each column is. No part of the
page is wider than the window: long metadata values wrap, long JSON folds. A folder whose tables do not match its meta.json (``integrity.damage``) gets a
report marked damaged at the top, saying what is wrong. No network: styles and images are inline.
"""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from ..monitor.summary import head_rows, layer_rows
from . import direction_report
from .findings import stood_out
from .integrity import cut_rows, damage
from .table import RUN_COLUMNS

PLOTS = (
    (
        "alignment_modulus.png",
        "The tilt Δγ per layer with its 95% interval over sequences against directions the "
        "stream favours (the verdict's test), then ρ against the Haar null band, then γ (v_1 ranked by |λ|)",
    ),
    ("alignment_residual.png", "The same for v_1 ranked by |1 + λ|: Δγ against the verdict's null, ρ, γ"),
    ("eigenvalues.png", "Eigenvalues of each layer's F in the complex plane"),
    ("heatmap.png", "Per-token alignment, first sequence (tokens x layers)"),
)
# the run table's columns (eigenhooks.run.table), then these raw ones
# the run table's columns but kind and |λ1| (in the raw columns below it): the table fits 1280 px
REPORT_COLUMNS = tuple(c for c in RUN_COLUMNS if c[0] not in ("kind", "|λ1|"))
EXTRA = (
    "kind",
    "abs_lambda_1",
    "k",
    "gap_ratio",
    "n_tokens",
    "n_sequences",
    "design_effect",
    "null_rho_mean",
    "lift",
    "lift_ci_lo",
    "lift_ci_hi",
    "fnull_rho_mean",
    "fnull_percentile",
    "eig_rho_median",
    "gamma_pre_percentile",
    "rho_norm_only",
    "p_binom",
    "consensus_post",
)
# what each column of the run table is, in a line (the legend under the table)
LEGEND = {
    "layer": "attention layer, 0 = the first",
    "target": "the direction measured: v_1 of F = O V ranked by |λ| (ov/modulus) or by |1 + λ| (ov/residual)",
    "Δγ [95% CI]": "the tilt, the verdict's test: mean over the verdict's scoring tokens of a(mid) − a(pre), "
    "a(x) = ||Uᵀx|| / ||x||; its 95% interval is a cluster bootstrap over sequences (the sequence is the unit)",
    "null Δγ 95%": "where Δγ falls for directions drawn from the residual stream's own covariance at the layer "
    "(estimated on the other half of the sequences): directions the stream already favours",
    "q": "Benjamini-Hochberg q of Δγ's two-sided rank among those directions, over the table's distinct "
    "(layer, subspace) rows",
    "verdict": "toward / away when q < 0.05 (attention moves tokens toward the subspace more / less than toward "
    "the stream's own directions), else indistinguishable; too few sequences below 10 in either half; no mid "
    "reading when the run read no 'mid'",
    "γ pre (static)": "mean alignment before the attention step on the scoring tokens; above / below when it "
    "differs from the same null at q_static < 0.05 (the stream already points along it): verdict_static",
    "eig pct": "Δγ's percentile among F's own other top eigen-subspaces: 1 = v_1 tilts most among them",
    "ρ [95% CI]": "share of tokens the attention step tilted toward the subspace; cluster-robust interval "
    "(the sequence is the cluster)",
    "null ρ 95% (ρ there)": "where ρ falls for Haar-random subspaces of the same dimension, on every "
    "null_stride-th token of each sequence, the target's ρ there in brackets: descriptive (not the verdict)",
    "kind": "real-dominant (λ1 real), complex-dominant (λ1 complex: its plane, k = 2) or near-degenerate "
    "(gap ratio above 0.99)",
    "|λ1|": "modulus of the principal eigenvalue of F",
}
VERDICTS = ("toward", "away", "indistinguishable", "too few sequences", "no mid reading")
LEFT = {"target", "kind", "verdict"}
CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { margin-bottom: .2em; }
table { border-collapse: collapse; font-size: 13px; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; }
.tablebox { overflow: auto; max-height: 70vh; width: fit-content; max-width: 100%; border: 1px solid #bbb; margin: .5em 0; }
.tablebox table { border-collapse: separate; border-spacing: 0; margin: 0; }
.tablebox td, .tablebox th { border: 0; border-right: 1px solid #e2e2e2; border-bottom: 1px solid #e2e2e2; padding: 3px 5px; }
.tablebox thead th { position: sticky; top: 0; z-index: 2; background: #eceff3; border-bottom: 1px solid #aaa; }
.tablebox .key { position: sticky; left: 0; z-index: 1; background: #fff; text-align: left; }
.tablebox thead th.key { z-index: 3; background: #eceff3; }
.tablebox tr.odd td { background: #f8f8f8; }
td.left, th.left { text-align: left; }
td.verdict { font-weight: 600; text-align: left; }
.tablebox tr td.v-toward, .chip.v-toward { background: #d4efd9; color: #14532d; }
.tablebox tr td.v-away, .chip.v-away { background: #fbd9cb; color: #7c2d12; }
.tablebox tr td.v-indistinguishable, .chip.v-indistinguishable { color: #666; font-weight: 400; background: #f1f1f1; }
.tablebox tr td.v-too-few-sequences, .chip.v-too-few-sequences { color: #666; font-weight: 400; font-style: italic; background: #fdf6d8; }
.tablebox tr td.v-no-mid-reading, .chip.v-no-mid-reading { color: #666; font-weight: 400; font-style: italic; background: #fdf6d8; }
.legend { display: grid; grid-template-columns: max-content 1fr; gap: 1px 12px; font-size: 13px; margin: .5em 0 1em; }
.legend dt { font-weight: 600; } .legend dd { margin: 0; color: #444; }
.chip { display: inline-block; padding: 0 6px; border-radius: 3px; font-weight: 600; }
.damaged { border: 2px solid #b91c1c; background: #fef2f2; color: #7f1d1d; padding: .5em 1em; margin: 1em 0; }
.damaged ul { margin: .3em 0; }
figure { margin: 1em 0; } img { max-width: 100%; height: auto; }
details > summary { cursor: pointer; margin: .4em 0; }
table.meta { table-layout: fixed; width: 100%; }
table.meta th { width: 11em; text-align: left; vertical-align: top; }
table.meta td { text-align: left; white-space: normal; overflow-wrap: anywhere; }
table.meta pre { margin: 0; white-space: pre-wrap; overflow-wrap: anywhere; font-size: 12px; }
figcaption, .note { color: #555; font-size: 13px; }
#stood-out { background: #f6f8fb; border: 1px solid #d6dde8; padding: .2em 1em .4em; margin: .8em 0; }
#stood-out h2 { margin: .4em 0 .2em; font-size: 1.25em; }
#stood-out ul { margin: .2em 0; padding-left: 1.2em; } #stood-out li { margin: .3em 0; font-size: 14px; }
table.findings { margin: .3em 0; font-size: 12.5px; }
td.tokens { text-align: left; white-space: normal; min-width: 10em; max-width: 22em; overflow-wrap: break-word; }
"""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if (abs(v) < 1e-3 and v != 0) else f"{v:.4f}"
    return html.escape(str(v))


class ReportError(RuntimeError):
    """A run folder has nothing to report (yet), or cannot be read; the message says why."""


def _read_meta(run_dir: Path) -> dict | None:
    p = run_dir / "meta.json"
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
    except ValueError as e:
        raise ReportError(f"{p} is not valid JSON ({e}): the run folder is damaged") from e
    if not isinstance(meta, dict):
        raise ReportError(f"{p} holds a JSON {type(meta).__name__}, not an object: the run folder is damaged")
    return meta


def _status(run_dir: Path, meta: dict) -> str:
    """The run's status line, or ReportError when there is nothing to report."""
    status = meta.get("status") or ("interrupted" if meta.get("interrupted") else "complete")
    stage = meta.get("stage", "?")
    if status == "running":
        pid = meta.get("pid")
        raise ReportError(
            f"{run_dir} is still being written (status running, stage {stage}, pid {pid}) "
            "or its process was killed: nothing to report; wait for it, or run again"
        )
    if not (run_dir / "summary.csv").exists():
        if status in ("interrupted", "failed"):
            why = f": {meta['error']}" if meta.get("error") else ""
            raise ReportError(
                f"{run_dir} holds no statistics: the run was {status} at stage {stage} before any forward was measured{why}"
            )
        raise FileNotFoundError(f"{run_dir} has no summary.csv: not an eigenhooks run folder")
    if status == "interrupted":
        return f"interrupted at stage {stage}: partial results ({meta.get('forwards', '?')} forwards)"
    if status == "failed":
        return f"failed at stage {stage}: {meta.get('error', 'unknown error')}"
    if status != "complete":  # ``integrity.damage`` lists it as damage
        return f"status {status!r} unknown"
    return "complete"


def _read_summary(run_dir: Path):
    import pandas as pd

    p = run_dir / "summary.csv"
    try:
        df = pd.read_csv(p)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as e:  # EmptyDataError is a ValueError
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ReportError(f"{p} cannot be read ({why}): the run folder is damaged; run it again") from e
    missing = [c for c in ("layer", "target") if c not in df.columns]
    if missing:
        raise ReportError(f"{p} has no column {missing[0]!r}: not a summary, or cut in its header; run it again")
    return df


def inspect(run_dir) -> tuple[dict | None, object, list[str]]:
    """(meta.json or None, summary.csv as a DataFrame, what is wrong with the folder: ``integrity.damage``).

    Raises:
        FileNotFoundError: no such folder, or a folder that is not a run.
        ReportError: the run is still running (or was killed), stopped before measuring
            anything, or its meta.json or summary.csv cannot be read at all.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}")
    meta = _read_meta(run_dir)
    if meta is not None:
        _status(run_dir, meta)
    elif not (run_dir / "summary.csv").exists():
        raise FileNotFoundError(f"{run_dir} has neither meta.json nor summary.csv: not an eigenhooks run folder")
    df = _read_summary(run_dir)
    return meta, df, damage(run_dir, meta, df)


def build_report(run_dir) -> Path:
    """Write run_dir/report.html (one file, images inlined). Returns its path.

    A folder whose tables do not match its meta.json is reported anyway, marked damaged at the
    top with what is wrong (``inspect`` says the same to a program).

    Raises:
        FileNotFoundError: no such folder, or a folder that is not a run.
        ReportError: the run is still running (or was killed), stopped before measuring
            anything, or its meta.json or summary.csv cannot be read at all.
    """
    run_dir = Path(run_dir)
    meta, df, problems = inspect(run_dir)
    status = _status(run_dir, meta) if meta is not None else "status unknown (no meta.json)"
    if problems:
        status = f"damaged ({len(problems)} problem{'s' if len(problems) > 1 else ''}, listed above); {status}"
    whole = df.drop(index=df.index[cut_rows(df)])  # a row cut mid-line has no cells to show
    model = str(meta.get("model", "?")) if meta is not None else "unknown (meta.json is missing)"
    page = _page(run_dir, meta or {}, whole, model, status, problems)
    out, tmp = run_dir / "report.html", run_dir / ".report.html.tmp"
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)  # a full disk leaves the old report or none, never a cut-off one
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _banner(problems: list[str]) -> str:
    if not problems:
        return ""
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return (
        f'<div class="damaged" role="alert" id="damaged"><b>Damaged run folder.</b> '
        f"The numbers below may be incomplete or belong to another run:<ul>{items}</ul>"
        "Run it again to trust them.</div>"
    )


FOLD = 8  # a table of more rows than this opens folded


def _fold(summary: str, body: str, rows: int, ident: str) -> str:
    """``body`` in a <details> saying ``summary``: open when it has at most FOLD rows."""
    return f'<details id="{ident}"{" open" if rows <= FOLD else ""}><summary>{summary}</summary>{body}</details>'


def _verdict_counts(df) -> str:
    counts = df["verdict"].value_counts() if "verdict" in df else {}
    return ", ".join(
        f'<span class="chip v-{v.replace(" ", "-")}">{counts[v]} {v}</span>' for v in VERDICTS if counts.get(v, 0)
    )


def _run_table(df) -> str:
    from .table import rows as table_rows

    heads, cells = table_rows(df, REPORT_COLUMNS)
    head = "".join(f'<th class="{"left" if h in LEFT else ""}" scope="col">{html.escape(h)}</th>' for h in heads)
    body, last = [], None
    odd = False
    for row, layer in zip(cells, df["layer"].tolist()):
        odd = odd if layer == last else not odd  # shade by layer, so a layer's targets read as one block
        last = layer
        tds = []
        for h, c in zip(heads, row):
            if h == "verdict":
                v = next((v for v in VERDICTS if c.startswith(v)), None)  # "too few tokens (5 < 64)"
                cls = f"verdict v-{v.replace(' ', '-')}" if v else "verdict"
                tds.append(f'<td class="{cls}">{html.escape(c)}</td>')
            else:
                tds.append(f'<td class="{"left" if h in LEFT else ""}">{html.escape(c)}</td>')
        body.append(f'<tr class="{"odd" if odd else ""}">{"".join(tds)}</tr>')
    box = (
        f'<div class="tablebox" id="per-layer-box"><table id="per-layer"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
    said = f"{len(cells)} rows ({df['layer'].nunique()} layers): {_verdict_counts(df)}"
    return _fold(said, box + _legend(), len(cells), "per-layer-fold")


EXTRA_WIDTH = 120  # characters of headers side by side in one raw table: about 950 px at 13 px


def column_groups(columns: list[str], width: int = EXTRA_WIDTH) -> list[list[str]]:
    """``columns`` in runs whose headers (each at least 8 characters wide, as its numbers) fit ``width``."""
    groups: list[list[str]] = [[]]
    used = 0
    for c in columns:
        w = max(len(c), 8) + 2
        if groups[-1] and used + w > width:
            groups.append([])
            used = 0
        groups[-1].append(c)
        used += w
    return groups


def _extra_table(df) -> str:
    from .table import fmt_num, fmt_p

    extra = [c for c in EXTRA if c in df.columns]
    if not extra:
        return ""
    fmt = lambda c, v: fmt_p(v) if c.startswith("p_") else (_fmt(v) if not isinstance(v, float) else fmt_num(v, 4))
    records = df.to_dict("records")
    boxes = []
    for i, cols in enumerate(column_groups(extra)):  # side by side they would scroll sideways: one under another
        head = '<th class="key" scope="col">layer · target</th>' + "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            f'<tr><td class="key">{int(r["layer"])} · {html.escape(str(r["target"]))}</td>'
            + "".join(f"<td>{fmt(c, r[c])}</td>" for c in cols)
            + "</tr>"
            for r in records
        )
        boxes.append(
            f'<div class="tablebox" id="extra-box-{i}"><table id="extra-{i}" class="extra"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>"
        )
    note = f'<p class="note">Raw columns of summary.csv (all of them are in the file), in {len(boxes)} tables.</p>'
    said = f"{len(df)} rows x {len(extra)} columns"
    return "<h3>More columns</h3>" + _fold(said, note + "".join(boxes), len(df), "extra-fold")


def _legend() -> str:
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in LEGEND.items())
    chips = " ".join(f'<span class="chip v-{v.replace(" ", "-")}">{v}</span>' for v in VERDICTS)
    return (
        f'<dl class="legend" id="legend">{items}</dl>'
        f'<p class="note">Verdict cells: {chips}. A claim that v_1 is special also needs a low eig rank and a '
        "high fnull_percentile (summary.csv). p_binom tests ρ = 0.5 token by token for this fixed direction: "
        "it is not a test of v_1.</p>"
    )


def _figures(run_dir: Path) -> list[str]:
    figs = []
    for name, caption in PLOTS:
        p = run_dir / name
        if p.exists():
            data = base64.b64encode(p.read_bytes()).decode()
            figs.append(
                f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    return figs


LONG = 160  # a metadata value longer than this (as JSON) folds, its first characters showing


def _meta_value(v) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    if len(text) <= LONG:
        return html.escape(text)
    whole = v if isinstance(v, str) else json.dumps(v, indent=1)
    return f"<details><summary>{html.escape(text[:100])} …</summary><pre>{html.escape(whole)}</pre></details>"


def _page(run_dir: Path, meta: dict, df, model: str, status: str, problems: list[str]) -> str:
    figs = _figures(run_dir)
    meta_rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_meta_value(v)}</td></tr>" for k, v in meta.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>eigenhooks run: {html.escape(model)}</title>
<style>{CSS}</style></head>
<body data-images="{len(figs)}" data-damaged="{len(problems)}">
<h1>eigenhooks run</h1>
{_banner(problems)}
<p>Model <b>{html.escape(model)}</b>, {html.escape(status)}.</p>
{stood_out(df, direction_report.read(run_dir))}
<h2>Plots</h2>
{"".join(figs)}
<h2>Per layer</h2>
{_run_table(layer_rows(df))}
{_extra_table(layer_rows(df))}
{direction_report.section(run_dir, FOLD, head_rows(df))}
<h2>Run</h2>
<table class="meta">{meta_rows}</table>
<script>
window.addEventListener("load", function () {{
  var imgs = Array.from(document.images);
  var ok = imgs.filter(function (i) {{ return i.complete && i.naturalWidth > 0; }}).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + imgs.length);
}});
</script>
</body></html>
"""

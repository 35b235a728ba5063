"""A self-contained HTML report of a run folder: table, plots (embedded) and metadata.

``build_report(run_dir)`` reads summary.csv, meta.json and the PNG plots written by
``eigenhooks run`` and writes report.html beside them; ``eigenhooks report DIR`` calls it.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

PLOTS = (
    ("alignment_modulus.png", "rho per layer with its 95% CI against the Haar null band (ranked by |lambda|)"),
    ("alignment_residual.png", "rho per layer with its 95% CI against the Haar null band (ranked by |1 + lambda|)"),
    ("eigenvalues.png", "Eigenvalues of each layer's F in the complex plane"),
    ("heatmap.png", "Per-token alignment, first sequence (tokens x layers)"),
)
# the run table's columns (eigenhooks.run.table), then these raw ones
EXTRA = (
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


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if (abs(v) < 1e-3 and v != 0) else f"{v:.4f}"
    return html.escape(str(v))


class ReportError(RuntimeError):
    """A run folder has nothing to report (yet); the message says why."""


def _read_meta(run_dir: Path) -> dict:
    p = run_dir / "meta.json"
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise ReportError(f"{p} is not valid JSON ({e}): the run folder is damaged") from e


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
    return "complete"


def build_report(run_dir) -> Path:
    """Write run_dir/report.html (one file, images inlined). Returns its path.

    Raises:
        FileNotFoundError: no such folder, or a folder that is not a run.
        ReportError: the run is still running (or was killed), or stopped before measuring anything.
    """
    import pandas as pd

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}")
    meta = _read_meta(run_dir)
    status = _status(run_dir, meta)
    df = pd.read_csv(run_dir / "summary.csv")
    from .table import fmt_num, fmt_p
    from .table import rows as table_rows

    heads, cells = table_rows(df)
    extra = [c for c in EXTRA if c in df.columns]
    fmt = lambda c, v: fmt_p(v) if c.startswith("p_") else (_fmt(v) if not isinstance(v, float) else fmt_num(v, 4))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [*heads, *extra])
    recs = df.to_dict("records")
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in row)
        + "".join(f"<td>{fmt(c, r[c])}</td>" for c in extra)
        + "</tr>"
        for row, r in zip(cells, recs)
    )
    figs = []
    for name, caption in PLOTS:
        p = run_dir / name
        if p.exists():
            data = base64.b64encode(p.read_bytes()).decode()
            figs.append(
                f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    meta_rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v) if not isinstance(v, str) else v)}</td></tr>"
        for k, v in meta.items()
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>eigenhooks run: {html.escape(str(meta.get("model", run_dir.name)))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 13px; }}
</style></head>
<body data-images="{len(figs)}">
<h1>eigenhooks run</h1>
<p>Model <b>{html.escape(str(meta.get("model", "?")))}</b>, {html.escape(status)}.
gamma: mean alignment ||U^T x|| / ||x|| with the layer's principal subspace; rho: share of tokens
whose alignment grows across the attention step, with its cluster-robust 95% interval (the sequence
is the cluster). null rho 95%: where rho falls for Haar-random subspaces of the same dimension on
the same tokens; pct: rho's percentile among them; p_null / q_null: two-sided Monte-Carlo p-value
and its Benjamini-Hochberg q over layers; eig rank: rho's rank among F's own top eigen-directions
(1 = highest); verdict at q_null &lt; 0.05. p_binom tests rho = 0.5 token by token for this fixed
direction: it is not a test of v_1.</p>
<h2>Per layer</h2>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<h2>Plots</h2>
{"".join(figs)}
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
    out = run_dir / "report.html"
    out.write_text(page)
    return out

"""report.html of a 30-layer model opens on what matters, read from the page headless Chromium renders
at 1280 px: the rho-by-layer plot first (its top within 900 px of the page's), then gamma, the
eigenvalue planes and the heat map; the tables after the plots, folded; nothing wider than the window;
every metadata value visible; heat-map labels of 9 px or more. The markers of the rho plot are checked
on the figure itself: beside the point they mark, inside the axes."""

from __future__ import annotations

import html
import json
import re
import subprocess

import pandas as pd
import pytest
from thirty_layers import thirty_layer_folder

from eigenhooks.run import run

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (pip install 'eigenhooks[plot]')")

PLOTS = ["alignment_modulus.png", "alignment_residual.png", "eigenvalues.png", "heatmap.png"]

MEASURE = """<script>
window.addEventListener("load", function () {
  function r(el) { var b = el.getBoundingClientRect();
    return {left: b.left, right: b.right, top: b.top + window.scrollY, bottom: b.bottom + window.scrollY}; }
  var m = {vw: window.innerWidth, pageW0: document.documentElement.scrollWidth};
  m.imgs = Array.from(document.images).map(function (i) {
    var x = r(i); x.alt = i.alt; x.natural = i.naturalWidth; x.width = i.getBoundingClientRect().width; return x; });
  m.folds = {};
  ["per-layer-fold", "extra-fold"].forEach(function (id) {
    var d = document.getElementById(id); m.folds[id] = r(d); m.folds[id].open = d.open;
    m.folds[id].rows = d.querySelector("table").querySelectorAll("tbody tr").length;
    m.folds[id].tables = d.querySelectorAll("table").length; });
  m.firstTable = r(document.querySelector("table"));
  document.querySelectorAll("details").forEach(function (d) { d.open = true; });
  m.pageW1 = document.documentElement.scrollWidth;
  m.cells = 0; m.off = [];  // every table cell, folded ones opened: it and its content inside the window and its box
  document.querySelectorAll("td, th").forEach(function (c) {
    m.cells += 1;
    var b = c.getBoundingClientRect(), limit = document.documentElement.clientWidth;
    for (var el = c.parentElement; el && el !== document.body; el = el.parentElement) {
      if (getComputedStyle(el).overflowX !== "visible") limit = Math.min(limit, el.getBoundingClientRect().right);
    }
    var text = document.createRange(); text.selectNodeContents(c);
    var end = Math.max(b.right, text.getBoundingClientRect().right);  // where the content ends, shown or not
    var cut = c.scrollWidth > c.clientWidth + 1;  // content hidden by the cell's own box (an ellipsis too)
    if (end > limit + 1 || cut) m.off.push([c.innerText.slice(0, 60), end, limit, cut]);
  });
  m.sideways = Array.from(document.querySelectorAll("div")).filter(function (d) {
    return d.scrollWidth > d.clientWidth + 1; }).map(function (d) { return d.id; });
  m.meta = Array.from(document.querySelectorAll("table.meta td")).map(function (td) {
    var x = r(td); x.scrollW = td.scrollWidth; x.clientW = td.clientWidth; x.text = td.innerText;
    var pre = td.querySelector("pre"); if (pre) { x.pre = r(pre); x.preScrollW = pre.scrollWidth; x.preClientW = pre.clientWidth; }
    return x; });
  document.body.setAttribute("data-measure", JSON.stringify(m));
});
</script></body>"""


@pytest.fixture(scope="module")
def thirty(tmp_path_factory):
    root = tmp_path_factory.mktemp("r30")
    model = thirty_layer_folder(root / "model")
    res = run(str(model), max_tokens=1024, out=root / "run", progress=False, heads=True)
    assert res.status == "complete" and res.summary["layer"].nunique() == 30
    return root / "run"


@pytest.fixture
def long_tokens(thirty, tmp_path):
    """The thirty-layer run with every token of directions.json 40 characters long: the widest readout
    tables a tokenizer could give, and the report written again from them."""
    import shutil

    from eigenhooks.run.report import build_report

    out = tmp_path / "long"
    shutil.copytree(thirty, out)
    doc = json.loads((out / "directions.json").read_text())
    reads = [r for r in doc["layers"]] + [p["readout"] for p in doc["parts"] if p["readout"]]
    for r in reads:
        for side in ("top", "bottom"):
            r[side] = [[f"{t!r:_<40}", v] for t, v in r[side]]
    (out / "directions.json").write_text(json.dumps(doc))
    build_report(out)
    return out


def _measure(run_dir, tmp_path):
    from .test_main_job import _browser

    browser = _browser()
    if browser is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium); the report was not rendered")
    page = (run_dir / "report.html").read_text()
    (run_dir / "measure.html").write_text(page.replace("</body>", MEASURE))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    cmd += ["--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900"]
    cmd += [f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000", "--dump-dom"]
    dom = subprocess.run(
        [*cmd, (run_dir / "measure.html").as_uri()], capture_output=True, text=True, timeout=180
    ).stdout
    found = re.search(r'data-measure="([^"]*)"', dom)
    assert found, dom[:500]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_the_report_opens_on_the_plots_and_fits_the_window(thirty, tmp_path):
    m = _measure(thirty, tmp_path)
    assert m["vw"] == 1280
    imgs = m["imgs"]
    assert [i["alt"] for i in imgs] == PLOTS  # rho (with gamma below it), then eigenvalues, then the heat map
    assert all(i["natural"] > 0 for i in imgs)
    assert imgs[0]["top"] <= 900  # the rho plot with its null band is on the first screen
    assert all(a["bottom"] <= b["top"] for a, b in zip(imgs, imgs[1:]))
    # the tables come after the plots, folded: 60 rows are more than a few
    assert m["firstTable"]["top"] >= imgs[-1]["bottom"]
    for fold in m["folds"].values():
        assert fold["top"] >= imgs[-1]["bottom"] and fold["open"] is False and fold["rows"] == 60
    assert m["folds"]["extra-fold"]["tables"] >= 2  # the raw columns split into tables that fit, not a scroll
    # no sideways scroll, folded or open; every cell inside the window and its box, a cut one whole on hover
    assert m["pageW0"] <= m["vw"] and m["pageW1"] <= m["vw"]
    assert m["cells"] > 3000 and m["off"] == [] and m["sideways"] == []
    assert all(i["right"] <= m["vw"] for i in imgs)
    # every metadata value on screen: wrapped, or folded with its whole JSON wrapped inside
    meta = json.loads((thirty / "meta.json").read_text())
    assert len(m["meta"]) == len(meta)
    for td in m["meta"]:
        assert td["right"] <= m["vw"] and td["scrollW"] <= td["clientW"] + 1, td["text"][:80]
        if "pre" in td:
            assert td["pre"]["right"] <= m["vw"] and td["preScrollW"] <= td["preClientW"] + 1
    long = [k for k, v in meta.items() if len(json.dumps(v)) > 160]
    assert "adapter" in long and sum("pre" in td for td in m["meta"]) == len(long)
    # the heat map's token labels, as drawn and as scaled into the page
    heat = imgs[-1]
    from PIL import Image

    dpi = Image.open(thirty / "heatmap.png").info["dpi"][0]
    labels = _heatmap_label_points(thirty)
    scale = heat["width"] / heat["natural"]
    assert min(labels) * dpi / 72 * scale >= 9, (min(labels), dpi, scale)


def _heatmap_label_points(run_dir) -> list[float]:
    """The font sizes (pt) of the heat map's tick labels, drawn again from the run's first sequence as
    the run draws it (the PNG keeps no text to read back)."""
    import eigenhooks.plots as plots

    tokens = [f"t{i}" for i in range(128)]
    fig = plots.token_heatmap([[0.1] * 128] * 30, tokens)
    assert fig.get_size_inches()[0] * 110 == pytest.approx(_png_width(run_dir / "heatmap.png"), abs=2)
    return [t.get_fontsize() for ax in fig.axes[:-1] for t in ax.get_xticklabels() + ax.get_yticklabels()]


def _png_width(path) -> int:
    from PIL import Image

    return Image.open(path).size[0]


def test_no_cell_is_off_screen_with_every_fold_open_and_long_tokens(long_tokens, tmp_path):
    """Every table cell of the report and its content inside the 1280 px window and inside its box, folds
    opened, when every token is 40 characters long: token lists wrap between tokens, nothing is cut and
    nothing scrolls sideways. (Token lists cut with an ellipsis, whole only on hover, ended past the window
    in 28 of 6,785 cells of a SmolLM2 run here, 51 in issue 58's)."""
    m = _measure(long_tokens, tmp_path)
    assert m["cells"] > 3000 and m["pageW1"] <= m["vw"]
    assert m["off"] == [] and m["sideways"] == [], (len(m["off"]), m["off"][:5])
    page = (long_tokens / "report.html").read_text()
    doc = json.loads((long_tokens / "directions.json").read_text())
    first = doc["layers"][0]["top"][:10]  # the whole list is in its cell, every token whole
    cell = " ".join(html.escape(repr(t)).replace(" ", "\u00a0") for t, _ in first)
    assert f'<td class="tokens">{cell}</td>' in page and len(first) == 10


def test_verdict_markers_sit_beside_their_points_inside_the_axes():
    import eigenhooks.plots as plots
    from eigenhooks.plots.figures import MARK_SIZE

    nan = float("nan")
    rows = []  # toward at the highest Δγ and away at the lowest: the cases that were cut at the axis
    for layer, (tilt, verdict) in enumerate([(0.05, "toward"), (-0.04, "away"), (0.0, "toward"), (0.001, "away")]):
        rows.append(
            dict(layer=layer, target="ov/modulus", rho=0.5, rho_null_tokens=0.5, verdict=verdict, n_tokens=60,
                 null_tokens=14, rho_ci_lo=0.45, rho_ci_hi=0.55, null_rho_lo=0.2, null_rho_hi=0.8, null_rho_mean=0.5,
                 gamma_pre=0.1, gamma_mid=0.1, null_gamma_pre_lo=0.05, null_gamma_pre_hi=0.15, q_null=nan, tilt=tilt,
                 tilt_ci_lo=tilt - 0.002, tilt_ci_hi=tilt + 0.002, tilt_null_lo=-0.01, tilt_null_hi=0.01,
                 tilt_null_median=0.0)
        )  # fmt: skip
    fig = plots.alignment_by_layer(pd.DataFrame(rows), "modulus")
    fig.set_dpi(110)
    fig.canvas.draw()
    ax = fig.axes[0]  # the verdict's panel: Δγ
    box = ax.get_window_extent()
    px = fig.dpi / 72
    points = {c.get_label(): c for c in ax.collections}
    dot_r = 4 / 2 * px  # the errorbar's marker, ms = 4 points
    centres = ax.transData.transform([(r["layer"], r["tilt"]) for r in rows])
    for verdict in ("toward", "away"):
        marks = points[f"{verdict} (q < 0.05)"]
        where = marks.get_offset_transform().transform(marks.get_offsets())
        r = (MARK_SIZE**0.5) / 2 * px
        for x, y in where:
            assert box.x0 <= x - r and x + r <= box.x1 and box.y0 <= y - r and y + r <= box.y1  # inside the axes
            for cx, cy in centres:  # never on a point (the one it marks, or another)
                assert ((x - cx) ** 2 + (y - cy) ** 2) ** 0.5 >= r + dot_r, (verdict, x, y, cx, cy)


def test_eigenvalue_planes_of_thirty_layers_keep_their_titles_inside():
    """30 panels whose titles are the longest kind and whose ticks are wide (|lambda| ~ 100, as SmolLM2's
    late layers): every title inside the figure, none over its neighbour's."""
    from types import SimpleNamespace

    import torch

    import eigenhooks.plots as plots

    g = torch.Generator().manual_seed(0)
    specs = []
    for layer in range(30):
        ev = (
            torch.complex(
                torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
            )
            * 40
        )
        specs.append(SimpleNamespace(layer=layer, kind="complex-dominant", eigenvalues=ev, lambda_1=complex(ev[0])))
    fig = plots.eigenvalue_planes(specs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.title.get_window_extent(renderer) for ax in fig.axes[:30]]
    page = fig.bbox
    for box, s in zip(boxes, specs):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, s.layer
    for left, right in zip(boxes, boxes[1:]):
        if abs(left.y0 - right.y0) < 1:  # the same row
            assert left.x1 <= right.x0, (left, right)

"""report.html: readable at 1280 x 800 in a real browser, self-contained, and honest about a damaged folder."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess

import pandas as pd
import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run import run
from eigenhooks.run.integrity import table_stamp
from eigenhooks.run.report import build_report, inspect

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real gpt2-tiny runs (4 layers x 2 targets) on different text: same shape, other numbers."""
    root = tmp_path_factory.mktemp("runs")
    a = run("gpt2-tiny", max_tokens=300, batch_size=4, out=root / "a", progress=False)
    b = run("gpt2-tiny", text="def f(x):\n    return x * 2\n" * 40, max_tokens=300, out=root / "b", progress=False)
    assert a.status == b.status == "complete"
    return root / "a", root / "b"


@pytest.fixture
def folder(runs, tmp_path):
    """A fresh copy of run a, to damage."""
    out = tmp_path / "run"
    shutil.copytree(runs[0], out)
    return out


def _report(folder):
    """(CLI exit code, CLI stderr lines, the page) of `eigenhooks report`."""
    r = runner.invoke(app, ["report", str(folder)])
    return r.exit_code, r.output.strip().splitlines(), (folder / "report.html").read_text()


def test_a_whole_folder_is_not_marked(folder):
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tables"]["rows"] == 8 and meta["tables"]["layers"] == 4
    assert inspect(folder)[2] == []
    code, lines, page = _report(folder)
    assert code == 0 and lines == [str(folder / "report.html")]
    assert 'data-damaged="0"' in page and "Damaged run folder" not in page and ", complete." in page


def _cut_rows(folder, keep: int) -> None:
    lines = (folder / "summary.csv").read_text().splitlines(keepends=True)
    (folder / "summary.csv").write_text("".join(lines[: 1 + keep]))


def _damage(folder, runs, how: str) -> str:
    """Damage the copy; return a regex the report's problem list must match."""
    csv = folder / "summary.csv"
    if how == "cut_at_row":  # 2 of 4 layers: the case that used to read "complete"
        _cut_rows(folder, 4)
        return "summary.csv holds 4 rows over 2 layers; meta.json says 8 rows over 4 layers"
    if how == "cut_mid_row":
        data = csv.read_bytes()
        csv.write_bytes(data[: len(data) - 200])
        return r"summary.csv has 1 row\(s\) cut short"
    if how == "no_meta":
        (folder / "meta.json").unlink()
        return "meta.json is missing"
    if how == "duplicated":
        lines = csv.read_text().splitlines(keepends=True)
        csv.write_text("".join([*lines, lines[3]]))
        return r"summary.csv repeats 1 \(layer, target\) row"
    if how == "extra_layer":
        df = pd.read_csv(csv)
        extra = df[df.layer == 3].assign(layer=4)
        pd.concat([df, extra]).to_csv(csv, index=False)
        return "summary.csv holds 10 rows over 5 layers; meta.json says 8 rows over 4 layers"
    if how == "other_meta":  # meta.json of another run of the same model: same shape
        shutil.copyfile(runs[1] / "meta.json", folder / "meta.json")
        return "summary.csv is not the file meta.json recorded"
    if how == "parquet_flipped":
        p = folder / "summary.parquet"
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
        return "summary.parquet is not the file meta.json recorded"
    if how == "parquet_cut":
        p = folder / "summary.parquet"
        p.write_bytes(p.read_bytes()[:500])
        return r"summary.parquet is unreadable \("
    if how == "old_meta_cut":  # a folder from before the tables record: the adapter's layer count still speaks
        meta = json.loads((folder / "meta.json").read_text())
        del meta["tables"]
        (folder / "meta.json").write_text(json.dumps(meta))
        _cut_rows(folder, 4)
        return "summary.csv holds 2 layers, the model has 4"
    raise ValueError(how)


@pytest.mark.parametrize(
    "how",
    [
        "cut_at_row",
        "cut_mid_row",
        "no_meta",
        "duplicated",
        "extra_layer",
        "other_meta",
        "parquet_flipped",
        "parquet_cut",
        "old_meta_cut",
    ],
)
def test_a_damaged_folder_is_marked_with_what_is_wrong(folder, runs, how):
    want = _damage(folder, runs, how)
    problems = inspect(folder)[2]
    assert any(re.search(want, p) for p in problems), problems
    code, lines, page = _report(folder)
    assert code == 1 and len(lines) == 1, lines
    assert (
        lines[0].startswith("eigenhooks: error: ") and f"{folder} is damaged" in lines[0] and re.search(want, lines[0])
    )
    assert 'id="damaged"' in page and "Damaged run folder." in page
    assert ", complete." not in page and "damaged (" in page  # the status line does not say complete
    assert re.search(want, page.replace("&#x27;", "'")), want
    if how == "no_meta":
        assert "Model <b>unknown (meta.json is missing)</b>" in page


def test_an_unreadable_summary_is_refused_in_one_line(folder):
    (folder / "summary.csv").write_bytes(b"")
    code, lines, _ = _report(folder)
    assert code == 1 and len(lines) == 1 and "summary.csv cannot be read" in lines[0]
    (folder / "summary.csv").write_text("lay")  # cut inside the header
    code, lines, _ = _report(folder)
    assert code == 1 and len(lines) == 1 and "has no column 'layer'" in lines[0]


# --- the page at 1280 x 800 ---------------------------------------------------------------------


def _thirty_layers(src, out):
    """A 30-layer run folder (60 rows) from a real run's rows, with some of each verdict."""
    shutil.copytree(src, out)
    df = pd.read_csv(src / "summary.csv")
    big = pd.concat([df.assign(layer=df["layer"] + 4 * i) for i in range(8)])
    big = big[big["layer"] < 30].reset_index(drop=True)
    big.loc[big["layer"] % 5 == 0, "verdict"] = "toward"
    big.loc[big["layer"] % 7 == 3, "verdict"] = "away"
    big.to_csv(out / "summary.csv", index=False)
    big.to_parquet(out / "summary.parquet")
    meta = json.loads((src / "meta.json").read_text())
    meta["tables"] = table_stamp(out, big)
    meta["adapter"]["n_layers"] = 30
    (out / "meta.json").write_text(json.dumps(meta))
    build_report(out)
    assert inspect(out)[2] == []
    return big


MEASURE = """<script>
window.addEventListener("load", function () {
  function r(el) { var b = el.getBoundingClientRect(); return {left: b.left, right: b.right, top: b.top, bottom: b.bottom}; }
  document.querySelectorAll("details").forEach(function (d) { d.open = true; });  // 60 rows open folded
  var box = document.getElementById("per-layer-box"), tab = document.getElementById("per-layer");
  var ths = tab.querySelectorAll("thead th"), m = {vw: window.innerWidth, vh: window.innerHeight};
  m.box = r(box); m.table = r(tab); m.lastTh = r(ths[ths.length - 1]);
  m.box.scrollW = box.scrollWidth; m.box.clientW = box.clientWidth;
  m.box.scrollH = box.scrollHeight; m.box.clientH = box.clientHeight;
  box.scrollTop = box.scrollHeight; m.thAfterScroll = r(ths[0]); m.boxAfterScroll = r(box);
  m.extra = Array.from(document.querySelectorAll("[id^=extra-box-]")).map(function (ex) {
    var x = r(ex); x.scrollW = ex.scrollWidth; x.clientW = ex.clientWidth;
    x.keyFirst = ex.querySelector("tbody td").classList.contains("key"); return x; });
  m.verdicts = {};
  ["toward", "away", "indistinguishable", "too-few-sequences"].forEach(function (v) {
    var cells = tab.querySelectorAll("td.verdict.v-" + v);
    m.verdicts[v] = {n: cells.length, bg: cells.length ? getComputedStyle(cells[0]).backgroundColor : null};
  });
  document.body.setAttribute("data-measure", JSON.stringify(m));
});
</script></body>"""


def _chromium(args, timeout=120):
    from .test_main_job import _browser

    browser = _browser()
    if browser is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium); the report was not rendered")
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    base += ["--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,800"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=timeout)


def test_a_30_layer_table_fits_1280x800(runs, tmp_path):
    out = tmp_path / "r30"
    big = _thirty_layers(runs[0], out)
    page = (out / "report.html").read_text()
    (out / "measure.html").write_text(page.replace("</body>", MEASURE))
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    dom = _chromium([profile, "--virtual-time-budget=5000", "--dump-dom", (out / "measure.html").as_uri()]).stdout
    found = re.search(r'data-measure="([^"]*)"', dom)
    assert found, dom[:500]
    m = json.loads(found.group(1).replace("&quot;", '"'))
    assert m["vw"] == 1280 and m["vh"] >= 600  # headless chromium keeps some of the 800 px for its window
    # the per-layer table: wholly inside the viewport at 1280 px, the verdict column included
    assert m["box"]["right"] <= m["vw"] and m["table"]["right"] <= m["box"]["right"] + 1
    assert m["lastTh"]["right"] <= m["box"]["right"] + 1 and m["box"]["scrollW"] <= m["box"]["clientW"] + 1
    # 60 rows scroll inside their box, which fits the screen, and the header stays on top of it
    assert m["box"]["scrollH"] > m["box"]["clientH"] and m["box"]["bottom"] - m["box"]["top"] <= 0.75 * m["vh"]
    assert abs(m["thAfterScroll"]["top"] - m["boxAfterScroll"]["top"]) <= 2
    # the raw columns: split into boxes inside the viewport, none scrolling sideways, each led by its row's name
    assert len(m["extra"]) >= 2
    for ex in m["extra"]:
        assert ex["right"] <= m["vw"] and ex["scrollW"] <= ex["clientW"] + 1 and ex["keyFirst"]
    # verdict cells: one class per verdict, as many as summary.csv has, three distinct colours
    counts = {v.replace(" ", "-"): n for v, n in big["verdict"].value_counts().to_dict().items()}
    assert {v: c["n"] for v, c in m["verdicts"].items() if c["n"]} == counts
    shown = [c["bg"] for c in m["verdicts"].values() if c["n"]]
    assert len(set(shown)) == len(shown) >= 3  # a colour per verdict shown (a small run's rows: too few tokens)
    # a screenshot at 1280 x 800, to look at (tests/README: how to see it)
    shot = tmp_path / "report-1280x800.png"
    _chromium([profile, "--virtual-time-budget=5000", f"--screenshot={shot}", (out / "report.html").as_uri()])
    head = shot.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1280, 800)


def test_the_report_is_self_contained(runs, tmp_path):
    out = tmp_path / "r30"
    _thirty_layers(runs[0], out)
    page = (out / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", page)
    assert page.count("<style>") == 1 and "<link" not in page
    for col in ("layer", "target", "verdict", "Δγ [95% CI]", "null Δγ 95%", "ρ [95% CI]", "eig pct", "kind"):
        assert f"<dt>{col}</dt>" in page  # the legend names every column of the table

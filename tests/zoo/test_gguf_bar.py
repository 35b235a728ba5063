"""Converting a GGUF draws eigenhooks' bar, never transformers' tqdm one on stderr (issue 41).

transformers' GGUF reader calls ``tqdm.auto`` itself ("Converting and de-quantizing GGUF tensors..."),
out of reach of its own ``disable_progress_bar``, so it wrote under ``--json`` too. The first load and
the rebuild of a damaged converted copy go through eigenhooks' ``progress.track``: a rich bar on a
terminal, nothing when stderr is piped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import eigenhooks as eh
from eigenhooks import progress
from eigenhooks.zoo import gguf

TQDM = "Converting and de-quantizing"


@pytest.fixture
def tracked(monkeypatch):
    """The descriptions and lengths eigenhooks' track was given."""
    seen = []
    real = progress.track

    def track(items, description, total=None, progress=None):
        items = list(items)
        seen.append((description, len(items)))
        return real(items, description, total, progress)

    monkeypatch.setattr(gguf, "track", track)  # the converter's own binding (``from ..progress import track``)
    return seen


def _entry(tmp_path: Path) -> Path:
    (entry,) = [p for p in (tmp_path / "models" / "converted").iterdir() if not p.name.startswith(".")]
    return entry


def test_first_load_and_rebuild_draw_our_bar_not_tqdm(tiny, tracked, capfd, tmp_path):
    eh.load_model(str(tiny[0]))
    (_entry(tmp_path) / "tokenizer.json").unlink()  # a damaged copy: rebuilt from the GGUF
    with pytest.warns(eh.zoo.ModelCacheWarning, match="is damaged"):
        eh.load_model(str(tiny[0]))
    err = capfd.readouterr().err  # transformers' own bars (writing, loading) are the library user's to turn off
    assert TQDM not in err, err
    assert tracked == [("dequantising tiny.gguf", 2 * 9 + 3)] * 2  # 9 tensors a layer, 3 more; twice


def test_cli_json_stderr_holds_no_bar(tiny, tmp_path):
    """A real process, stderr piped: nothing but the JSON on stdout, no bar on stderr."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "EIGENHOOKS_MODELS": str(tmp_path / "models")}
    env.pop("EIGENHOOKS_PROGRESS", None)
    r = subprocess.run(
        [sys.executable, "-m", "eigenhooks", "spectrum", str(tiny[0]), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert TQDM not in r.stderr and "it/s" not in r.stderr, r.stderr

"""Run folders that never lie: built aside, renamed into place, with a status that is always true.

``RunFolder(out).open(meta)`` refuses an ``out`` that already holds a run (unless
``overwrite``), builds the run in the hidden sibling ``.NAME.tmp-PID`` and writes meta.json
at once with ``status: running``. ``stage(name)`` records progress in meta.json.
``finish(status, ...)`` writes the tables, the final status and report.html, then renames
the folder into place: a run killed at any point (even SIGKILL) leaves ``out`` as it was.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)
RUN_FILES = ("meta.json", "summary.csv", "stats.jsonl")
STATUSES = ("running", "complete", "interrupted", "failed")


class RunFolderError(RuntimeError):
    """A run folder cannot be used; the message says why and what to do."""


def holds_run(p: Path) -> bool:
    """True if folder p holds (part of) an eigenhooks run."""
    return p.is_dir() and any((p / f).exists() for f in RUN_FILES)


def json_safe(x):
    """x with every non-finite float replaced by None, so json.dumps writes valid JSON (null, not NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def _write_json(path: Path, obj, indent: int | None = 2) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(json_safe(obj), indent=indent, default=str, allow_nan=False))
    os.replace(tmp, path)  # a reader sees the old meta or the new one, never half of one


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunFolder:
    """One run's folder: refused or replaced, built aside, renamed in at the end.

    Attributes:
        out: where the run ends up.
        path: where it is being written now (the hidden temporary sibling, then ``out``).
        meta: the content of meta.json.
        kept: False if ``finish`` discarded the run (nothing measured; ``out`` left as it was).
    """

    def __init__(self, out: Path, overwrite: bool = False):
        self.out = Path(out)
        self.overwrite = overwrite
        self.path = self.out
        self.meta: dict = {}
        self.kept = True

    def open(self, meta: dict) -> None:
        """Check ``out``, create the temporary folder and write meta.json with status 'running'.

        Raises:
            RunFolderError: ``out`` is a file, a non-empty folder that is no run, or holds a
                run and ``overwrite`` is False.
        """
        out = self.out
        if out.exists() and not out.is_dir():
            raise RunFolderError(f"--out {out} is a file, not a folder: choose another --out")
        if holds_run(out) and not self.overwrite:
            raise RunFolderError(
                f"--out {out} already holds a run (status {self._status_of(out)}): "
                "pass --overwrite to replace it, or choose another --out"
            )
        if out.is_dir() and any(out.iterdir()) and not holds_run(out):
            raise RunFolderError(
                f"--out {out} is a non-empty folder that holds no eigenhooks run: choose another --out"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        self._clean_stale()
        self.path = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()
        self.meta = {"status": "running", "stage": "start", "out": str(out), **meta}
        self.write_meta()

    @staticmethod
    def _status_of(p: Path) -> str:
        try:
            return json.loads((p / "meta.json").read_text()).get("status", "unknown")
        except (OSError, ValueError):
            return "unknown"

    def _clean_stale(self) -> None:
        """Remove temporary folders of earlier runs into the same ``out`` whose process is gone."""
        for p in self.out.parent.glob(f".{self.out.name}.*-*"):
            kind, _, pid = p.name.rpartition("-")
            if kind.endswith((".tmp", ".old")) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    def write_meta(self) -> None:
        _write_json(self.path / "meta.json", self.meta)

    def stage(self, name: str) -> None:
        """Record the stage the run is in (a killed run's meta.json says where it stopped)."""
        self.meta["stage"] = name
        self.write_meta()

    def finish(self, status: str, summary, specs: dict | None, measured: bool) -> None:
        """Write the results and the final status, build the report, and move the folder into place.

        Args:
            status: 'complete', 'interrupted' or 'failed'.
            summary: the summary DataFrame, or None if nothing was measured.
            specs: rank -> list[LayerSpectrum], or None if the spectra were not computed.
            measured: whether any forward was measured. A run that measured nothing and did
                not complete is discarded when it failed, or when ``out`` holds an earlier run.
        """
        if status not in STATUSES[1:]:
            raise ValueError(f"status must be one of {STATUSES[1:]}, got {status!r}")
        if not measured and status != "complete" and (status == "failed" or holds_run(self.out)):
            shutil.rmtree(self.path, ignore_errors=True)
            self.path, self.kept = self.out, False
            return
        if summary is not None:
            _write_tables(self.path, summary, self.meta)
        if specs:
            _write_json(self.path / "spectra.json", _spectra_rows(specs), indent=None)
        self.meta["status"] = status
        self.write_meta()
        if summary is not None:  # else `eigenhooks report` says in one line why there is none
            from .report import build_report

            try:
                build_report(self.path)
            except Exception as e:  # rebuilt with `eigenhooks report`; the status stays true
                log.warning("report.html not written: %s", e)
        self._swap_in()

    def _swap_in(self) -> None:
        out = self.out
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():  # overwrite: the old run goes only once the new one is in place
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(self.path, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, out)
        self.path = out


def _write_tables(path: Path, summary, meta: dict) -> None:
    summary.to_csv(path / "summary.csv", index=False)
    try:
        summary.to_parquet(path / "summary.parquet")
    except ImportError:
        meta["parquet"] = "skipped: pyarrow not installed"
    from .integrity import table_stamp

    meta["tables"] = table_stamp(path, summary)  # rows, layers, SHA-256: `eigenhooks report` checks them


def _spectra_rows(specs: dict) -> list[dict]:
    rows = []
    for rank, ss in specs.items():
        for s in ss:
            rows.append(
                {
                    "layer": s.layer,
                    "variant": s.variant,
                    "rank": rank,
                    "kind": s.kind,
                    "k": s.k,
                    "gap_ratio": s.gap_ratio,
                    "lambda_1": [s.lambda_1.real, s.lambda_1.imag],
                    "eigenvalues": [[z.real, z.imag] for z in s.eigenvalues.tolist()],
                }
            )
    return rows


@contextlib.contextmanager
def deferred_sigint():
    """Hold Ctrl-C while the block runs (the final files are written whole); a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pressed:
            log.info("Ctrl-C pressed %d time(s) while the run folder was written; it was finished first", len(pressed))

"""Run folders that never lie: built aside, renamed into place, with a status that is always true.

``RunFolder(out).open(meta)`` refuses an ``out`` that already holds a run (unless
``overwrite``), builds the run in the hidden sibling ``.NAME.tmp-TAG-PID`` and writes meta.json
at once with ``status: running``. ``stage(name)`` records progress in meta.json.
``finish(status, ...)`` writes the tables, the final status and report.html, then renames
the folder into place: a run killed at any point (even SIGKILL) leaves ``out`` as it was.

A finished run is never replaced by another one that did not ask to replace it. The check at
``open`` is not enough (two runs into one ``out`` both pass it), so the final rename decides:
``os.rename`` of a folder fails when the target is a non-empty folder (POSIX), and a run folder
always holds meta.json, so of two runs racing into a free ``out`` exactly one gets it. The
renames of all runs into one parent folder hold an ``flock`` on that folder, so that an
``--overwrite`` (two renames: the old run aside, the new one in) is never interleaved with
another run's rename. ``--overwrite`` replaces only the run that was in ``out`` when this one
opened. A run that loses the race goes to the first free sibling ``NAME-2``, ``NAME-3`` ...;
``finish`` then raises ``RunFolderError`` naming both folders when ``out`` was named by the
user, and warns (``RunFolderWarning``) when it was a default name.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import secrets
import shutil
import signal
import threading
import warnings
from pathlib import Path

from ..zoo.store import pid_alive
from .integrity import META_FORMAT, STATUSES, files_stamp
from .table import json_safe

log = logging.getLogger(__name__)
RUN_FILES = ("meta.json", "summary.csv", "stats.jsonl")


class RunFolderError(RuntimeError):
    """A run folder cannot be used; the message says why and what to do."""


class RunFolderWarning(UserWarning):
    """A run did not end in the folder first chosen for it (another run took it meanwhile)."""


TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)  # os.rename onto a folder that is in use


def holds_run(p: Path) -> bool:
    """True if folder p holds (part of) an eigenhooks run."""
    return p.is_dir() and any((p / f).exists() for f in RUN_FILES)


def _write_json(path: Path, obj, indent: int | None = 2) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(json_safe(obj), indent=indent, default=str, allow_nan=False))
    os.replace(tmp, path)  # a reader sees the old meta or the new one, never half of one


class RunFolder:
    """One run's folder: refused or replaced, built aside, renamed in at the end.

    Attributes:
        out: where the run ends up (a free sibling if another run took ``out`` meanwhile).
        path: where it is being written now (the hidden temporary sibling, then ``out``).
        meta: the content of meta.json.
        kept: False if ``finish`` discarded the run (nothing measured; ``out`` left as it was).
        named: whether the user chose ``out`` (a run that loses it then fails) or it is a
            default name (the run moves on to a free sibling and warns).
    """

    def __init__(self, out: Path, overwrite: bool = False, named: bool = True):
        self.out = Path(out)
        self.overwrite = overwrite
        self.named = named
        self.path = self.out
        self.meta: dict = {}
        self.kept = True
        self.report_error: str | None = None  # why report.html could not be written, if it could not
        self._replaces = None  # identity of the run in ``out`` at open that --overwrite may replace

    def open(self, meta: dict) -> None:
        """Check ``out``, create the temporary folder and write meta.json with status 'running'.

        Raises:
            RunFolderError: ``out`` is a file, a non-empty folder that is no run, or holds a
                run and ``overwrite`` is False.
        """
        if self.out.is_symlink():  # a link names where the run goes: replace there, never the link itself
            self.out = self.out.resolve()
        out = self.out
        if out.parent.is_dir():
            self._recover()  # before the checks: a restored run is in ``out`` and is refused like any other
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
        self._replaces = _identity(out) if holds_run(out) else None
        # a tag as well as the pid: two runs of one process (threads, a notebook) never share it
        self.path = out.parent / f".{out.name}.tmp-{secrets.token_hex(3)}-{os.getpid()}"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir()
        except OSError as e:
            self.path = out
            raise RunFolderError(
                f"--out {out}: cannot create a folder in {out.parent} ({e.strerror or e}): choose another --out"
            ) from e
        run_id = secrets.token_hex(6)
        self.meta = {"format": META_FORMAT, "status": "running", "stage": "start", "out": str(out), "run_id": run_id}
        self.meta.update(meta)
        self.write_meta()

    @staticmethod
    def _status_of(p: Path) -> str:
        return str(_read_meta(p).get("status", "unknown"))

    def _recover(self) -> None:
        """Deal with the hidden folders of earlier runs into the same ``out`` whose process is gone.

        One still running (or with no readable meta.json) is a partial run: it is removed. A finished
        one (complete, interrupted or failed: the process died while moving it into place, e.g.
        between the two renames of ``--overwrite``) is never deleted as stale: it is renamed into
        ``out`` if ``out`` is free (the newest first), else kept where it is, with a
        ``RunFolderWarning`` either way; an old run that the run now in ``out`` was written to
        replace (``--overwrite``: meta.json's ``replaces``) is removed, as that run asked.
        """
        finished = []
        with _folder_lock(self.out.parent):
            for p in self._leftovers():
                if self._status_of(p) in STATUSES[1:]:
                    finished.append(p)
                else:
                    shutil.rmtree(p, ignore_errors=True)
            finished.sort(key=lambda p: (".old-" in p.name, -p.stat().st_mtime))  # the newest run first
            said = [self._restore(p) for p in finished]
        for msg in filter(None, said):
            warnings.warn(msg, RunFolderWarning, stacklevel=3)

    def _leftovers(self) -> list[Path]:
        """Hidden siblings ``.NAME.tmp-*`` / ``.NAME.old-*`` of runs whose process is gone."""
        mine = re.compile(rf"\.{re.escape(self.out.name)}\.(?:tmp|old)-(?:[0-9a-f]+-)?(\d+)")
        found = []
        for p in self.out.parent.glob(f".{glob.escape(self.out.name)}.*-*"):
            m = mine.fullmatch(p.name)
            if m and p.is_dir() and not p.is_symlink() and not pid_alive(int(m.group(1))):
                found.append(p)
        return found

    def _restore(self, p: Path) -> str | None:
        """Put the finished run ``p`` into ``out`` if it is free, or say where it stays; None if it was replaced."""
        out, status = self.out, self._status_of(p)
        if not holds_run(out) and not out.is_symlink() and _rename_if_free(p, out):
            return f"a finished run (status {status}) left at {p.name} by a process killed while moving it into place was restored to {out}"
        replaced_by = _read_meta(out).get("replaces") if holds_run(out) else None
        if ".old-" in p.name and replaced_by is not None and replaced_by == _read_meta(p).get("run_id"):
            shutil.rmtree(p, ignore_errors=True)  # --overwrite asked for it to go; its successor is in place
            return None
        return (
            f"a finished run (status {status}) is kept at {p}, left by a process killed while moving it into "
            f"place ({out} is taken): move it where you want it, or delete it"
        )

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

        Raises:
            RunFolderError: another run took ``out`` (named by the user) while this one ran;
                this run is then whole in a free sibling folder, which the message names.
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
        self.meta["files"] = files_stamp(self.path)  # stats.jsonl, spectra.json, plots: `eigenhooks report` checks
        self.meta["status"] = status
        self.write_meta()
        if summary is not None:  # else `eigenhooks report` says in one line why there is none
            from .report import build_report

            try:
                build_report(self.path)
            except Exception as e:  # rebuilt with `eigenhooks report`; the status (of the measurement) stays true
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
                self.report_error = f"report.html not written ({why})"
                self.meta["report"] = f"not written: {why}"
                with contextlib.suppress(OSError):
                    self.write_meta()
        wanted = self.out
        other = self._swap_in()
        if other is None:
            return
        said = (
            f"{'--out ' if self.named else ''}{wanted} was taken by another run while this one ran "
            f"({other}); this run (status {status}) is in {self.out}"
        )
        if self.named:
            raise RunFolderError(f"{said}: move it, or run again with another --out")
        warnings.warn(said, RunFolderWarning, stacklevel=2)

    def abandon(self, e: OSError) -> RunFolderError:
        """The run could not be written (a full disk, a quota): its unfinished hidden folder is removed and the
        error says where; a folder whose meta.json already says finished is kept, and named."""
        tmp, finished = self.path, _read_meta(self.path).get("status") in STATUSES[1:]
        if tmp != self.out and not finished:
            shutil.rmtree(tmp, ignore_errors=True)
            self.path, self.kept = self.out, False
            left = f"its unfinished folder {tmp} was removed and {self.out} left as it was"
        else:
            left = f"what was written is in {tmp}"
        where = f" ({e.filename})" if e.filename else ""
        code = e.errno or _errno_in(str(e))  # pyarrow's OSError carries the errno only in its text
        why = os.strerror(code) if code else (e.strerror or str(e))
        return RunFolderError(
            f"--out {self.out}: the run could not be written: {why}{where}; {left}. "
            "Free some space there, or choose another --out, and run again"
        )

    def _swap_in(self) -> str | None:
        """Rename the finished folder to ``out``; None, or what holds ``out`` if another run got there first."""
        out, old, other = self.out, None, None
        with _folder_lock(out.parent):
            if self.overwrite and self._replaces is not None and _identity(out) == self._replaces:
                self.meta["replaces"] = self._replaces[2]  # a run killed between the renames is sorted out by it
                self.write_meta()
                old = out.parent / f".{out.name}.old-{secrets.token_hex(3)}-{os.getpid()}"
                os.replace(out, old)  # the old run goes only once the new one is in place
                os.rename(self.path, out)
            elif not _rename_if_free(self.path, out):
                other = _describe(out)
                for i in range(2, 10_000):
                    if _rename_if_free(self.path, out.with_name(f"{out.name}-{i}")):
                        self.out = out.with_name(f"{out.name}-{i}")
                        break
                else:
                    raise RunFolderError(f"{out} and {out.name}-2 ... -9999 are all taken; this run is in {self.path}")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if other is not None:  # meta.json says where the run is
            self.meta["out"], self.meta["out_asked"] = str(self.out), str(out)
            _write_json(self.out / "meta.json", self.meta)
        self.path = self.out
        return other


def _rename_if_free(src: Path, dst: Path) -> bool:
    """Rename folder src to dst unless dst is in use (a file, or a folder holding anything): atomic."""
    try:
        os.rename(src, dst)  # replaces an empty folder; fails on a non-empty one
    except OSError as e:
        if e.errno in TAKEN:
            return False
        raise
    return True


def _identity(p: Path) -> tuple | None:
    """What tells one run folder from another in its place: the folder's inode and its run_id."""
    try:
        st = os.stat(p)
    except OSError:
        return None
    try:
        run_id = json.loads((p / "meta.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        run_id = None
    return st.st_dev, st.st_ino, run_id


def _read_meta(p: Path) -> dict:
    """A folder's meta.json, or {} if it has none or it cannot be read."""
    try:
        m = json.loads((p / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def _describe(p: Path) -> str:
    """A few words on what holds p (the pid, host and status of the run there)."""
    try:
        m = json.loads((p / "meta.json").read_text())
    except (OSError, ValueError):
        return "not an eigenhooks run" if p.exists() else "gone again"
    return f"pid {m.get('pid', '?')} on {m.get('host', '?')}, started {m.get('started', '?')}, status {m.get('status', '?')}"


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive flock on a folder, held while runs are renamed into it (released if the process dies).

    Where flock is missing or refused (Windows; some network filesystems) the renames go
    unlocked: each is still atomic, only an --overwrite may then interleave with another run.
    """
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            log.debug("no lock on %s (%s): renaming unlocked", folder, e)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


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
def _held_sigint():
    """Hold Ctrl-C while the block runs; yields the list of presses held (always empty off the main thread)."""
    pressed = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    old = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def deferred_sigint():
    """Hold Ctrl-C while the block runs (the final files are written whole); a no-op off the main thread."""
    with _held_sigint() as pressed:
        yield
    if pressed:
        log.info("Ctrl-C pressed %d time(s) while the run folder was written; it was finished first", len(pressed))


def import_whole(names) -> None:
    """Import ``names`` with Ctrl-C held until all are in, then raise it as KeyboardInterrupt. A Ctrl-C that
    cuts the first import of a compiled module short can leave it half made for the rest of the process:
    finishing the run folder with such a pandas then crashed it (SIGSEGV in pandas' CSV reader)."""
    import importlib

    with _held_sigint() as pressed:
        for name in names:
            importlib.import_module(name)
    if pressed:
        raise KeyboardInterrupt


def _errno_in(text: str) -> int | None:
    """The errno an OSError's text names ("[errno 28]", as pyarrow writes it), or None."""
    m = re.search(r"\[errno (\d+)\]", text, re.IGNORECASE)
    return int(m.group(1)) if m else None

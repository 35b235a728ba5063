"""Converted models on disk: a GGUF file dequantised once, then loaded from safetensors.

transformers rebuilds a GGUF file's tokenizer and dequantises its weights on every load (about
2 minutes for a Gemma-3 file). ``get(...)`` keeps the result: ``model.safetensors``, the config
and the tokenizer files, in ``<models_dir>/converted/<SHA-256 of the file>-transformers-<version>-v1``,
so the key changes with the file's bytes and with the transformers that converted it.

An entry is trusted only whole and unchanged:

- it is built in a hidden folder beside its final place, every file fsynced, a manifest
  (``eigenhooks-entry.json``: the source's SHA-256, the transformers version, each file's size
  and SHA-256) written last, then renamed into place: a reader sees a whole entry or none;
- every load checks the manifest, the list of files, their sizes and their SHA-256 (through
  ``digest``'s stamps, so a file unchanged since it was hashed costs a ``stat``); an entry that
  fails is rebuilt, with one ``ModelCacheWarning`` saying what was wrong, never loaded;
- a per-entry lock (``flock``) makes a second process wait for the first one's conversion
  instead of doing it again, and a rename that finds the place taken keeps a good entry there;
- a models folder that cannot be written, or a disk that fills while converting, is no error: the
  caller converts without it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from . import digest

log = logging.getLogger(__name__)
FORMAT = 1
MANIFEST = "eigenhooks-entry.json"
FULL = (errno.ENOSPC, errno.EDQUOT)  # no room left: the cache is skipped, as an unwritable one is
_FRESH = re.compile(r"^\.(build|trash)-(\d+)-")


class ModelCacheWarning(UserWarning):
    """A converted model in the cache was damaged (it is rebuilt) or the cache cannot be written."""


class Unwritable(OSError):
    """The models folder cannot be written; the caller converts without the cache."""


def converted_dir() -> Path:
    return digest.models_dir() / "converted"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def entry_dir(source_sha: str) -> Path:
    """Where the converted copy of the file with this SHA-256 lives (for the installed transformers)."""
    return converted_dir() / f"{source_sha[:20]}-transformers-{_transformers_version()}-v{FORMAT}"


def verify(folder: Path, source_sha: str) -> str | None:
    """None if ``folder`` is a whole, unchanged entry for ``source_sha``; else what is wrong, in a phrase."""
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an unfinished or foreign folder)"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    want = (FORMAT, source_sha, _transformers_version())
    if not isinstance(m, dict) or (m.get("format"), m.get("source_sha256"), m.get("transformers")) != want:
        return f"its {MANIFEST} describes another file, format or transformers version"
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        return f"its {MANIFEST} lists no files"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    if present != set(files):
        parts = [f"{f} is missing" for f in sorted(set(files) - present)]
        parts += [f"{f} is not one of its files" for f in sorted(present - set(files))]
        return ", ".join(parts)
    for rel, rec in sorted(files.items()):
        size = (folder / rel).stat().st_size
        if size != rec.get("size"):
            return f"{rel} is {size} bytes, not the {rec.get('size')} written (truncated or replaced)"
    for rel, rec in sorted(files.items()):
        if digest.sha256_file(folder / rel) != rec.get("sha256"):
            return f"{rel} does not match the SHA-256 written when it was made (damaged or replaced)"
    return None


def get(source: Path, source_sha: str, write) -> Path:
    """The verified entry for ``source``, built with ``write(folder)`` if it is missing or damaged.

    Args:
        source: the GGUF file (its name is recorded, for ``eigenhooks cache info``).
        source_sha: its SHA-256.
        write: writes the converted model's files into the folder it is given.

    Returns:
        The entry's folder.

    Raises:
        Unwritable: the models folder cannot be written (convert without the cache).
        Whatever ``write`` raises (nothing is kept then).
    """
    final = entry_dir(source_sha)
    why = _check(final, source_sha)
    if why is None:
        return final
    if final.exists():
        _warn(f"the converted copy of {source.name} at {final} is damaged ({why}); rebuilding it from the GGUF")
    with _locked(final):
        if _check(final, source_sha) is None:  # another process built it while we waited
            return final
        tmp = _build(source, source_sha, write)
        _publish(tmp, final, source_sha)
    return final


def _check(folder: Path, source_sha: str) -> str | None:
    if not folder.is_dir():
        return "missing"
    try:
        return verify(folder, source_sha)
    except OSError as e:  # a file vanished or cannot be read: rebuilt, not trusted
        return f"a file cannot be read ({e})"


def _warn(msg: str) -> None:
    warnings.warn(msg, ModelCacheWarning, stacklevel=4)


@contextlib.contextmanager
def _locked(final: Path):
    """Hold ``final``'s lock (a second converter waits here); where flock is missing, no lock."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fh = open(final.parent / f".{final.name}.lock", "a+")
    except OSError as e:
        raise Unwritable(f"cannot write the models folder {final.parent}: {e.strerror or e}") from e
    try:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except ImportError:
            pass
        yield
    finally:
        fh.close()  # closing releases the lock


def _build(source: Path, source_sha: str, write) -> Path:
    """Convert into a hidden folder beside the entries, fsync every file, write the manifest last."""
    _clean_stale(converted_dir())
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=converted_dir()))
    except OSError as e:
        raise Unwritable(f"cannot write the models folder {converted_dir()}: {e.strerror or e}") from e
    try:
        t0 = time.perf_counter()
        write(tmp)
        files = {}
        for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
            _fsync(p)
            sha = digest._hash(p)
            digest.record(p, sha)  # a rename keeps inode and times: the stamp holds in the entry
            files[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": sha}
        manifest = {
            "format": FORMAT,
            "source": source.name,
            "source_sha256": source_sha,
            "source_size": source.stat().st_size,
            "transformers": _transformers_version(),
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "convert_seconds": round(time.perf_counter() - t0, 1),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync(tmp / MANIFEST)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        _fsync(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in FULL:  # a full disk is an unwritable cache: convert without it
            raise Unwritable(f"the models folder {converted_dir()} is full ({e.strerror or e})") from e
        raise
    return tmp


def _publish(tmp: Path, final: Path, source_sha: str) -> None:
    """Rename ``tmp`` to ``final``; a good entry already there is kept, a bad one is moved aside first."""
    try:
        for _ in range(3):
            try:
                os.rename(tmp, final)
                _fsync(final.parent)
                return
            except OSError:  # the place is taken (ENOTEMPTY / EEXIST)
                if not final.exists():
                    raise
            if _check(final, source_sha) is None:
                return  # another process published a good entry first: keep it
            _discard(final)
        raise OSError(f"could not put the converted model in place at {final}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Move a folder out of the way in one rename, then delete it (a reader never sees half of it)."""
    trash = folder.parent / f".trash-{os.getpid()}-{folder.name}-{time.monotonic_ns()}"
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _clean_stale(folder: Path) -> None:
    """Remove build and trash folders of processes that are gone (killed while converting)."""
    for p in folder.glob(".*-*"):
        m = _FRESH.match(p.name)
        if m and not pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (one of another user's counts as running)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(q.stat().st_size for q in p.rglob("*") if q.is_file())


def cache_info() -> list[dict]:
    """One record per thing on disk: the spectra (together), each converted model, each fetched model.

    Each record has ``kind`` ('spectra', 'calibration' (steering's samples, when any), 'converted', 'fetched',
    'old dense copy' or 'bookkeeping'),
    ``name``, ``bytes`` and ``path``; converted ones also the source's SHA-256, the transformers
    version and when they were made.
    """
    from ..linalg.cache import CALIBRATION_DIR, cache_dir, spectrum_files

    files = spectrum_files()
    rows = [
        {
            "kind": "spectra",
            "name": f"{len(files)} layer spectra",
            "entries": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "path": str(cache_dir()),
        }
    ]
    cal = cache_dir() / CALIBRATION_DIR
    if cal.is_dir() and any(cal.iterdir()):
        n = len(list(cal.glob("*.safetensors")))
        rows.append({"kind": "calibration", "name": f"{n} steering calibration samples", "entries": n,
                     "bytes": _size(cal), "path": str(cal)})  # fmt: skip
    other = _size(digest.stamps_dir()) if digest.stamps_dir().is_dir() else 0
    for p in sorted(converted_dir().iterdir()) if converted_dir().is_dir() else []:
        if p.name.startswith("."):  # locks, and builds of processes at work or killed
            other += _size(p)
            continue
        try:
            m = json.loads((p / MANIFEST).read_text())
        except (OSError, ValueError):
            m = {}
        rows.append(
            {
                "kind": "converted",
                "name": m.get("source", "? (no manifest: rebuilt on next load)"),
                "bytes": _size(p),
                "path": str(p),
                "source_sha256": m.get("source_sha256"),
                "transformers": m.get("transformers"),
                "created": m.get("created"),
            }
        )
    root = digest.models_dir()
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not d.is_dir() or d in (converted_dir(), digest.stamps_dir()):
            continue
        dense = d / "dense"  # the dense copy that versions before this store wrote beside a fetched file
        legacy = _size(dense) if dense.is_dir() else 0
        rows.append({"kind": "fetched", "name": d.name, "bytes": _size(d) - legacy, "path": str(d)})
        if legacy:
            rows.append({"kind": "old dense copy", "name": d.name, "bytes": legacy, "path": str(dense)})
    if other:
        rows.append({"kind": "bookkeeping", "name": "stamps, locks", "bytes": other, "path": str(root)})
    return rows


def clear_cache(spectra: bool = True, models: bool = True) -> list[dict]:
    """Delete the spectra (with steering's calibration samples) and/or the converted models (with old
    dense copies and stamps).

    Fetched models stay: they are downloads, not a cache (``eigenhooks fetch NAME --force``
    replaces one). Returns the records of ``cache_info`` that were removed.
    """
    from ..linalg.cache import spectrum_files

    gone = []
    for row in cache_info():
        if row["kind"] == "spectra" and spectra:
            for p in spectrum_files():
                p.unlink(missing_ok=True)
            gone.append(row)
        elif row["kind"] == "calibration" and spectra:
            shutil.rmtree(row["path"], ignore_errors=True)
            gone.append(row)
        elif row["kind"] in ("converted", "old dense copy") and models:
            _discard(Path(row["path"]))
            gone.append(row)
        elif row["kind"] == "bookkeeping" and models:
            gone.append(row)
    if models:  # stamps and empty lock files too, whether or not their bytes made a row
        shutil.rmtree(digest.stamps_dir(), ignore_errors=True)
        for p in converted_dir().glob(".*") if converted_dir().is_dir() else ():
            m = _FRESH.match(p.name)
            if p.is_file():
                p.unlink(missing_ok=True)
            elif not (m and pid_alive(int(m.group(2)))):  # a live process's build is left alone
                _discard(p)
        digest.forget()
    return gone

"""SHA-256 of model files, computed once per file version and remembered by a stat stamp.

Every model file eigenhooks loads is checked against a SHA-256 (the pin of a fetched file, or the
digest written when a converted copy was made). Hashing a multi-GB file on every load would cost
seconds, so a verified digest is remembered with the file's stamp: its device, inode, size,
``mtime_ns`` and ``ctime_ns``. Any write to the file moves its mtime and ctime, and a file swapped
in by rename has another inode, so a remembered digest is used only for the very bytes it was
computed from. Stamps live in memory (per process) and in ``<models_dir>/stamps`` (across
processes); a stamp that cannot be read or written is a miss, never an error.

A file's times come from a coarse clock (a few milliseconds; a second or two on some file
systems), so a write in the same tick as an earlier one can leave the stamp as it was. As git
does with its index, a digest is remembered only for a file whose last change (``ctime``) is
older than the hashing by more than that tick; a younger file is hashed again next time.

What a stamp cannot see: bytes changed on disk without the kernel noticing (a failing drive, a
write to the raw device). ``eigenhooks cache clear --models`` drops every stamp, so the next
load hashes again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
_memo: dict[tuple, str] = {}  # stamp -> SHA-256, this process
_lock = threading.Lock()


def models_dir() -> Path:
    """Where models live: ``$EIGENHOOKS_MODELS``, else ``<eigenhooks cache>/models``.

    It holds fetched real models (``NAME/``), converted models (``converted/``) and the stamps of
    verified files (``stamps/``).
    """
    from ..linalg.cache import cache_dir

    env = os.environ.get("EIGENHOOKS_MODELS", "").strip()
    return Path(env).expanduser() if env else cache_dir() / "models"


def stamps_dir() -> Path:
    return models_dir() / "stamps"


def _stamp(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stamp_file(stamp: tuple) -> Path:
    return stamps_dir() / f"{stamp[0]}-{stamp[1]}.json"  # one per (device, inode)


def sha256_file(path: Path) -> str:
    """The SHA-256 of ``path`` (hex), read from a stamp when the file has not changed since it was hashed.

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    stamp = _stamp(path.stat())
    with _lock:
        if stamp in _memo:
            return _memo[stamp]
    digest = _read_stamp(stamp)
    if digest is None:
        started = time.time_ns()
        digest = _hash(path)
        if _stamp(path.stat()) != stamp:  # written while we read it: trust nothing
            raise OSError(f"{path} changed while it was being hashed; try again")
        _remember(stamp, digest, path, started)
    else:
        with _lock:
            _memo[stamp] = digest
    return digest


def record(path: Path, digest: str) -> None:
    """Remember ``digest`` for ``path`` as it is now (the caller hashed exactly these bytes)."""
    _remember(_stamp(Path(path).stat()), digest, path, time.time_ns())


def _remember(stamp: tuple, digest: str, path: Path, hashed_at: int) -> None:
    ctime = stamp[4]
    tick = 2 * 10**9 if ctime % 10**9 == 0 else 10**8  # whole seconds: a coarse file system
    if hashed_at - ctime <= tick:  # changed within a tick of the hashing: a later write could keep the stamp
        return
    with _lock:
        _memo[stamp] = digest
    _write_stamp(stamp, digest, path)


def forget() -> None:
    """Drop this process's remembered digests (the stamps on disk stay)."""
    with _lock:
        _memo.clear()


def _hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_stamp(stamp: tuple) -> str | None:
    try:
        rec = json.loads(_stamp_file(stamp).read_text())
        if tuple(rec["stamp"]) == stamp and len(rec["sha256"]) == 64:
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_stamp(stamp: tuple, digest: str, path: Path) -> None:
    target = _stamp_file(stamp)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"stamp": list(stamp), "sha256": digest, "path": str(path)}))
        os.replace(tmp, target)
    except OSError as e:  # a read-only cache: the file is hashed again next time
        log.debug("could not write the stamp of %s: %s", path, e)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass

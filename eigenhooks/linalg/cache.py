"""The spectrum cache on disk (safetensors), keyed by the content of the weights.

One file per (weights, options): the key is a 128-bit xxh3 hash of the layer's attention
factors in their stored dtype and layout (and the folded norm, for ``ov_ln``) plus every
option that changes the result. The bytes are hashed in place, never copied, at memory speed:
on a Llama-8B layer (80 MB of float32) the key takes a few ms (SHA-256 took ~0.05 s). The key
guards against edits, not adversaries, so a non-cryptographic hash of every byte gives the
same guarantee (issue 52); downloaded files keep their SHA-256 pins (``zoo``).
No pickle anywhere. ``EIGENHOOKS_CACHE`` sets the folder (``~`` is expanded; unset or
empty means ``~/.cache/eigenhooks``).

The cache is an optimisation, never a source of truth:

- each entry carries its own key and a checksum of its tensors and metadata, verified on
  load, so a damaged, truncated, bit-flipped, incomplete or swapped entry is a miss (it is
  recomputed and rewritten), never a wrong number or a crash;
- a cache that cannot be written (read-only folder, full disk, a file in the way) is
  skipped: the spectra are computed without it, with one warning per folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import warnings
from pathlib import Path

import torch
import xxhash

from .eig import Factors, LayerSpectrum
from .heads import part_tensors, parts_from_tensors

log = logging.getLogger(__name__)
CACHE_FORMAT = 4  # 2: entries carry their key and a checksum; 3: SHA-256 of the bytes in place; 4: xxh3-128
CALIBRATION_DIR = "calibration"  # steering's calibration samples (``steer.calibration``), beside the spectra
_warned: set[str] = set()  # folders already warned about (one warning each per process)
_warn_lock = threading.Lock()  # spectra are saved from a thread pool


class CacheWarning(UserWarning):
    """The spectrum cache could not be written; results are computed without it."""


def cache_dir() -> Path:
    """The cache folder: ``EIGENHOOKS_CACHE`` with ``~`` expanded, or ``~/.cache/eigenhooks``."""
    env = os.environ.get("EIGENHOOKS_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eigenhooks"


def _dense_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """t with its dimensions permuted so that it is contiguous, and the permutation.

    The factors are views of the model's weights (O_heads is o_proj's (d, H*dh) storage
    seen as (H, d, dh)); hashing the permuted view reads the same bytes with no copy. A
    tensor no permutation makes contiguous is copied.
    """
    order = tuple(sorted(range(t.dim()), key=lambda i: (-t.stride(i), i)))
    p = t.permute(order)
    if p.is_contiguous():
        return p, order
    return t.contiguous(), tuple(range(t.dim()))


def _feed(hs, t: torch.Tensor) -> None:
    """Hash dtype, shape, layout and bytes of t into one hasher or each of a list (the layout is keyed,
    so equal keys mean equal values)."""
    t, order = _dense_view(t.detach().to("cpu"))
    head = f"{t.dtype}{tuple(t.shape)}{order}".encode()
    buf = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None  # a buffer over t's memory, no copy
    for h in hs if isinstance(hs, list) else [hs]:
        h.update(head)
        if buf is not None:
            h.update(buf)


def cache_key(factors: Factors, extra: torch.Tensor | None, options: dict) -> str:
    """The cache key of one spectrum; see ``cache_keys``."""
    return cache_keys(factors, extra, [options])[0]


def cache_keys(factors: Factors, extra: torch.Tensor | None, options: list[dict]) -> list[str]:
    """Hash of the weights that define F (and the options that shape the result).

    Args:
        factors: the layer's (O, V) factors.
        extra: the folded norm scale (d,) for ``ov_ln``, else None.
        options: for each key, every option that changes the spectrum (variant, rank, top, ...).

    Returns:
        one key of 32 hex digits per options dict; the weights are copied to the host once for all.
    """
    hs = [xxhash.xxh3_128() for _ in options]  # ~15x SHA-256's speed (memory bound)
    for h, o in zip(hs, options):
        h.update(json.dumps({"format": CACHE_FORMAT, **o}, sort_keys=True).encode())
    for t in (factors.O_heads, factors.V_groups, factors.group_of_head) + ((extra,) if extra is not None else ()):
        _feed(hs, t)
    return [h.hexdigest() for h in hs]


def tensors_digest(tensors: list[torch.Tensor], meta: dict | None = None) -> str:
    """Hash of each tensor's dtype, shape, layout and bytes, and of ``meta``: equal digests mean equal values.

    Exact, not rounded: a monitor's fingerprint uses it for weights and target vectors, which
    every process reads bit for bit the same (unlike eigenvectors, whose last bits depend on the
    machine). 32 hex digits (xxh3-128).
    """
    h = xxhash.xxh3_128()
    h.update(json.dumps(meta or {}, sort_keys=True).encode())
    for t in tensors:
        _feed(h, t)
    return h.hexdigest()


def _checksum(tensors: dict[str, torch.Tensor], meta: str, key: str) -> str:
    """BLAKE2 of the key, the metadata and every tensor (name, dtype, shape, bytes)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(key.encode())
    h.update(meta.encode())
    for name in sorted(tensors):
        h.update(name.encode())
        _feed(h, tensors[name])
    return h.hexdigest()


def _tensors(spec: LayerSpectrum) -> dict[str, torch.Tensor]:
    t = {
        "eig_re": spec.eigenvalues.real.contiguous(),
        "eig_im": spec.eigenvalues.imag.contiguous(),
        "vec_re": spec.eigenvectors.real.contiguous(),
        "vec_im": spec.eigenvectors.imag.contiguous(),
        "basis": spec.basis.contiguous(),
    }
    if spec.heads:
        t.update(part_tensors("head", spec.heads))
    if spec.groups:
        t.update(part_tensors("group", spec.groups))
    return t


def save_spectrum(spec: LayerSpectrum, key: str, folder: Path | None = None) -> Path | None:
    """Write one spectrum to the cache, atomically. Returns its path, or None if it could not be written.

    A folder that cannot be written gives one ``CacheWarning`` (per folder and process)
    and no error: the caller goes on without the cache.
    """
    from safetensors.torch import save_file

    folder = folder or cache_dir()
    t = _tensors(spec)
    meta = json.dumps(
        {
            "variant": spec.variant,
            "rank": spec.rank,
            "k": spec.k,
            "gap_ratio": spec.gap_ratio,
            "kind": spec.kind,
            "lambda_next": [spec.lambda_next.real, spec.lambda_next.imag],
            "threshold": spec.threshold,
        },
        sort_keys=True,
    )
    header = {"eigenhooks": meta, "key": key, "checksum": _checksum(t, meta, key)}
    path = folder / f"{key}.safetensors"
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(t, str(tmp), metadata=header)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError as e:
        _remove_quietly(tmp)
        _warn_unwritable(folder, e)
        return None
    return path


def _remove_quietly(p: Path) -> None:
    try:
        p.unlink(missing_ok=True)
    except OSError:
        pass


def _warn_unwritable(folder: Path, e: OSError) -> None:
    with _warn_lock:
        if str(folder) in _warned:
            return
        _warned.add(str(folder))
    warnings.warn(
        f"cannot write the spectrum cache at {folder} ({type(e).__name__}: {e.strerror or e}); "
        "computing without it. Set EIGENHOOKS_CACHE to a writable folder to cache spectra.",
        CacheWarning,
        stacklevel=3,
    )


def load_spectrum(key: str, layer: int, folder: Path | None = None) -> LayerSpectrum | None:
    """The cached spectrum for key, or None.

    A missing, unreadable, truncated, bit-flipped, incomplete or swapped entry (its
    stored key or checksum does not match) is a miss: it is logged and recomputed.

    Args:
        key: ``cache_key(...)`` of the layer.
        layer: the layer index to put in the returned spectrum.
        folder: the cache folder (default ``cache_dir()``).
    """
    path = (folder or cache_dir()) / f"{key}.safetensors"
    try:
        if not path.is_file():
            return None
        return _read(path, key, layer)
    except Exception as e:  # a bad entry is recomputed, never trusted
        log.warning("ignoring cache entry %s: %s", path, e)
        return None


def spectrum_files(folder: Path | None = None) -> list[Path]:
    """The spectrum entries in the cache folder (``<32 hex digits>.safetensors``, or 40 before format 4), for
    ``eigenhooks cache``."""
    folder = folder or cache_dir()
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _ENTRY.match(p.name) and p.is_file())


_ENTRY = re.compile(r"^(?:[0-9a-f]{32}|[0-9a-f]{40})\.safetensors$")  # 40: SHA-256 keys, listed to be cleared


def _read(path: Path, key: str, layer: int) -> LayerSpectrum:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        t = {k: f.get_tensor(k).clone() for k in f.keys()}  # copies: a tensor kept (the basis) would otherwise
        # keep its whole entry mapped and resident (safetensors maps the file), for as long as a plan lives
    if header.get("key") != key:
        raise ValueError(f"entry holds key {header.get('key')!r}, not {key!r} (a swapped or renamed file)")
    meta_s = header.get("eigenhooks", "")
    if header.get("checksum") != _checksum(t, meta_s, key):
        raise ValueError("checksum mismatch (a damaged entry)")
    meta = json.loads(meta_s)
    return LayerSpectrum(
        layer=layer,
        variant=meta["variant"],
        rank=meta["rank"],
        eigenvalues=torch.complex(t["eig_re"], t["eig_im"]),
        eigenvectors=torch.complex(t["vec_re"], t["vec_im"]),
        basis=t["basis"],
        k=meta["k"],
        gap_ratio=meta["gap_ratio"],
        kind=meta["kind"],
        lambda_next=complex(*meta["lambda_next"]),
        threshold=meta["threshold"],
        heads=parts_from_tensors("head", t),
        groups=parts_from_tensors("group", t),
    )

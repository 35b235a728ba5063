"""Exports and the spectrum cache.

The cache keeps one safetensors file per (weights, options): the key is a BLAKE2 hash of
the layer's attention factors (and the folded norm, for ``ov_ln``) plus every option that
changes the result. No pickle anywhere. ``EIGENHOOKS_CACHE`` sets the folder
(default ``~/.cache/eigenhooks``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .spectrum import Factors, HeadSpectrum, LayerSpectrum

log = logging.getLogger(__name__)
CACHE_FORMAT = 1


def cache_dir() -> Path:
    return Path(os.environ.get("EIGENHOOKS_CACHE", Path.home() / ".cache" / "eigenhooks"))


def _feed(h, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def cache_key(factors: Factors, extra: torch.Tensor | None, options: dict) -> str:
    """Hash of the weights that define F (and the options that shape the result)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps({"format": CACHE_FORMAT, **options}, sort_keys=True).encode())
    for t in (factors.O_heads, factors.V_groups, factors.group_of_head):
        _feed(h, t)
    if extra is not None:
        _feed(h, extra)
    return h.hexdigest()


def save_spectrum(spec: LayerSpectrum, key: str, folder: Path | None = None) -> Path:
    from safetensors.torch import save_file

    folder = folder or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    t = {
        "eig_re": spec.eigenvalues.real.contiguous(),
        "eig_im": spec.eigenvalues.imag.contiguous(),
        "vec_re": spec.eigenvectors.real.contiguous(),
        "vec_im": spec.eigenvectors.imag.contiguous(),
        "basis": spec.basis.contiguous(),
    }
    if spec.heads is not None:
        t["head_eig_re"] = torch.stack([h.eigenvalues.real for h in spec.heads])
        t["head_eig_im"] = torch.stack([h.eigenvalues.imag for h in spec.heads])
        t["head_copying"] = torch.tensor([h.copying_score for h in spec.heads], dtype=torch.float64)
    meta = {
        "variant": spec.variant,
        "rank": spec.rank,
        "k": spec.k,
        "gap_ratio": spec.gap_ratio,
        "kind": spec.kind,
        "lambda_next": [spec.lambda_next.real, spec.lambda_next.imag],
        "threshold": spec.threshold,
    }
    path = folder / f"{key}.safetensors"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(t, str(tmp), metadata={"eigenhooks": json.dumps(meta)})
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def load_spectrum(key: str, layer: int, folder: Path | None = None) -> LayerSpectrum | None:
    """The cached spectrum for key, or None (a missing or unreadable entry is a miss)."""
    from safetensors import safe_open

    path = (folder or cache_dir()) / f"{key}.safetensors"
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["eigenhooks"])
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a corrupt entry is recomputed, never trusted
        log.warning("ignoring unreadable cache entry %s: %s", path, e)
        return None
    heads = None
    if "head_eig_re" in t:
        eig = torch.complex(t["head_eig_re"], t["head_eig_im"])
        heads = [HeadSpectrum(h, eig[h], float(t["head_copying"][h])) for h in range(eig.shape[0])]
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
        heads=heads,
    )

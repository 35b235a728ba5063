"""The in-process spectra memo: one spectrum per (weights, options), keyed by the weights' content.

The key is a 128-bit xxh3 hash of every byte of a layer's O, V and attention norm, never the parameters'
identity or version: ``p.data`` writes keep ``_version`` and ``data_ptr``, and a sample of entries
misses most edits, so only every byte says the weights are the same (issue 41). SmolLM2's 30
layers hash in ~45 ms (docs/scale.md, "In-process memo"). Least recently used entries go first, past 512
entries or 256 MB of tensors (SmolLM2's two default targets keep 17 MB).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import fields, is_dataclass, replace

import torch

from ..linalg import cache as disk
from ..linalg.eig import LayerSpectrum
from ..models import Adapter

_MEMO: OrderedDict[tuple, tuple[LayerSpectrum, int]] = OrderedDict()  # key -> (spectrum, its tensors' bytes)
_MEMO_SIZE = 512
_MEMO_BYTES = 256 << 20  # the memo's tensors at most (an 8B model's 512 entries would be ~1 GB of eigenvectors)
_memo_lock = threading.Lock()


def layer_parameters(adapter: Adapter, i: int) -> list[torch.nn.Parameter]:
    """The parameters of layer i's block, attention and norm, each once."""
    ly = adapter.layers[i]
    params: dict[int, torch.Tensor] = {}
    for m in (ly.block, ly.attn_in, ly.attn_out, ly.o_proj, ly.norm):
        if isinstance(m, torch.nn.Module):
            params.update((id(p), p) for p in m.parameters())
    return list(params.values())


def digest(adapter: Adapter, i: int) -> str | None:
    """Layer i's ``content_digest`` for the memo, or None (no memo) for probe-read layers and offloaded weights."""
    params = layer_parameters(adapter, i)
    if adapter.layers[i].factors is None or not params or any(p.device.type == "meta" for p in params):
        return None
    return content_digest(adapter, i)


def key(adapter: Adapter, i: int, options: dict, content: str | None) -> tuple | None:
    """Key of layer i's spectrum: its weights' digest (O, V and the norm, every byte) and the options."""
    if content is None:
        return None
    ly = adapter.layers[i]
    offset = float(ly.norm_offset or getattr(ly.norm, "eigenhooks_offset", 0.0) or 0.0)
    opts = tuple(sorted(options.items()))
    return (adapter.family, adapter.n_heads, adapter.n_kv_heads, i, offset, opts, content)


def clear_memo() -> None:
    """Forget every spectrum held in memory (the disk cache is untouched)."""
    with _memo_lock:
        _MEMO.clear()


def get(key) -> LayerSpectrum | None:
    if key is None:
        return None
    with _memo_lock:
        got = _MEMO.get(key)
        if got is None:
            return None
        _MEMO.move_to_end(key)
    return _fresh(got[0])


def put(key, spec: LayerSpectrum) -> LayerSpectrum:
    """Keep a copy of ``spec``; the least recently used entries go while more than ``_MEMO_SIZE`` are kept or
    their tensors pass ``_MEMO_BYTES`` (the newest always stays)."""
    if key is not None:
        kept = _fresh(spec)
        with _memo_lock:
            _MEMO[key] = (kept, _nbytes(kept))
            _MEMO.move_to_end(key)
            total = sum(n for _, n in _MEMO.values())
            while len(_MEMO) > 1 and (len(_MEMO) > _MEMO_SIZE or total > _MEMO_BYTES):
                total -= _MEMO.popitem(last=False)[1][1]
    return spec


def _nbytes(x) -> int:
    """The bytes of every tensor in a spectrum (its heads' and groups' too)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list):
        return sum(_nbytes(v) for v in x)
    if is_dataclass(x) and not isinstance(x, type):
        return sum(_nbytes(getattr(x, f.name)) for f in fields(x))
    return 0


def _fresh(x):
    """A copy the caller may edit without touching the memo: every tensor cloned, every list and
    dataclass (the heads' and groups' spectra, a group's head list) rebuilt, all the way down."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_fresh(v) for v in x]
    if is_dataclass(x) and not isinstance(x, type):
        return replace(x, **{f.name: _fresh(getattr(x, f.name)) for f in fields(x) if f.init})
    return x


def content_digest(adapter: Adapter, i: int) -> str:
    """``weights_digest`` of weights already in memory (xxh3-128 of every byte, read in place)."""
    meta = {"digest": "weights", "norm_position": adapter.norm_position}
    if adapter.layers[i].factors is None:
        return disk.tensors_digest(layer_parameters(adapter, i), {**meta, "probe": True})
    return disk.cache_key(adapter.factors(i), adapter.norm_weight(i), meta)

"""Model-level entry points: ``spectra`` (cached) and ``verify`` (weights vs probe).

These join an adapter (which knows the model) with spectrum.py (which knows matrices).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import io
from .models import Adapter, get_adapter
from .models.probe import probe_matrices
from .spectrum import DEFAULT_THRESHOLD, DEFAULT_TOP, RANKS, Factors, LayerSpectrum, layer_spectrum

log = logging.getLogger(__name__)
VARIANTS = ("ov", "ov_ln")


def layer_factors(adapter: Adapter, layer: int, variant: str = "ov") -> tuple[Factors, torch.Tensor | None]:
    """The factors of F for one layer and variant, and the folded norm scale (for the cache key).

    ``ov_ln`` folds the scale of the norm around attention in: F diag(w) for pre-norm
    models, diag(w) F for post-norm ones. A norm without a scale folds as ones.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    ly = adapter.layers[layer]
    if ly.factors is None:
        F = probe_matrices(adapter, [layer])[layer]  # (d, d)
        factors = Factors(F[None], torch.eye(F.shape[0], dtype=F.dtype)[None], torch.zeros(1, dtype=torch.long))
    else:
        factors = adapter.factors(layer)
    if variant == "ov":
        return factors, None
    w = adapter.norm_weight(layer)
    if w is None:
        return factors, None
    if adapter.norm_position == "pre":
        return factors.scaled(right=w), w
    return factors.scaled(left=w), w


def spectra(
    model,
    variant: str = "ov",
    rank: str = "modulus",
    *,
    layers: list[int] | None = None,
    heads: bool = False,
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
    cache: bool = True,
) -> list[LayerSpectrum]:
    """Spectrum of F_t for every attention layer of a model, in float64.

    Args:
        model: a HuggingFace or TransformerLens model, or an Adapter.
        variant: 'ov' (F = O V) or 'ov_ln' (the attention norm's scale folded in).
        rank: 'modulus' (|lambda|) or 'residual' (|1 + lambda|).
        layers: indices to compute (default: all).
        heads: also compute per-head spectra F_h = O_h V_h and copying scores.
        top: leading eigenvectors kept per layer.
        threshold: gap ratio above which a layer is 'near-degenerate'.
        cache: read and write the disk cache (``EIGENHOOKS_CACHE``).

    Returns:
        One LayerSpectrum per requested layer, in order. Shared-weight layers are
        computed once.

    Raises:
        ValueError: unknown variant or rank, non-finite weights, meta-device weights.
        UnsupportedModelError: the model's attention cannot be found.

    Example:
        >>> import eigenhooks as eh
        >>> model, tok = eh.zoo.load("gpt2-tiny")
        >>> [s.kind for s in eh.spectra(model)]  # doctest: +SKIP
        ['real-dominant', 'complex-dominant', ...]
    """
    if rank not in RANKS:
        raise ValueError(f"rank must be one of {RANKS}, got {rank!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    adapter = get_adapter(model)
    idx = list(range(adapter.n_layers)) if layers is None else [_check_layer(adapter, i) for i in layers]
    options = {
        "variant": variant,
        "rank": rank,
        "top": top,
        "threshold": threshold,
        "heads": heads,
        "norm_position": adapter.norm_position,
    }
    # First pass: factors, checks and cache look-ups (cheap); one job per shared-weight group.
    reps: dict[int, int] = {}
    found: dict[int, LayerSpectrum] = {}
    jobs = []
    for i in idx:
        g = adapter.layers[i].group
        if g in reps:
            continue
        reps[g] = i
        factors, w = layer_factors(adapter, i, variant)
        _check_finite(adapter, i, factors, w)
        key = io.cache_key(factors, w, options) if cache else None
        spec = io.load_spectrum(key, i) if cache else None
        if spec is not None:
            found[g] = spec
        else:
            jobs.append((g, i, factors, key))

    # Second pass: the eigen-decompositions, a few layers at a time. LAPACK's eig is mostly
    # serial, so running layers side by side uses the cores it leaves idle.
    def compute(job):
        g, i, factors, key = job
        spec = layer_spectrum(factors, layer=i, variant=variant, rank=rank, top=top, threshold=threshold, heads=heads)
        if cache:
            io.save_spectrum(spec, key)
        return g, spec

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(workers) as ex:
            found.update(ex.map(compute, jobs))
    else:
        found.update(map(compute, jobs))
    return [
        _relabel(found[adapter.layers[i].group], i)
        if reps[adapter.layers[i].group] != i
        else found[adapter.layers[i].group]
        for i in idx
    ]


def _relabel(spec: LayerSpectrum, layer: int) -> LayerSpectrum:
    from dataclasses import replace

    return replace(spec, layer=layer)


def _check_layer(adapter: Adapter, i: int) -> int:
    n = adapter.n_layers
    if not -n <= i < n:
        raise IndexError(f"layer {i} is out of range for a model with {n} attention layers")
    return i % n


def _check_finite(adapter: Adapter, i: int, factors: Factors, w) -> None:
    bad = [
        name
        for name, t in (("O", factors.O_heads), ("V", factors.V_groups), ("norm", w))
        if t is not None and not torch.isfinite(t).all()
    ]
    if bad:
        raise ValueError(
            f"layer {i} ({adapter.layers[i].name or adapter.family}): non-finite values in {', '.join(bad)} "
            "weights; the spectrum is undefined. Check the checkpoint (an fp16 overflow?)."
        )


@dataclass
class Verification:
    """How well the weight-read F matches the F the model's forward code computes."""

    layer: int
    max_abs_diff: float
    max_abs_F: float
    dtype: str

    @property
    def rel_diff(self) -> float:
        return self.max_abs_diff / self.max_abs_F if self.max_abs_F > 0 else self.max_abs_diff


def verify(model, layers: list[int] | None = None, n_tokens: int = 2) -> list[Verification]:
    """Compare F from the weights with F from the identical-token probe, layer by layer.

    The probe runs in the model's own dtype: expect ~1e-12 relative in float64, ~1e-6 in
    float32 and ~1e-3 in fp16/bf16.

    Args:
        n_tokens: length of the identical-token probe sequence (1 skips the softmax).

    Returns:
        One Verification per layer (max |F_weights - F_probe| and max |F|).
    """
    adapter = get_adapter(model)
    idx = list(range(adapter.n_layers)) if layers is None else [_check_layer(adapter, i) for i in layers]
    probed = probe_matrices(adapter, idx, n_tokens=n_tokens)
    dtype = str(next(adapter.model.parameters()).dtype).replace("torch.", "")
    rows = []
    for i in idx:
        F_p = probed[i]
        if adapter.layers[i].factors is None:
            rows.append(Verification(i, float("nan"), float(F_p.abs().max()), dtype))
            continue
        F_w = adapter.factors(i).matrix()
        rows.append(Verification(i, float((F_w - F_p).abs().max()), float(F_w.abs().max()), dtype))
    return rows

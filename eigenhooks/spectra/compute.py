"""Model-level entry point: ``spectra`` (cached); ``verify`` (weights vs probe) is in ``verify``.

These join an adapter (which knows the model) with linalg.eig (which knows matrices).
"""

from __future__ import annotations

import logging
import math
import operator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..linalg import cache as disk
from ..linalg.eig import (
    DEFAULT_THRESHOLD,
    DEFAULT_TOP,
    RANKS,
    Factors,
    LayerSpectrum,
    NonFiniteError,
    layer_spectra,
)
from ..models import Adapter, layer_index
from ..models.offload import onloaded, source_modules
from ..models.probe import probe_matrices
from ..progress import bar
from . import memo
from .engine import adapter_of
from .heads import circuit_digest, circuit_matrix, copy_out
from .pool import _blas_threads, _cores, _Inline, parallel_map  # noqa: F401  (parallel_map: for the monitor)

log = logging.getLogger(__name__)
clear_memo = memo.clear_memo  # compute.clear_memo: the path tests and eh.api use
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
    progress: bool | None = None,
) -> list[LayerSpectrum]:
    """Spectrum of F_t for every attention layer of a model, in float64.

    A repeat call in the same process is answered from memory, keyed by a hash of every byte
    of the layer's weights (any edit, ``.data`` writes included, makes a new key); across
    processes the disk cache answers, keyed the same way.
    Models dispatched with accelerate (CPU or disk offload) are read one layer at a time
    from their offload maps, so the model is never materialised.

    Args:
        model: a HuggingFace or TransformerLens model, or an Adapter.
        variant: 'ov' (F = O V) or 'ov_ln' (the attention norm's scale folded in).
        rank: 'modulus' (|lambda|) or 'residual' (|1 + lambda|).
        layers: indices to compute (default: all).
        heads: also compute each head's F_h = O_h V_{g(h)} and each key/value group's spectrum,
            with copying scores and the full OV circuit's (``LayerSpectrum.heads``, ``.groups``).
        top: leading eigenvectors kept per layer.
        threshold: gap ratio above which a layer is 'near-degenerate'.
        cache: use the in-process memo and the disk cache (``EIGENHOOKS_CACHE``); False
            recomputes every layer and stores nothing.
        progress: a bar on stderr per layer computed; None: on a terminal or in a notebook, 8+ layers.

    Returns:
        One LayerSpectrum per requested layer, in order. Shared-weight layers are
        computed once.

    Raises:
        ValueError: unknown variant or rank, top < 1, threshold outside 0 < t <= 1 (NaN too), non-finite
            weights, empty meta-device weights.
        TypeError: layers is not a list of ints (numpy and 0-d torch integers count; bools do not).
        IndexError: a layer out of range (negative counts from the end).
        UnsupportedModelError: the model's attention cannot be found.

    Example:
        >>> import eigenhooks as eh
        >>> model, tok = eh.zoo.load("gpt2-tiny")
        >>> [s.kind for s in eh.spectra(model)]  # doctest: +SKIP
        ['real-dominant', 'complex-dominant', ...]
    """
    kw = dict(layers=layers, heads=heads, top=top, threshold=threshold, cache=cache, progress=progress)
    return spectra_by_rank(model, variant, (rank,), **kw)[rank]


def spectra_by_rank(
    model,
    variant: str = "ov",
    ranks: tuple[str, ...] = RANKS,
    *,
    layers: list[int] | None = None,
    heads: bool = False,
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
    cache: bool = True,
    progress: bool | None = None,
) -> dict[str, list[LayerSpectrum]]:
    """``spectra`` under several ranking rules: {rank: one LayerSpectrum per layer}.

    Each layer is read, hashed and eigen-decomposed once for all the rules (they rank the same
    eigenvalues of the same F); each rule's spectrum is cached on its own, as ``spectra`` caches it.
    """
    for rank in ranks:
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}, got {rank!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    top, threshold = _check_top_threshold(top, threshold)
    adapter = adapter_of(model)  # a serving engine: its checkpoint's attention weights
    idx = _layer_list(adapter, layers)
    options = {
        rank: {
            "variant": variant,
            "rank": rank,
            "top": top,
            "threshold": threshold,
            "heads": heads,
            "norm_position": adapter.norm_position,
            **({"circuit": circuit_digest(adapter)} if heads else {}),
        }
        for rank in dict.fromkeys(ranks)
    }
    reps: dict[int, int] = {}  # shared-weight group -> the layer computed for it
    for i in idx:
        reps.setdefault(adapter.layers[i].group, i)
    found = _compute_groups(adapter, reps, options, cache, progress)
    return {
        rank: [
            _relabel(found[rank][adapter.layers[i].group], i)
            if reps[adapter.layers[i].group] != i
            else found[rank][adapter.layers[i].group]
            for i in idx
        ]
        for rank in options
    }


def _check_top_threshold(top, threshold) -> tuple[int, float]:
    """(top, threshold) as int and float: top >= 1 and 0 < threshold <= 1, else a ValueError naming the argument."""
    if isinstance(top, bool) or not hasattr(top, "__index__") or operator.index(top) < 1:
        raise ValueError(f"top must be an integer >= 1 (leading eigenvectors kept per layer), got {top!r}")
    try:
        t = float(threshold) if not isinstance(threshold, bool | str) else math.nan
    except (TypeError, ValueError):
        t = math.nan
    if not 0 < t <= 1:  # NaN fails too
        raise ValueError(
            f"threshold must be a gap ratio with 0 < threshold <= 1 (above it a layer is near-degenerate), "
            f"got {threshold!r}"
        )
    return operator.index(top), t


def _compute_groups(
    adapter: Adapter, reps: dict[int, int], options: dict[str, dict], cache: bool, progress: bool | None = None
) -> dict[str, dict[int, LayerSpectrum]]:
    """{rank: one spectrum per shared-weight group}, layer by layer: memo, then disk cache, then eig.

    The eigen-decompositions run a few layers at a time (LAPACK's eig is mostly serial, so
    layers side by side use the cores it leaves idle), each with cores // workers BLAS threads;
    at most ``workers`` layers wait in flight, so an offloaded model holds only that many
    layers' factors at once. A layer missing under several rules is decomposed once for all.
    """
    ranks = list(options)
    found: dict[str, dict[int, LayerSpectrum]] = {r: {} for r in ranks}
    memo_keys: dict[tuple[str, int], tuple] = {}
    cores = _cores()
    workers = max(1, min(len(reps), cores))
    inflight: set[Future] = set()
    # weights on meta (offloaded, or empty): read one layer at a time, in order, so the first bad layer is named
    offloaded = any(p.device.type == "meta" for p in adapter.model.parameters())

    def collect(futures) -> None:
        for f in futures:
            g, specs = f.result()
            for r, spec in specs.items():
                found[r][g] = spec
        shown.update(completed=len(found[ranks[0]]))

    # every byte of each layer's weights hashed (once for every rule), layers side by side: xxhash lets go of the GIL
    digests = dict(zip(reps, parallel_map(lambda i: memo.digest(adapter, i), reps.values()))) if cache else {}
    # One layer (or one core): compute inline. LAPACK's eigvals is ~40% slower in a worker
    # thread than in the main one (measured with MKL here), so a pool only pays with >1 job.
    many = progress if progress is not None or len(reps) >= 8 else False  # a bar for 8+ layers, unless asked
    pool = _Inline() if workers == 1 else ThreadPoolExecutor(workers)
    first = next(iter(options.values()))  # the bar says which spectra: a run computes several sets
    said = f"spectra of {len(reps)} layers ({first['variant']}; {' and '.join(ranks)}"
    said += "; every head and group)" if first.get("heads") else ")"
    with bar(said, len(reps), many) as shown, _blas_threads(cores // workers), pool as ex:
        for g, i in reps.items():
            missing = []
            for r in ranks:
                mkey = memo.key(adapter, i, options[r], digests.get(g))
                hit = memo.get(mkey)
                if hit is not None:
                    found[r][g] = hit
                    continue
                missing.append(r)
                if mkey is not None:
                    memo_keys[(r, g)] = mkey
            if not missing:
                continue
            if len(inflight) >= workers:
                done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                collect(done)
            opts, name = {r: options[r] for r in missing}, _layer_name(adapter, i)
            if offloaded:  # brought in here, one layer at a time, in order; decomposed in the pool
                job = _read_layer(adapter, i, opts, cache)
                inflight.add(ex.submit(_compute_layer, g, i, job, cache, name))
            else:  # read, hashed, looked up and decomposed in the pool, layers side by side
                inflight.add(
                    ex.submit(
                        lambda g=g, i=i, o=opts, n=name: _compute_layer(
                            g, i, _read_layer(adapter, i, o, cache), cache, n
                        )
                    )
                )
        collect(inflight)
    for (r, g), mkey in memo_keys.items():
        memo.put(mkey, found[r][g])
    return found


@dataclass
class _Job:
    """One layer's work: the spectra found in the disk cache, and the rules still to compute."""

    factors: Factors | None
    w: torch.Tensor | None
    keys: dict[str, str | None]
    hits: dict[str, LayerSpectrum]
    todo: dict[str, dict]
    circuit: torch.Tensor | None = None  # W_E^T W_U for the heads' circuit copying


def _read_layer(adapter: Adapter, i: int, options: dict[str, dict], cache: bool) -> _Job:
    """Layer i's factors, disk-cache keys and cached spectra, for each ranking rule in ``options``.

    Offloaded weights are brought in for this layer only; what the eig needs is copied out
    (as the stacked float64 Ô, V, or every head's factors when per-head spectra are asked)
    before they go back to the offload map. Finiteness is checked once, by the eig on V O
    (a non-finite weight always reaches that product); only a failure looks at which
    weight it was.
    """
    ly = adapter.layers[i]
    some = next(iter(options.values()))
    with onloaded(adapter.model, _weight_modules(adapter, i, some["variant"])) as loaded:
        factors, w = layer_factors(adapter, i, some["variant"])
        if factors.O_heads.device.type == "meta" or factors.V_groups.device.type == "meta":
            raise ValueError(
                f"layer {i} ({ly.name or adapter.family}): its attention weights are still on the meta device "
                "after loading its offloaded modules; the adapter reads weights from a module that holds none. "
                "Dispatch the model with its attention modules offloaded whole, or report the model class."
            )
        keys = disk.cache_keys(factors, w, list(options.values())) if cache else [None] * len(options)
        keys = dict(zip(options, keys))
        hits = {r: spec for r in options if cache and (spec := disk.load_spectrum(keys[r], i)) is not None}
        todo = {r: o for r, o in options.items() if r not in hits}
        if todo and loaded:
            factors = copy_out(factors, some["heads"])
            w = None if w is None else w.clone()
    circuit = circuit_matrix(adapter) if todo and some["heads"] else None
    return _Job(factors if todo else None, w, keys, hits, todo, circuit)


def layer_stacked(adapter: Adapter, i: int, variant: str = "ov") -> tuple[torch.Tensor, torch.Tensor]:
    """(Ô, V) of layer i as float64 CPU copies (F = Ô V), offloaded weights brought in for it only."""
    with onloaded(adapter.model, _weight_modules(adapter, i, variant)):
        return layer_factors(adapter, i, variant)[0].stacked(torch.float64)


def weights_digest(adapter: Adapter, i: int) -> str:
    """Hash of the weights that define layer i's F in every variant: O, V and the attention norm's scale.

    The bytes as stored (dtype and layout included), so equal digests mean equal weights and a
    digest never depends on how the spectrum was computed. A layer with no weight rule (its F
    comes from the probe) hashes the parameters of its block. Offloaded weights are brought in
    for this layer only. 32 hex digits (xxh3-128).
    """
    ly = adapter.layers[i]
    if ly.factors is None:
        mods = [ly.block, ly.attn_in, ly.attn_out, ly.o_proj, ly.norm]
        with onloaded(adapter.model, mods):
            return memo.content_digest(adapter, i)
    with onloaded(adapter.model, _weight_modules(adapter, i, "ov_ln")):
        return memo.content_digest(adapter, i)


def _weight_modules(adapter: Adapter, i: int, variant: str) -> list:
    """The modules whose weights layer i's factors (and, for ov_ln, its norm) are read from.

    For offloaded weights, the factors are first read on meta (free): when they are views
    of parameters, only those parameters' modules are brought in (v_proj and o_proj, not
    q_proj and k_proj); otherwise the whole attention and its norm, as before.
    """
    ly = adapter.layers[i]
    if ly.factors is None:
        return []
    whole = [ly.attn_in, ly.attn_out, ly.o_proj, ly.norm]
    if not any(p.device.type == "meta" for p in memo.layer_parameters(adapter, i)):
        return whole
    try:
        f = adapter.factors(i)
    except Exception:  # a rule that cannot run on meta: bring the whole attention in
        return whole
    mods = source_modules(adapter.model, [f.O_heads, f.V_groups])
    if mods is None:
        return whole
    return mods + ([ly.norm] if variant == "ov_ln" else [])


def _compute_layer(g: int, i: int, job: _Job, cache: bool, name: str) -> tuple[int, dict[str, LayerSpectrum]]:
    """{rank: spectrum} of one layer: its disk-cache hits, and the rest from one decomposition."""
    if not job.todo:
        return g, dict(job.hits)
    o = next(iter(job.todo.values()))
    try:
        specs = layer_spectra(
            job.factors,
            ranks=tuple(job.todo),
            layer=i,
            variant=o["variant"],
            top=o["top"],
            threshold=o["threshold"],
            heads=o["heads"],
            circuit=job.circuit,
        )
    except NonFiniteError:
        raise ValueError(_non_finite_message(i, name, job.factors, job.w)) from None
    if cache:
        for r, spec in specs.items():
            disk.save_spectrum(spec, job.keys[r])
    return g, {**job.hits, **specs}


def _relabel(spec: LayerSpectrum, layer: int) -> LayerSpectrum:
    """Another layer's copy of a shared-weight group's spectrum: its own tensors and lists (``memo._fresh``),
    so editing one layer's in place never reaches the others."""
    from dataclasses import replace

    return replace(memo._fresh(spec), layer=layer)


def _layer_list(adapter: Adapter, layers) -> list[int]:
    """``layers`` (None: all) as a list of indices in 0..n_layers-1, each checked."""
    if layers is None:
        return list(range(adapter.n_layers))
    if isinstance(layers, str | bytes | dict) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of layer indices (or None: all), got {layers!r}; e.g. layers=[0, -1]")
    return [layer_index(i, adapter.n_layers, "layers: layer") for i in layers]


def _layer_name(adapter: Adapter, i: int) -> str:
    return adapter.layers[i].name or adapter.family


def _non_finite_message(i: int, name: str, factors: Factors, w) -> str:
    """Which of O, V and the folded norm scale hold inf or NaN (after the eig found V O non-finite)."""
    bad = [
        what
        for what, t in (("O", factors.O_heads), ("V", factors.V_groups), ("norm", w))
        if t is not None and not torch.isfinite(t).all()
    ]
    return (
        f"layer {i} ({name}): non-finite values in {', '.join(bad) or 'O or V'} weights; the spectrum is "
        "undefined. Check the checkpoint (an fp16 overflow?)."
    )

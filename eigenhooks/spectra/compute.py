"""Model-level entry points: ``spectra`` (cached) and ``verify`` (weights vs probe).

These join an adapter (which knows the model) with linalg.eig (which knows matrices).
"""

from __future__ import annotations

import logging
import math
import operator
import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
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
from ..models import Adapter, get_adapter, layer_index
from ..models.offload import onloaded, source_modules
from ..models.probe import apply_attention_many, probe_matrices
from . import memo

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
        heads: also compute per-head spectra F_h = O_h V_h and copying scores.
        top: leading eigenvectors kept per layer.
        threshold: gap ratio above which a layer is 'near-degenerate'.
        cache: use the in-process memo and the disk cache (``EIGENHOOKS_CACHE``); False
            recomputes every layer and stores nothing.

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
    return spectra_by_rank(
        model, variant, (rank,), layers=layers, heads=heads, top=top, threshold=threshold, cache=cache
    )[rank]


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
    adapter = get_adapter(model)
    idx = _layer_list(adapter, layers)
    options = {
        rank: {
            "variant": variant,
            "rank": rank,
            "top": top,
            "threshold": threshold,
            "heads": heads,
            "norm_position": adapter.norm_position,
        }
        for rank in dict.fromkeys(ranks)
    }
    reps: dict[int, int] = {}  # shared-weight group -> the layer computed for it
    for i in idx:
        reps.setdefault(adapter.layers[i].group, i)
    found = _compute_groups(adapter, reps, options, cache)
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def _blas_threads(n: int):
    """Limit the BLAS / LAPACK threads of torch and numpy/scipy to n while the layers run side by side,
    so that workers x BLAS threads never exceed the cores (oversubscribed BLAS dominated a GPU
    machine's entry: docs/scale.md, "Figures behind the code")."""
    before = torch.get_num_threads()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # then numpy/scipy keep their own threads; torch's are still limited
        threadpool_limits = None
    torch.set_num_threads(n)
    try:
        if threadpool_limits is None:
            yield
        else:
            with threadpool_limits(limits=n):
                yield
    finally:
        torch.set_num_threads(before)


def parallel_map(fn, items, serial: bool = False) -> list:
    """[fn(x) for x in items], side by side in threads (cores // workers BLAS threads each) unless serial."""
    items = list(items)
    workers = max(1, min(len(items), _cores()))
    if serial or workers == 1:
        return [fn(x) for x in items]
    with _blas_threads(max(1, _cores() // workers)), ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


def _compute_groups(
    adapter: Adapter, reps: dict[int, int], options: dict[str, dict], cache: bool
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

    # every byte of each layer's weights hashed (once for every rule), layers side by side: hashlib lets go of the GIL
    digests = dict(zip(reps, parallel_map(lambda i: memo.digest(adapter, i), reps.values()))) if cache else {}
    # One layer (or one core): compute inline. LAPACK's eigvals is ~40% slower in a worker
    # thread than in the main one (measured with MKL here), so a pool only pays with >1 job.
    with _blas_threads(max(1, cores // workers)), _Inline() if workers == 1 else ThreadPoolExecutor(workers) as ex:
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


class _Inline:
    """A stand-in for ThreadPoolExecutor that runs each job at once, in the calling thread."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # delivered by result(), as a pool would
            f.set_exception(e)
        return f


@dataclass
class _Job:
    """One layer's work: the spectra found in the disk cache, and the rules still to compute."""

    factors: Factors | None
    w: torch.Tensor | None
    keys: dict[str, str | None]
    hits: dict[str, LayerSpectrum]
    todo: dict[str, dict]


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
            factors = _copy_out(factors, some["heads"])
            w = None if w is None else w.clone()
    return _Job(factors if todo else None, w, keys, hits, todo)


def layer_stacked(adapter: Adapter, i: int, variant: str = "ov") -> tuple[torch.Tensor, torch.Tensor]:
    """(Ô, V) of layer i as float64 CPU copies (F = Ô V), offloaded weights brought in for it only."""
    with onloaded(adapter.model, _weight_modules(adapter, i, variant)):
        return layer_factors(adapter, i, variant)[0].stacked(torch.float64)


def weights_digest(adapter: Adapter, i: int) -> str:
    """Hash of the weights that define layer i's F in every variant: O, V and the attention norm's scale.

    The bytes as stored (dtype and layout included), so equal digests mean equal weights and a
    digest never depends on how the spectrum was computed. A layer with no weight rule (its F
    comes from the probe) hashes the parameters of its block. Offloaded weights are brought in
    for this layer only. 40 hex digits.
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


def _copy_out(factors: Factors, heads: bool) -> Factors:
    """A float64 CPU copy that outlives the onloaded weights: the stacked Ô (d, G d_head) and
    V, one factor pair per kv group (same F), unless per-head spectra need every O_h."""
    if heads:
        return Factors(
            factors.O_heads.detach().to("cpu", torch.float64, copy=True),
            factors.V_groups.detach().to("cpu", torch.float64, copy=True),
            factors.group_of_head.clone(),
        )
    O, V = factors.stacked(torch.float64)  # (d, G*dh), (G*dh, d): fresh tensors
    G = factors.V_groups.shape[0]
    return Factors.from_stacked(O, V, G, G)


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
        )
    except NonFiniteError:
        raise ValueError(_non_finite_message(i, name, job.factors, job.w)) from None
    if cache:
        for r, spec in specs.items():
            disk.save_spectrum(spec, job.keys[r])
    return g, {**job.hits, **specs}


def _relabel(spec: LayerSpectrum, layer: int) -> LayerSpectrum:
    from dataclasses import replace

    return replace(spec, layer=layer)


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


@dataclass
class Verification:
    """How well the weight-read F matches the F the model's forward code computes.

    ``check`` says what was compared: 'weights' (F from the weights against the probe) or
    'linearity' (a layer with no weight rule: the probe against its own superposition and
    scaling, so ``max_abs_diff`` is how far the probe is from a linear map). ``linearity``
    is that residual, relative to |F|, for every layer; ``linear`` is False when the value
    path is nonlinear (by the adapter's rule, or because the probe fails superposition), and
    then the probe is a local linearisation, never F.
    """

    layer: int
    max_abs_diff: float
    max_abs_F: float
    dtype: str
    check: str = "weights"
    linearity: float = float("nan")
    linear: bool = True

    @property
    def rel_diff(self) -> float:
        return self.max_abs_diff / self.max_abs_F if self.max_abs_F > 0 else self.max_abs_diff


_LINEAR_TOL = {"float64": 1e-9, "float32": 1e-4}  # relative superposition residual of a linear map


def verify(model, layers: list[int] | None = None, n_tokens: int = 2) -> list[Verification]:
    """Compare F from the weights with F from the identical-token probe, layer by layer.

    The probe runs in the model's own dtype: expect ~1e-12 relative in float64, ~1e-6 in
    float32 and ~1e-3 in fp16/bf16. Every layer's probe is also checked for linearity
    (superposition and scaling on seeded random inputs); layers with no weight rule are
    verified by that check alone, so no row is NaN.

    Args:
        layers: indices to verify (default: all; negative counts from the end).
        n_tokens: length of the identical-token probe sequence (1 skips the softmax).

    Returns:
        One Verification per layer.

    Raises:
        TypeError: layers is not a list of ints. IndexError: a layer out of range.
        ValueError: non-finite weights (the layer and O, V or the probe named), as ``spectra`` says.
    """
    adapter = get_adapter(model)
    idx = _layer_list(adapter, layers)
    probed = probe_matrices(adapter, idx, n_tokens=n_tokens)
    _finite_or_raise(adapter, idx, probed)
    lin = _linearity(adapter, idx, probed, n_tokens)
    dtype = str(next(adapter.model.parameters()).dtype).replace("torch.", "")
    tol = _LINEAR_TOL.get(dtype, 1e-2)
    rows = []
    for i in idx:
        F_p = probed[i]
        scale = float(F_p.abs().max())
        is_linear = adapter.layers[i].linear and lin[i] <= tol
        if adapter.layers[i].factors is None:
            rows.append(Verification(i, lin[i] * scale, scale, dtype, "linearity", lin[i], is_linear))
            continue
        F_w = adapter.factors(i).matrix()
        rows.append(
            Verification(i, float((F_w - F_p).abs().max()), float(F_w.abs().max()), dtype, "weights", lin[i], is_linear)
        )
    return rows


def _finite_or_raise(adapter: Adapter, idx: list[int], probed: dict) -> None:
    """A ValueError for the first layer whose O, V or probed F holds inf or NaN: no row of NaN is a verification."""
    for i in idx:
        if adapter.layers[i].factors is not None:
            f = adapter.factors(i)
            if not (torch.isfinite(f.O_heads).all() and torch.isfinite(f.V_groups).all()):
                raise ValueError(_non_finite_message(i, _layer_name(adapter, i), f, None))
        if not torch.isfinite(probed[i]).all():
            raise ValueError(
                f"layer {i} ({_layer_name(adapter, i)}): the identical-token probe's F holds inf or NaN (a non-finite "
                "weight or bias the attention reads: its query, key or value path); F is undefined. Check the "
                "checkpoint (an fp16 overflow?)."
            )


def _linearity(adapter: Adapter, idx: list[int], probed: dict, n_tokens: int) -> dict[int, float]:
    """Relative residual of the probe against the linear map it should be.

    P(x) is the probe's bias-free output. For seeded x, y at unit-to-large scales, compare
    P(a x + b y) with a P(x) + b P(y), and P(s x) with s P(x); also P(x) with F_probe x
    (the probe's own columns). A linear path gives rounding; a norm or a sink does not.
    """
    out = {}
    for d in sorted({adapter.width(i) for i in idx}):  # towers of one model may differ in width
        out.update(_linearity_at(adapter, [i for i in idx if adapter.width(i) == d], d, probed, n_tokens))
    return out


def _linearity_at(adapter: Adapter, idx: list[int], d: int, probed: dict, n_tokens: int) -> dict[int, float]:
    """``_linearity`` for layers of one residual width d."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, d, generator=g, dtype=torch.float64)
    a, b, s = 0.7, -1.3, 3.0
    X = torch.stack([x, y, a * x + b * y, s * x])
    P = apply_attention_many(adapter, idx, X, n_tokens=n_tokens)
    out = {}
    for i in idx:
        px, py, pxy, psx = P[i]
        ref = max(float(px.abs().max()), float(py.abs().max()), 1e-300)
        err = max(
            float((pxy - (a * px + b * py)).abs().max()) / (abs(a) + abs(b)),
            float((psx - s * px).abs().max()) / s,
            float((probed[i] @ x - px).abs().max()),
        )
        out[i] = err / ref
    return out

"""Token readouts of a direction, with a null: which tokens a direction (or a plane) looks like.

A direction u is read against each row w of the unembedding (``side="out"``, the final norm's
scale folded in) or of the input embedding (``side="in"``) by cos(u, w); a plane (a complex
eigenvector's span(Re v, Im v), or any (d, 2)) by the norm of each unit row's projection onto
it. The score has its own null: the same statistic over Haar-random directions (or 2-planes), so
a reader sees whether u is more token-like than chance (docs/concepts.md, "Token readouts").
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass

import torch

from ..models import Adapter, get_adapter
from ..models.probe import input_embeddings
from . import readout_views
from .tail import tail_p

log = logging.getLogger(__name__)
SIDES = ("out", "in")


@dataclass
class TokenReadout:
    """What a direction reads as, next to what a random one would.

    Attributes:
        side: 'out' (rows of the scaled unembedding) or 'in' (rows of the input embedding).
        kind: 'direction' (a (d,) vector: cosines) or 'plane' (a 2-plane: projection norms).
        k: how many tokens ``top`` and ``bottom`` list.
        top: [(token, score)], the k highest scores, highest first.
        bottom: [(token, score)], the k lowest cosines, lowest first (empty for a plane).
        score: the statistic: max(mean of the top k, -mean of the bottom k) for a direction (its
            sign is arbitrary), the mean of the top k for a plane.
        null_lo, null_hi: the 2.5% and 97.5% quantiles of ``score`` over ``null_draws`` Haar-random
            directions (or 2-planes) in the same rows.
        null_draws: how many random draws made the band.
        null_mean, null_sd: the draws' mean and standard deviation.
        p: an upper bound on the chance that a Haar-random subspace scores at least ``score``, from
            concentration of measure (``eigenhooks.spectra.tail``): fine enough for a correction over
            hundreds of readouts, however few the draws; NaN without draws.
        d: the dimension of the rows read against.
    """

    side: str
    kind: str
    k: int
    top: list[tuple[str, float]]
    bottom: list[tuple[str, float]]
    score: float
    null_lo: float
    null_hi: float
    null_draws: int
    null_mean: float = float("nan")
    null_sd: float = float("nan")
    p: float = float("nan")
    d: int = 0

    def __repr__(self) -> str:  # score, band, p and the first tokens, in two or three lines
        return readout_views.readout_repr(self)

    def to_frame(self):
        """The listed tokens as a pandas DataFrame (end, rank, token, score); score, band and p in ``attrs``."""
        return readout_views.to_frame(self)

    def _repr_html_(self) -> str:
        return readout_views.repr_html(self)


def scaled_unembedding(model, dtype=torch.float32) -> torch.Tensor:
    """W' (vocab, d): the unembedding with the final norm's scale folded in, on the CPU.

    logits = W_U (s * x_hat) (+ bias), so W' = W_U diag(s) maps the normalised final residual
    x_hat to the logits (the norm's centring and bias are not linear in x and are left out). s is the
    final norm's effective scale, ``Adapter.final_norm_scale`` (Gemma's 1 + w), folded in float64.

    Raises:
        ValueError: the model has no unembedding of width d_model.
    """
    ad = get_adapter(model)
    W_U = ad.unembedding()
    if W_U is None or W_U.dim() != 2 or W_U.shape[1] != ad.d_model:
        got = None if W_U is None else tuple(W_U.shape)
        raise ValueError(
            f"{ad.family}: expected an unembedding (vocab, d_model={ad.d_model}), got {got}; "
            "load the model with its LM head (e.g. AutoModelForCausalLM) to take a token direction"
        )
    s = ad.final_norm_scale()  # (d,) float64
    if s is None:
        return W_U.detach().to("cpu", dtype)
    return W_U.detach().to("cpu", dtype) * s.to("cpu", dtype)  # s formed in float64, rounded once


def embedding(model, dtype=torch.float32) -> torch.Tensor:
    """W_E (vocab, d): the input embedding as the model stores it, on the CPU.

    Raises:
        ValueError: the model has no token embedding of width d_model.
    """
    ad = get_adapter(model)
    W = embedding_weight(ad)
    if W is None or W.dim() != 2 or W.shape[1] != ad.d_model:
        got = None if W is None else tuple(W.shape)
        raise ValueError(f"{ad.family}: expected a token embedding (vocab, d_model={ad.d_model}), got {got}")
    return W.detach().to("cpu", dtype)


def embedding_weight(ad: Adapter) -> torch.Tensor | None:
    if ad.backend == "lens":  # TransformerLens (HookedTransformer and the bridge) stores W_E (vocab, d)
        return getattr(ad.model, "W_E", None)
    w = getattr(input_embeddings(ad.model), "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def token_rows(model, side: str, dtype=torch.float64) -> torch.Tensor:
    """The rows a readout scores against: the scaled unembedding (out) or the embedding (in), (vocab, d)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    return scaled_unembedding(model, dtype) if side == "out" else embedding(model, dtype)


def as_subspace(u, d: int) -> torch.Tensor:
    """u as an orthonormal (d, 1) direction or (d, 2) plane, float64.

    A real (d,) or (d, 1) vector is a direction; a (d, 2) matrix is the plane of its two columns; a
    complex (d,) vector is span(Re u, Im u), as the monitor's targets read it: a plane for a complex
    eigenvector, one direction (k = 1, the phase dropped, with the sign of the larger part) for a real
    vector stored as complex or turned by a phase e^{i theta}. A spectrum (LayerSpectrum,
    HeadSpectrum, GroupSpectrum) gives its principal basis.

    Raises:
        ValueError: u is no numeric vector (None, a string), has the wrong shape, non-finite entries,
            or is zero (or its two columns are parallel).
    """
    basis = getattr(u, "basis", None)
    if basis is not None:
        u = basis
    expected = f"expected a (d={d},) direction, a (d, 2) plane, a complex (d,) vector or a spectrum"
    if u is None or isinstance(u, (str, bytes)):
        raise ValueError(f"u: {expected}, got {type(u).__name__} {u!r:.40}")
    try:
        u = torch.as_tensor(u).detach().to("cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"u: {expected}, got {type(u).__name__} ({e})") from None
    if u.dtype == torch.bool or not (u.is_floating_point() or u.is_complex() or u.dtype in _INTS):
        raise ValueError(f"u: {expected}, got a tensor of {u.dtype}")
    shape = tuple(u.shape)
    if u.is_complex() and u.dim() == 2 and u.shape[1] == 1:
        u = u[:, 0]
    if (
        (u.dim() not in (1, 2))
        or u.shape[0] != d
        or (u.dim() == 2 and u.shape[1] not in (1, 2))
        or (u.is_complex() and u.dim() != 1)
    ):
        raise ValueError(f"u: {expected}, got shape {shape}")
    bad = ~torch.isfinite(u)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"u has {int(bad.sum())} of {u.numel()} entries NaN or inf (the first at {at[0] if len(at) == 1 else at}, "
            f"{u[at].item()}); pass a finite direction"
        )
    if u.is_complex():
        u = _real_span(u.to(torch.complex128), _rounding(u.dtype, d))
    u = u.double()
    if u.dim() == 1:
        u = u[:, None]
    Q, R = torch.linalg.qr(u)
    if float(R.diagonal().abs().min()) <= 1e-12 * max(float(R.abs().max()), 1e-300):
        what = "zero" if float(u.abs().max()) == 0 or u.shape[1] == 1 else "two parallel columns (one direction)"
        raise ValueError(f"u is {what} (shape {shape}); nothing to read: pass a nonzero direction or a plane")
    return Q * torch.sign(R.diagonal())  # QR may flip a column: keep u's own sign (top is +u's side)


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _rounding(dtype: torch.dtype, d: int) -> float:
    """How far rounding to ``dtype`` moves a unit vector: 4 eps + sqrt(d)/16 eps (monitor.stats.rounding)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    return eps * (4 + math.sqrt(d) / 16)


def _real_span(u: torch.Tensor, noise: float) -> torch.Tensor:
    """span(Re u, Im u) of a complex (d,) u: (d, 2) for a plane, (d,) for a real vector turned by a phase.

    Re and Im parallel (the smaller singular value under the rounding of u's dtype) is one direction,
    signed as the larger of the two parts, the rule the monitor's complex targets follow.
    """
    R = torch.stack([u.real, u.imag], 1)  # (d, 2)
    W, S, _ = torch.linalg.svd(R, full_matrices=False)
    if float(S[0]) == 0 or float(S[1]) > noise * float(S[0]):
        return R
    ref = u.real if u.real.norm() >= u.imag.norm() else u.imag
    return W[:, 0] * (1.0 if float(W[:, 0] @ ref) >= 0 else -1.0) * S[0]


def _unit_rows(W: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(W, dim=1, keepdim=True)
    return W / n.clamp_min(1e-300)


def _stats(Wn: torch.Tensor, Q: torch.Tensor, k: int) -> torch.Tensor:
    """The readout statistic of each of c subspaces: Q (c, d, m), m = 1 (directions) or 2 (planes); (c,)."""
    P = torch.einsum("vd,cdm->vcm", Wn, Q)  # (vocab, c, m)
    if Q.shape[2] == 1:
        s = P[..., 0]  # (vocab, c): cosines
        return torch.maximum(s.topk(k, 0).values.mean(0), (-s).topk(k, 0).values.mean(0))
    return torch.linalg.vector_norm(P, dim=2).topk(k, 0).values.mean(0)


def null_band(Wn: torch.Tensor, m: int, k: int, draws: int, seed: int) -> tuple[float, float]:
    """2.5% and 97.5% quantiles of the statistic over ``draws`` Haar-random m-subspaces of R^d."""
    return null_summary(Wn, m, k, draws, seed)[:2]


def null_summary(Wn: torch.Tensor, m: int, k: int, draws: int, seed: int) -> tuple[float, float, float, float]:
    """(2.5% quantile, 97.5% quantile, mean, standard deviation) of the statistic over ``draws``
    Haar-random m-subspaces of R^d; NaN without draws."""
    nan = float("nan")
    if draws < 1:
        return nan, nan, nan, nan
    g = torch.Generator().manual_seed(seed)
    d = Wn.shape[1]
    out = []
    for start in range(0, draws, 32):  # (vocab, 32, m) at a time
        c = min(32, draws - start)
        G = torch.randn(c, d, m, generator=g, dtype=torch.float64)
        out.append(_stats(Wn, torch.linalg.qr(G.to(Wn.dtype))[0], k))  # Haar: QR of a Gaussian
    s = torch.cat(out).double()
    sd = float(s.std()) if draws > 1 else nan
    return float(torch.quantile(s, 0.025)), float(torch.quantile(s, 0.975)), float(s.mean()), sd


def read_rows(P: torch.Tensor, k: int, decode) -> tuple[list, list, float]:
    """(top, bottom, score) from P (vocab, m) = unit rows @ an orthonormal Q (d, m), m = 1 or 2."""
    if P.shape[1] == 1:
        s = P[:, 0]
        hi, lo = s.topk(k), (-s).topk(k)
        top = [(decode(int(i)), float(v)) for v, i in zip(hi.values, hi.indices)]
        bottom = [(decode(int(i)), -float(v)) for v, i in zip(lo.values, lo.indices)]
        return top, bottom, max(float(hi.values.mean()), float(lo.values.mean()))
    hi = torch.linalg.vector_norm(P, dim=1).topk(k)
    return [(decode(int(i)), float(v)) for v, i in zip(hi.values, hi.indices)], [], float(hi.values.mean())


def read_tokens_many(
    model, tokenizer, vectors: list, k: int = 10, side: str = "out", null_draws: int = 200, seed: int = 0
) -> list[TokenReadout]:
    """``read_tokens`` for several vectors: the rows, each kind's null band and one product are made once.

    All the vectors' columns go through one (vocab, d) @ (d, n) product, so the rows are read from
    memory once, not once per vector (360 readouts on SmolLM2: one pass over its 49152 x 576 rows).
    """
    if not _is_int(k) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not _is_int(null_draws) or null_draws < 0:
        raise ValueError(f"null_draws must be an int >= 0 (0: no null band), got {null_draws!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int (the null's seed), got {seed!r}")
    if isinstance(vectors, (str, bytes)) or not hasattr(vectors, "__iter__"):
        raise ValueError(f"vectors must be a list of directions, got {type(vectors).__name__}")
    k, null_draws, seed = int(k), int(null_draws), int(seed)
    Wn = _unit_rows(token_rows(model, side))  # (vocab, d) float64
    k = min(k, Wn.shape[0])
    decode = _decoder(model, tokenizer)
    Qs = [as_subspace(u, Wn.shape[1]) for u in vectors]  # (d, m) each
    nulls = {m: null_summary(Wn, m, k, null_draws, seed) for m in sorted({Q.shape[1] for Q in Qs})}
    cols = torch.cat(Qs, 1) if Qs else torch.zeros(Wn.shape[1], 0, dtype=Wn.dtype)  # (d, sum of m)
    P = torch.cat([Wn @ cols[:, i : i + 256] for i in range(0, cols.shape[1], 256)], 1) if Qs else None
    out, at = [], 0
    for Q in Qs:
        m = Q.shape[1]
        top, bottom, score = read_rows(P[:, at : at + m], k, decode)  # (vocab, m) of this vector
        at += m
        lo, hi, mean, sd = nulls[m]
        p = tail_p(score, mean, sd, null_draws, Wn.shape[1], m)
        kind = "direction" if m == 1 else "plane"
        out.append(TokenReadout(side, kind, k, top, bottom, score, lo, hi, null_draws, mean, sd, p, Wn.shape[1]))
    return out


def read_tokens(
    model, tokenizer, u, k: int = 10, side: str = "out", null_draws: int = 200, seed: int = 0
) -> TokenReadout:
    """Which tokens a direction reads as, and the band a random direction would fall in.

    Args:
        model: a HuggingFace or TransformerLens model (or an Adapter).
        tokenizer: decodes token ids (None: the model's own ``tokenizer``, as TransformerLens keeps one).
        u: a (d,) direction; a complex (d,) vector or a (d, 2) matrix (a plane); or a spectrum
            (LayerSpectrum, HeadSpectrum, GroupSpectrum), read through its principal basis.
        k: tokens listed at each end, and averaged in the score.
        side: 'out' scores each row of the unembedding (final norm's scale folded in): the tokens
            the direction writes toward; 'in' scores each row of the input embedding.
        null_draws: Haar-random directions (or planes) for the null band (0: no band, NaN).
        seed: the null's seed.

    Returns:
        A TokenReadout (top, bottom, score, null_lo, null_hi).

    Raises:
        ValueError: a bad side, k or u; a model without an unembedding (side='out') or embedding.

    Example:
        >>> model, tok = eh.zoo.load("gpt2-tiny")  # doctest: +SKIP
        >>> r = eh.read_tokens(model, tok, eh.spectra(model)[0])  # doctest: +SKIP
        >>> r.score > r.null_hi  # more token-like than chance?  # doctest: +SKIP
    """
    return read_tokens_many(model, tokenizer, [u], k=k, side=side, null_draws=null_draws, seed=seed)[0]


def _is_int(x) -> bool:
    """An int (numpy's and a 0-d integer tensor's too), never a bool."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and (x.numel() != 1 or x.is_floating_point())):
        return False
    return isinstance(x, numbers.Integral) or (isinstance(x, torch.Tensor) and x.dtype != torch.bool)


def _decoder(model, tokenizer):
    tok = tokenizer if tokenizer is not None else getattr(get_adapter(model).model, "tokenizer", None)
    if tok is None:
        return str  # no tokenizer: the token id as text
    return lambda i: tok.decode([i])

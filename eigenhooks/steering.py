"""Rank-1 steering of a layer's output matrix toward a chosen direction, reversibly.

O_L' = O_L + alpha u w^T with w = V_L u / ||V_L u|| (V_L the per-head value projections
stacked, grouped values repeated per head), so F' = F + alpha u (V_L^T w)^T and
F' u = F u + alpha ||V_L u|| u: for large alpha, u becomes the principal eigenvector of F'
and the gap grows with alpha (DESIGN.md §1, steering).

Two modes give the same outputs: ``edit`` adds the term to the output projection's weight
and restores the saved weight bit-exactly on exit; ``hook`` adds alpha u (w . z) to the
projection's output from its input z, through a forward hook, and never touches weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .models import Adapter, UnsupportedModelError, get_adapter
from .spectrum import Factors, layer_spectrum

log = logging.getLogger(__name__)


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"  # GPT-2 stores (in, out)


def value_stack(factors: Factors) -> torch.Tensor:
    """V_L (H*d_head, d), float64: each head's value projection (its group's, under GQA)."""
    V = factors.V_groups.detach().to("cpu", torch.float64)[factors.group_of_head.cpu()]  # (H, d_head, d)
    return V.reshape(-1, V.shape[-1])


def steered_factors(factors: Factors, u: torch.Tensor, w: torch.Tensor, alpha: float) -> Factors:
    """Factors of F' = (O + alpha u w^T) V; w (H*d_head,) split into heads."""
    H, d, dh = factors.O_heads.shape
    O = factors.O_heads.detach().to("cpu", torch.float64) + alpha * u[None, :, None] * w.reshape(H, 1, dh)
    V = factors.V_groups.detach().to("cpu", torch.float64)
    return Factors(O, V, factors.group_of_head)


def check_direction(u, d: int) -> torch.Tensor:
    """A unit vector of width d as float64, or a ValueError that says what is wrong."""
    u = torch.as_tensor(u).detach().to("cpu", torch.float64)
    if u.dim() != 1 or u.shape[0] != d:
        raise ValueError(f"direction must be a vector of the model's width d={d}, got shape {tuple(u.shape)}")
    if not torch.isfinite(u).all():
        raise ValueError("direction has non-finite entries")
    n = float(torch.linalg.vector_norm(u))
    if n == 0:
        raise ValueError("direction is the zero vector")
    if abs(n - 1) > 1e-3:
        raise ValueError(f"direction must be a unit vector, got norm {n:.4g}; pass u / u.norm()")
    return u / n


@dataclass
class SteerReport:
    layer: int
    alpha: float
    lambda_1: complex
    gap_ratio: float
    cos_v1_u: float
    lambda_1_before: complex
    gap_ratio_before: float
    alignment_before: float | None = None
    alignment_after: float | None = None
    prob_before: float | None = None
    prob_after: float | None = None


class Steer:
    """Context manager made by ``eigenhooks.steer``; see there."""

    def __init__(
        self, model, direction, layer=-1, alpha=None, gap_ratio=None, mode="edit", allow_shared=False, rank="modulus"
    ):
        if mode not in ("edit", "hook"):
            raise ValueError(f"mode must be 'edit' or 'hook', got {mode!r}")
        if (alpha is None) == (gap_ratio is None):
            raise ValueError("give exactly one of alpha and gap_ratio")
        if gap_ratio is not None and not 0 < gap_ratio < 1:
            raise ValueError(f"gap_ratio must be in (0, 1), got {gap_ratio}")
        self.adapter: Adapter = get_adapter(model)
        ad = self.adapter
        n = ad.n_layers
        if not -n <= layer < n:
            raise IndexError(f"layer {layer} is out of range for a model with {n} attention layers")
        self.layer = layer % n
        self.mode, self.rank = mode, rank
        ly = ad.layers[self.layer]
        shared = next(g for g in ad.shared_groups() if self.layer in g)
        if len(shared) > 1 and not allow_shared:
            raise ValueError(
                f"layer {self.layer} shares its weights with layers {shared}: steering it changes all of them. "
                "Pass allow_shared=True to do it anyway."
            )
        self.shared_with = shared
        if ly.o_proj is None:
            raise UnsupportedModelError(f"{ad.family}: no output projection module known for layer {self.layer}")
        self.o_proj = ly.o_proj
        self.factors = ad.factors(self.layer)
        self.u = check_direction(direction, ad.d_model)
        V = value_stack(self.factors)
        Vu = V @ self.u
        norm_vu = float(torch.linalg.vector_norm(Vu))
        scale = float(torch.linalg.matrix_norm(V, 2))
        if norm_vu < 1e-6 * max(scale, 1e-30):
            raise ValueError(
                f"V u is ~0 at layer {self.layer} (||V u|| = {norm_vu:.3g}): the rank-1 change cannot make u principal"
            )
        self.w = Vu / norm_vu
        self.norm_vu = norm_vu
        self.before = layer_spectrum(self.factors, layer=self.layer, rank=rank)
        self.alpha = float(alpha) if alpha is not None else self._solve_alpha(gap_ratio)
        self.after = layer_spectrum(
            steered_factors(self.factors, self.u, self.w, self.alpha), layer=self.layer, rank=rank
        )
        self._saved = None
        self._handles = []
        self._last_call = None
        self._last_out = None

    def _solve_alpha(self, target: float) -> float:
        """Smallest alpha >= 0 whose steered gap ratio (with u principal) reaches target, by bisection."""

        def gap(a):
            s = layer_spectrum(steered_factors(self.factors, self.u, self.w, a), rank=self.rank)
            cos = float((s.basis.T @ self.u).norm())
            return s.gap_ratio if cos > 0.9 else 1.0

        hi = max(abs(self.before.lambda_1), 1e-3) / (target * self.norm_vu)
        for _ in range(60):
            if gap(hi) <= target:
                break
            hi *= 2
        else:
            raise RuntimeError(f"no alpha up to {hi:.3g} reaches gap ratio {target}")
        lo = 0.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if gap(mid) <= target else (mid, hi)
            if hi - lo < 1e-4 * hi:
                break
        return hi

    # ---- lifecycle ----
    def __enter__(self) -> Steer:
        try:
            if self.mode == "edit":
                self._edit()
            self._register()
        except BaseException:
            self._undo()  # all-or-nothing
            raise
        return self

    def _register(self) -> None:
        if self.mode == "hook":
            self._handles.append(self.o_proj.register_forward_hook(self._hook))
        self._handles.append(self.adapter.model.register_forward_pre_hook(self._remember, with_kwargs=True))
        self._handles.append(self.adapter.model.register_forward_hook(self._capture_output))
        self._handles.append(self.adapter.layers[-1].block.register_forward_hook(self._capture_final))

    def __exit__(self, *exc) -> None:
        self._undo()

    def _undo(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._saved is not None:
            with torch.no_grad():
                self.o_proj.weight.copy_(self._saved)  # bit-exact: the saved tensor itself
            self._saved = None

    def _delta(self, like: torch.Tensor) -> torch.Tensor:
        """alpha u w^T in the layout of the projection's weight."""
        D = self.alpha * torch.outer(self.u, self.w)  # (d, H*d_head)
        return (D.T if _is_conv1d(self.o_proj) else D).to(like.device, like.dtype)

    def _edit(self) -> None:
        W = self.o_proj.weight
        self._saved = W.detach().clone()
        with torch.no_grad():
            W.add_(self._delta(W))

    def _hook(self, module, args, output):
        z = args[0]  # (..., H*d_head): the heads' outputs entering the projection
        w = self.w.to(z.device, z.dtype)
        u = self.u.to(z.device, z.dtype)
        return output + self.alpha * (z @ w)[..., None] * u

    def _remember(self, module, args, kwargs):
        self._last_call = (args, kwargs)

    def _capture_output(self, module, args, output):
        self._last_out = output

    def _capture_final(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        self._final = out.detach()

    # ---- report ----
    def _rerun_unsteered(self):
        args, kwargs = self._last_call
        for h in self._handles:
            h.remove()
        self._handles = []
        was_edit = self._saved is not None
        if was_edit:
            with torch.no_grad():
                self.o_proj.weight.copy_(self._saved)
        try:
            hold = {}
            h = self.adapter.layers[-1].block.register_forward_hook(
                lambda m, a, o: hold.__setitem__("final", (o[0] if isinstance(o, tuple) else o).detach())
            )
            try:
                with torch.no_grad():
                    out = self.adapter.model(*args, **kwargs)
            finally:
                h.remove()
        finally:
            if was_edit:
                with torch.no_grad():
                    self.o_proj.weight.add_(self._delta(self.o_proj.weight))
            self._register()
        return out, hold["final"]

    def report(self, target_token: int | None = None) -> SteerReport:
        """The steered layer's new spectrum and, for the last run inside the block, the final
        residuals' mean |cos| with u and (given a token id) its next-token probability, before and after.
        """
        cos = float((self.after.basis.T @ self.u).norm())
        rep = SteerReport(
            self.layer,
            self.alpha,
            self.after.lambda_1,
            self.after.gap_ratio,
            cos,
            self.before.lambda_1,
            self.before.gap_ratio,
        )
        if self._last_out is None or not self._handles:
            return rep
        after_out, after_final = self._last_out, self._final  # from the last steered run
        before_out, before_final = self._rerun_unsteered()
        rep.alignment_before = mean_abs_cos(before_final, self.u)
        rep.alignment_after = mean_abs_cos(after_final, self.u)
        if target_token is not None:
            rep.prob_before = next_token_prob(before_out, target_token)
            rep.prob_after = next_token_prob(after_out, target_token)
        return rep


def mean_abs_cos(X: torch.Tensor, u: torch.Tensor) -> float:
    """Mean |<x, u>| / ||x|| over the tokens of X (..., d)."""
    X = X.to(torch.float64).reshape(-1, X.shape[-1])
    return float(((X @ u.to(X.device)).abs() / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)).mean())


def next_token_prob(output, token: int) -> float:
    """Mean probability of token at the last position of each sequence."""
    logits = output.logits if hasattr(output, "logits") else output
    return float(torch.softmax(logits[:, -1].double(), -1)[:, token].mean())


def steer(
    model,
    direction,
    layer: int = -1,
    alpha: float | None = None,
    gap_ratio: float | None = None,
    mode: str = "edit",
    allow_shared: bool = False,
    rank: str = "modulus",
) -> Steer:
    """Steer ``layer`` toward unit direction u by a rank-1 change of its output matrix.

    Args:
        model: an HF or TransformerLens (bridge) model.
        direction: (d,) unit vector (see ``eigenhooks.direction``).
        layer: attention layer index (default the last).
        alpha: the size of the change; or
        gap_ratio: solve alpha so the steered layer's gap ratio reaches this (u principal).
        mode: 'edit' (weights changed, restored bit-exactly on exit) or 'hook' (weights untouched).
        allow_shared: required to steer a layer whose weights other layers share (ALBERT).

    Example:
        >>> with eh.steer(model, u, gap_ratio=0.1) as s:    # doctest: +SKIP
        ...     out = model(**batch)
        >>> s.report().cos_v1_u                               # doctest: +SKIP
    """
    return Steer(model, direction, layer, alpha, gap_ratio, mode, allow_shared, rank)

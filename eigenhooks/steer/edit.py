"""Rank-1 steering of a layer's output matrix toward a chosen direction, reversibly.

The default (``method="exact"``) changes O_L by ΔO = (lambda u - F u) bᵀ with bᵀ V u = 1,
so u is an exact eigenvector of F' = O' V, with lambda set by the requested gap ratio
(cos(v_1', u) = 1 up to rounding). Its read-out b is chosen from calibration data so
that the typical token is pushed toward +u, not -u (``signed``). ``method="paper"`` is
Li & Altafini's O' = O + alpha u wᵀ, w = V u / ||V u||, symmetric in ±u. The algebra is in
``rank1.py``; the construction is explained in docs/steering.md.

Two modes give the same outputs: ``edit`` adds ΔO to the output projection's weight and
restores the saved weight bit-exactly on exit (also after an exception); ``hook`` adds
a (bᵀ z) to the projection's output from its input z and never touches weights.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch

from ..linalg.eig import Factors, layer_spectrum
from ..linalg.views import fmt_lambda
from ..models import Adapter, UnsupportedModelError, get_adapter, layer_index
from . import rank1
from .calibration import value_activations
from .positions import last_logits, mean_abs_cos, next_token_probs, real_tokens

log = logging.getLogger(__name__)
METHODS = ("exact", "paper")
MODES = ("edit", "hook")
DEFAULT_GAP_RATIO = 0.1
_EDITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # o_proj -> the Steer editing it


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"  # GPT-2 stores (in, out)


def check_direction(u, d: int) -> torch.Tensor:
    """A unit vector of width d as float64, or a ValueError that says what is wrong."""
    u = torch.as_tensor(u).detach().to("cpu", torch.float64)
    if u.dim() != 1 or u.shape[0] != d:
        raise ValueError(f"direction must be a vector of the model's width d={d}, got shape {tuple(u.shape)}")
    if not torch.isfinite(u).all():
        raise ValueError("direction has non-finite entries; pass a finite unit vector")
    n = float(torch.linalg.vector_norm(u))
    if n == 0:
        raise ValueError("direction is the zero vector; pass a unit vector")
    if abs(n - 1) > 1e-3:
        raise ValueError(f"direction must be a unit vector, got norm {n:.4g}; pass u / u.norm()")
    return u / n


def check_strength(alpha, gap_ratio) -> tuple[float | None, float | None]:
    """Validate (alpha, gap_ratio); neither given means gap_ratio = 0.1.

    Raises:
        ValueError: both given, alpha not finite, or gap_ratio outside (0, 1).
    """
    if alpha is not None and gap_ratio is not None:
        raise ValueError(f"give exactly one of alpha and gap_ratio, got alpha={alpha} and gap_ratio={gap_ratio}")
    if alpha is None and gap_ratio is None:
        gap_ratio = DEFAULT_GAP_RATIO
    if alpha is not None and not math.isfinite(float(alpha)):
        raise ValueError(f"alpha must be a finite number, got {alpha}; e.g. alpha=5.0, or use gap_ratio")
    if gap_ratio is not None and not 0 < float(gap_ratio) < 1:
        raise ValueError(f"gap_ratio must be in (0, 1), got {gap_ratio}")
    return (None if alpha is None else float(alpha)), (None if gap_ratio is None else float(gap_ratio))


def check_steered(before, after, alpha, gap_ratio) -> None:
    """Refuse a steering that drove the model's next-token probabilities to NaN or inf (a table of NaN)."""
    if not bool(torch.isfinite(before).all()):
        raise ValueError("the model's own next-token probabilities are not finite (NaN or inf in its weights?)")
    if not bool(torch.isfinite(after).all()):
        strength = f"alpha={alpha:g}" if alpha is not None else f"gap_ratio={gap_ratio:g}"
        raise ValueError(
            f"steering with {strength} drove the model's outputs to NaN or inf (too strong for its activations' "
            "range): give a smaller alpha, or gap_ratio instead"
        )


@dataclass
class SteerReport:
    """What a steering did: the steered layer's spectrum and, after a run, its effect.

    alignment_*: mean |cos| of the last block's outputs with u, over the real tokens (the call's
    attention_mask); prob_*: the target token's next-token probability at each sequence's last real
    token (the last position its attention_mask keeps: with right padding the batch's last column is a
    pad), averaged over the sequences, and ``prob_raised`` of the ``n_sequences`` where steering raised
    it; all for the last run inside the block, unsteered (before) and steered (after). A mean can rise
    while most sequences fall: the rank-1 change pushes each token along +u or -u by the sign of its
    read-out (docs/steering.md, "Which tokens move which way").
    """

    layer: int
    alpha: float
    lambda_1: complex
    gap_ratio: float
    cos_v1_u: float
    lambda_1_before: complex
    gap_ratio_before: float
    method: str = "exact"
    signed: bool = True
    lam: float | None = None
    calibration_positive: float | None = None  # share of calibration tokens pushed toward +u
    alignment_before: float | None = None
    alignment_after: float | None = None
    prob_before: float | None = None
    prob_after: float | None = None
    prob_raised: int | None = None  # sequences whose target-token probability steering raised
    n_sequences: int | None = None

    def __repr__(self) -> str:  # two lines: the spectrum's change, then the effect of the last run
        how = f"{self.method}{', signed' if self.signed else ''}"
        lines = [
            f"SteerReport(layer {self.layer}, {how}, alpha {self.alpha:.4g}: λ1 {fmt_lambda(self.lambda_1_before)} -> "
            f"{fmt_lambda(self.lambda_1)}, gap ratio {self.gap_ratio_before:.3f} -> {self.gap_ratio:.3f}, "
            f"cos(v1', u) {self.cos_v1_u:.4f}"
        ]
        said = []
        if self.alignment_before is not None:
            said.append(f"final residuals' |cos| with u {self.alignment_before:.3f} -> {self.alignment_after:.3f}")
        if self.prob_before is not None:
            said.append(
                f"target token's p at each sequence's last real token, mean {self.prob_before:.3g} -> "
                f"{self.prob_after:.3g} (raised in {self.prob_raised} of {self.n_sequences})"
            )
        lines.append("  " + ("; ".join(said) if said else "no run inside the block yet") + ")")
        return "\n".join(lines)


class Steer:
    """Context manager made by ``eigenhooks.steer``; see there."""

    def __repr__(self) -> str:
        state = "active" if getattr(self, "_active", False) else "inactive"
        return f"Steer(layer={self.layer}, mode={self.mode!r}, method={self.method!r}, signed={self.signed}, {state})"

    def __init__(
        self,
        model,
        direction,
        layer=-1,
        alpha=None,
        gap_ratio=None,
        mode="edit",
        allow_shared=False,
        rank="modulus",
        method="exact",
        signed=None,
        calibration=None,
        progress=None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "paper" and signed:
            raise ValueError("the paper's construction is symmetric in ±u by definition; use method='exact' for signed")
        alpha, gap_ratio = check_strength(alpha, gap_ratio)
        self.adapter: Adapter = get_adapter(model)
        self.layer = self._check_layer(layer, allow_shared)
        self.mode, self.rank, self.method = mode, rank, method
        self.signed = (method == "exact") if signed is None else bool(signed)
        self.o_proj = self.adapter.layers[self.layer].o_proj
        self.factors: Factors = self.adapter.factors(self.layer)
        self.u = check_direction(direction, self.adapter.width(self.layer))
        self.before = layer_spectrum(self.factors, layer=self.layer, rank=rank)
        self.calibration_positive = None
        self.change = self._construct(alpha, gap_ratio, calibration, progress)
        self.alpha = self.change.alpha
        self.after = layer_spectrum(rank1.steered_factors(self.factors, self.change), layer=self.layer, rank=rank)
        self._saved = self._edited = None
        self._handles: list = []
        self._active = False
        self._last_call = self._last_out = self._final = None  # the last steered call, its logits, its residuals
        self._unsteered = None  # after exit: that call run again on the restored model (logits, residuals)

    def _check_layer(self, layer: int, allow_shared: bool) -> int:
        ad = self.adapter
        layer = layer_index(layer, ad.n_layers)
        shared = next(g for g in ad.shared_groups() if layer in g)
        if len(shared) > 1 and not allow_shared:
            raise ValueError(
                f"layer {layer} shares its weights with layers {shared}: steering it changes all of them. "
                "Pass allow_shared=True to do it anyway."
            )
        self.shared_with = shared
        if ad.layers[layer].o_proj is None:
            raise UnsupportedModelError(f"{ad.family}: no output projection module known for layer {layer}")
        return layer

    def _construct(self, alpha, gap_ratio, calibration, progress) -> rank1.Rank1:
        """The rank-1 change ΔO = a bᵀ for the requested method and strength."""
        V = rank1.value_stack(self.factors)
        Vu = V @ self.u
        norm_vu = float(torch.linalg.vector_norm(Vu))
        if norm_vu < 1e-6 * max(float(torch.linalg.matrix_norm(V, 2)), 1e-30):
            raise ValueError(
                f"V u is ~0 at layer {self.layer} (||V u|| = {norm_vu:.3g}): no rank-1 change of O can make u "
                "an eigenvector there; steer another layer or another direction"
            )
        self.norm_vu = norm_vu
        if self.method == "paper":
            return rank1.paper(self.factors, self.u, alpha if alpha is not None else self._solve_alpha(gap_ratio))
        z_mean = None
        if self.signed:
            Z = value_activations(self.adapter, self.o_proj, calibration, progress)  # (tokens, H*d_head)
            z_mean = Z.mean(0)
        b = rank1.free_vector(Vu, z_mean)
        if self.signed:
            self.calibration_positive = float((Z @ b > 0).double().mean())
        if gap_ratio is not None:
            lam = rank1.lambda_for_gap(rank1.quotient_eigenvalues(self.factors, self.u, b), gap_ratio, self.rank)
        else:
            lam = rank1.lambda_for_alpha(self.factors, self.u, alpha)
        return rank1.exact(self.factors, self.u, b, lam, self.signed)

    def _solve_alpha(self, target: float) -> float:
        """Paper method: the smallest alpha >= 0 whose gap ratio (u principal) reaches target, by bisection."""

        def gap(a):
            s = layer_spectrum(
                rank1.steered_factors(self.factors, rank1.paper(self.factors, self.u, a)), rank=self.rank
            )
            return s.gap_ratio if float((s.basis.T @ self.u).norm()) > 0.9 else 1.0

        hi = max(abs(self.before.lambda_1), 1e-3) / (target * self.norm_vu)
        for _ in range(60):
            if gap(hi) <= target:
                break
            hi *= 2
        else:
            raise RuntimeError(f"no alpha up to {hi:.3g} reaches gap ratio {target}; pass alpha instead")
        lo = 0.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if gap(mid) <= target else (mid, hi)
            if hi - lo < 1e-4 * hi:
                break
        return hi

    # ---- lifecycle ----
    def __enter__(self) -> Steer:
        if self._active:
            raise RuntimeError(
                f"this Steer of layer {self.layer} is already active; exit it before entering it again "
                "(nothing was changed)"
            )
        if self.mode == "edit" and self.o_proj in _EDITING:
            raise RuntimeError(
                f"layer {self.layer}'s output projection is already edited by another active Steer; exit that "
                "one first, or use mode='hook' to stack steerings (nothing was changed)"
            )
        self._last_call = self._last_out = self._final = self._unsteered = None  # what report() reads: this block's
        try:
            if self.mode == "edit":
                self._edit()
            self._register()
        except BaseException:
            self._undo()  # all-or-nothing
            raise
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._undo()

    def _register(self) -> None:
        if self.mode == "hook":
            self._handles.append(self.o_proj.register_forward_hook(self._hook))
        model = self.adapter.model
        self._handles.append(model.register_forward_pre_hook(self._remember, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._capture_output))
        self._handles.append(self._last_block().register_forward_hook(self._capture_final))

    def _last_block(self):
        """The last block of the steered layer's stack: its output is the 'final residual' reported."""
        stack = self.adapter.layers[self.layer].stack
        return [ly for ly in self.adapter.layers if ly.stack == stack][-1].block

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _undo(self) -> None:
        self._remove_hooks()
        if self._saved is not None:
            W = self.o_proj.weight
            if not torch.equal(W.detach(), self._edited):
                log.warning(
                    "layer %d's output projection changed while steered; restoring the saved weight", self.layer
                )
            with torch.no_grad():
                W.copy_(self._saved)  # bit-exact: the saved tensor itself
            self._saved = self._edited = None
        if _EDITING.get(self.o_proj) is self:
            del _EDITING[self.o_proj]
        self._active = False

    def _delta(self, like: torch.Tensor) -> torch.Tensor:
        """ΔO = a bᵀ in the layout of the projection's weight."""
        D = self.change.matrix()  # (d, H*d_head)
        return (D.T if _is_conv1d(self.o_proj) else D).to(like.device, like.dtype)

    def _edit(self) -> None:
        W = self.o_proj.weight
        self._saved = W.detach().clone()
        _EDITING[self.o_proj] = self
        with torch.no_grad():
            W.add_(self._delta(W))
        self._edited = W.detach().clone()

    def _hook(self, module, args, output):
        z = args[0]  # (..., H*d_head): the heads' outputs entering the projection
        a = self.change.a.to(z.device, z.dtype)
        b = self.change.b.to(z.device, z.dtype)
        return output + (z @ b)[..., None] * a

    def _remember(self, module, args, kwargs):
        self._last_call = (args, kwargs)

    def _capture_output(self, module, args, output):
        self._last_out = last_logits(output, real_tokens(self._last_call))

    def _capture_final(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        self._final = out.detach()

    # ---- report ----
    def _rerun_unsteered(self):
        """The last steered call run again unsteered: (its last-position logits, the last block's output).

        Inside the block the steering is lifted for the run (then put back); after the block the model is
        already restored, and the result is kept, so ``report()`` after the block gives what was measured
        inside it, at the cost of one forward, once.
        """
        if not self._active:
            if self._unsteered is None:
                self._unsteered = self._run_plain()
            return self._unsteered
        self._remove_hooks()
        was_edit = self._saved is not None
        if was_edit:
            with torch.no_grad():
                self.o_proj.weight.copy_(self._saved)
        try:
            return self._run_plain()
        finally:
            if was_edit:
                with torch.no_grad():
                    self.o_proj.weight.copy_(self._edited)
            self._register()

    def _run_plain(self):
        args, kwargs = self._last_call
        hold = {}
        h = self._last_block().register_forward_hook(
            lambda m, a, o: hold.__setitem__("final", (o[0] if isinstance(o, tuple) else o).detach())
        )
        try:
            with torch.no_grad():
                out = self.adapter.model(*args, **kwargs)
        finally:
            h.remove()
        return last_logits(out, real_tokens(self._last_call)), hold["final"]

    def summary(self, target_token: int | None = None) -> SteerReport:
        """The steered layer's new spectrum and, for the last run inside the block, the final
        residuals' mean |cos| with u and (given a token id, e.g. ``eh.direction.token_id(tok, " Paris")``)
        its next-token probability, before and after. Called after the block, it reports that block's
        last run (its unsteered twin is run once, on the restored model); None only if nothing ran.

        Raises:
            ValueError: a target token on a model whose LM head was initialised randomly when
                it was loaded (``load_model`` marks it): its token probabilities mean nothing.
        """
        if target_token is not None:
            refuse_untrained_head(self.adapter.model)
        rep = SteerReport(
            self.layer,
            self.alpha,
            self.after.lambda_1,
            self.after.gap_ratio,
            float((self.after.basis.T @ self.u).norm()),
            self.before.lambda_1,
            self.before.gap_ratio,
            method=self.method,
            signed=self.signed,
            lam=self.change.lam,
            calibration_positive=self.calibration_positive,
        )
        if self._last_out is None:
            return rep  # no call was steered
        after_out, after_final = self._last_out, self._final  # from the last steered run
        before_out, before_final = self._rerun_unsteered()
        real = real_tokens(self._last_call)
        rep.alignment_before = mean_abs_cos(before_final, self.u, real)
        rep.alignment_after = mean_abs_cos(after_final, self.u, real)
        if target_token is not None:
            before, after = next_token_probs(before_out, target_token), next_token_probs(after_out, target_token)
            if before is not None and after is not None:
                rep.prob_before, rep.prob_after = float(before.mean()), float(after.mean())
                rep.prob_raised, rep.n_sequences = int((after > before).sum()), len(before)
        return rep


def refuse_untrained_head(model) -> None:
    """Raise ValueError (one line) if ``load_model`` marked the model's LM head as untrained."""
    from ..zoo.loading import UNTRAINED_HEAD

    if getattr(model, UNTRAINED_HEAD, False):
        raise ValueError(
            f"no token probabilities: {type(model).__name__}'s LM head is not in its checkpoint and was "
            "initialised randomly when loading; load a checkpoint saved with its head, or report without a token"
        )


def steer(
    model,
    direction,
    layer: int = -1,
    alpha: float | None = None,
    gap_ratio: float | None = None,
    mode: str = "edit",
    allow_shared: bool = False,
    rank: str = "modulus",
    method: str = "exact",
    signed: bool | None = None,
    calibration=None,
    progress: bool | None = None,
) -> Steer:
    """Steer ``layer`` toward unit direction u by a rank-1 change of its output matrix.

    Args:
        model: an HF or TransformerLens (bridge) model.
        direction: (d,) unit vector (see ``eigenhooks.direction``).
        layer: attention layer index (default the last).
        alpha: the strength on the paper's scale (uᵀ F' u = uᵀ F u + alpha ||V u||); or
        gap_ratio: the steered layer's gap ratio, u principal (default 0.1 if neither is given).
        mode: 'edit' (weights changed, restored bit-exactly on exit) or 'hook' (weights untouched).
        allow_shared: required to steer a layer whose weights other layers share (ALBERT).
        rank: 'modulus' or 'residual', the ranking rule the gap ratio is measured under.
        method: 'exact' (F' u = lambda u exactly) or 'paper' (O + alpha u wᵀ, approximate).
        signed: choose the read-out so the typical token is pushed toward +u (default for
            'exact'; the paper's construction is symmetric).
        calibration: token ids (batch, seq), or a dict of forward kwargs (a tokenizer batch;
            ``{"pixel_values": images}`` for a vision tower), whose heads' outputs set the signed
            read-out; default: 16 sequences of 8 tokens sampled from the model (seeded; needs an
            LM head).
        progress: show the calibration's sampling as a bar (default: when stderr is a terminal or
            this is a notebook; see ``eigenhooks.progress``).

    Returns:
        A Steer, to use as a context manager (once at a time).

    Raises:
        ValueError: bad direction, strength, method or mode; V u = 0; a shared layer.
        TypeError: layer not an int (numpy and 0-d torch integers are; bools are not).
        IndexError: layer out of range.

    Example:
        >>> with eh.steer(model, u, gap_ratio=0.1) as s:    # doctest: +SKIP
        ...     out = model(**batch)
        >>> s.summary().cos_v1_u                               # doctest: +SKIP
        1.0
    """
    return Steer(
        model, direction, layer, alpha, gap_ratio, mode, allow_shared, rank, method, signed, calibration, progress
    )

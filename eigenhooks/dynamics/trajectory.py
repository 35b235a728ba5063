"""Iterating one real layer far past its depth, and predicting its limit from the spectrum.

``iterate`` applies layer t of a real model N times to the hidden states of real inputs:
- ``model`` mode runs the block itself (attention, FFN, norms), as ALBERT's shared layer does;
- ``paper`` mode is the paper's idealised step on the same weights: FFN removed, L2
  normalisation in place of LayerNorm, attention as the layer computes it, biases removed:
  x_i <- normalize(x_i + sum_h O_h V_h sum_j A^h_ij x_j).

Prediction (``predict_limit``) and measurement (``classify_limit``) use the residual
ranking, since both steps add the attention output to x: the dominant eigenvalue is that of
I + F. In the linear limit (uniform attention, or all tokens equal) a complex lambda_1
rotates tokens by arg(1 + lambda_1) per step, which tends to the design's arg(lambda_1)
when |lambda_1| >> 1. With non-uniform attention, write token i in the plane of
(Re v_1, Im v_1) as z_i = e^{i phi_i}; then z_i <- (z_i + lambda_1 m_i) / |...| with
m_i = sum_j A_ij z_j = r_i e^{i psi_i}, so its angle per step is
arg(1 + lambda_1 r_i e^{i (psi_i - phi_i)}); it equals arg(1 + lambda_1) once the tokens
coincide (r_i = 1, psi_i = phi_i), which is why the measured angle is read at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..linalg import views
from ..linalg.eig import LayerSpectrum
from ..linalg.subspace import alignment
from ..models import get_adapter, layer_index
from ..models.base import StopForward, UnsupportedModelError
from ..models.family import token_inputs
from ..spectra.compute import spectra

LIMITS = ("consensus", "rotation", "near-degenerate", "bipartite", "consensus-off-subspace", "unconverged")


@dataclass
class Trajectory:
    """Per-step measurements of an iteration (every ``record_every`` steps).

    alignment (steps,): mean a(x) with the principal subspace; signed_cos (steps,): mean
    <x, v_1>/||x|| (k = 1, else NaN); consensus (steps,): mean pairwise cosine;
    coords (steps, tokens, 2): each token's unit vector in the plane basis; plane_alignment
    (steps,): mean alignment with that plane.
    """

    layer: int
    mode: str
    spectrum: LayerSpectrum
    plane: torch.Tensor  # (d, 2)
    steps: list[int] = field(default_factory=list)
    alignment: list[float] = field(default_factory=list)
    signed_cos: list[float] = field(default_factory=list)
    consensus: list[float] = field(default_factory=list)
    plane_alignment: list[float] = field(default_factory=list)
    coords: list[torch.Tensor] = field(default_factory=list)
    final: torch.Tensor | None = None  # (tokens, d) unit vectors after the last step

    def record(self, step: int, X: torch.Tensor) -> None:
        Xh = X / torch.linalg.vector_norm(X, dim=-1, keepdim=True).clamp_min(1e-30)  # (tokens, d)
        U = self.spectrum.basis.to(Xh)
        self.steps.append(step)
        self.alignment.append(float(alignment(Xh, U).mean()))
        self.signed_cos.append(float((Xh @ U[:, 0]).mean()) if self.spectrum.k == 1 else math.nan)
        n = Xh.shape[0]
        s = Xh.sum(0)
        self.consensus.append(float((s @ s - n) / (n * (n - 1))) if n > 1 else 1.0)
        P = self.plane.to(Xh)
        self.plane_alignment.append(float(alignment(Xh, P).mean()))
        self.coords.append((Xh @ P).float().cpu())

    def __repr__(self) -> str:  # two lines: what was iterated and how the measures moved; the steps are to_frame()'s
        moved = ", ".join(
            f"{name} {views.short(xs[0])} -> {views.short(xs[-1])}"
            for name, xs in (("alignment", self.alignment), ("consensus", self.consensus))
            if xs
        )
        span = f"{len(self.steps)} records, steps {self.steps[0]}..{self.steps[-1]}" if self.steps else "no records"
        return f"Trajectory(layer={self.layer}, {self.mode} mode, {span}: {moved}\n  {self.spectrum!r})"

    def to_frame(self):
        """One row per recorded step: step, alignment, signed_cos, consensus, plane_alignment (``coords`` and
        ``final`` stay tensors)."""
        import pandas as pd

        names = ("step", "alignment", "signed_cos", "consensus", "plane_alignment")
        cols = (self.steps, self.alignment, self.signed_cos, self.consensus, self.plane_alignment)
        return pd.DataFrame(dict(zip(names, cols)))


def _plane(spec: LayerSpectrum) -> torch.Tensor:
    """Orthonormal (d, 2): (Re v_1, Im v_1) for a complex lambda_1, else (v_1, v_2)."""
    v = spec.eigenvectors
    M = torch.stack([v[:, 0].real, v[:, 0].imag], 1) if spec.k == 2 else torch.stack([v[:, 0].real, v[:, 1].real], 1)
    Q, _ = torch.linalg.qr(M)
    return Q


def _capture(adapter, ids, attention_mask, module, forward: dict | None = None):
    """Run the model until ``module`` is called; return its (args, kwargs).

    ``forward``: the model's forward kwargs, used instead of ids (pixel_values of a vision tower).
    """
    got = {}

    def pre(m, args, kwargs):
        got["args"], got["kwargs"] = args, dict(kwargs)
        raise StopForward

    h = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        kw = dict(forward) if forward is not None else {"input_ids": ids}
        if attention_mask is not None and forward is None:
            kw["attention_mask"] = attention_mask
        if getattr(getattr(adapter.model, "config", None), "use_cache", None) is not None:
            kw["use_cache"] = False
        with torch.no_grad():
            adapter.model(**kw)
    except StopForward:
        pass
    finally:
        h.remove()
    if "args" not in got:
        raise RuntimeError(f"{type(module).__name__} was not called in the model's forward")
    kwargs = got["kwargs"]
    for k in ("past_key_values", "layer_past", "past_key_value"):
        if k in kwargs:
            kwargs[k] = None
    return got["args"], kwargs


def _call(module, x, args, kwargs):
    kwargs = dict(kwargs)
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = x
        out = module(*args, **kwargs)
    else:
        out = module(x, *args[1:], **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _check_iterable(ad, layer: int) -> None:
    """Only a self-attention layer fed token ids can be iterated (encoder-decoders: the encoder's)."""
    ly = ad.layers[layer]
    if ly.kind == "cross":
        raise UnsupportedModelError(
            f"layer {layer} ({ly.name}) is a cross-attention: its F acts on the encoder's states, not on the "
            "residual it updates, so iterating it has no power-method reading; pick a self-attention layer"
        )
    if ad.stacks and ly.stack != "encoder":
        raise UnsupportedModelError(
            f"layer {layer} ({ly.name}) is in the {ly.stack!r} stack of an encoder-decoder; iterate runs the "
            "encoder's self-attention layers only (its inputs carry no decoder states)"
        )
    main = getattr(ad.model, "main_input_name", "input_ids")
    if ad.stacks and main != "input_ids":
        raise UnsupportedModelError(
            f"{type(ad.model).__name__}'s encoder takes {main!r}, not token ids: iterate cannot run it"
        )


def iterate(
    model, inputs, layer: int = 0, steps: int = 200, mode: str = "model", record_every: int = 1, rank: str = "residual"
) -> Trajectory:
    """Apply one real layer ``steps`` times to the hidden states of ``inputs`` (first sequence).

    Args:
        model: an HF model (or Adapter).
        inputs: a tokenizer output (dict with input_ids), a LongTensor of ids (1, n), float
            hidden states (1, n, d) to start from, or a dict of other forward kwargs (a vision
            tower's ``{"pixel_values": images}``).
        layer: the attention block to iterate.
        steps: number of applications (> 0).
        mode: 'model' (the real block) or 'paper' (no FFN, L2 norm, no biases).
        record_every: keep measurements every this many steps (memory stays bounded).
        rank: ranking rule for the principal subspace ('residual' fits both modes).

    Returns:
        A Trajectory.

    Raises:
        TypeError: layer not an int (numpy and 0-d torch integers are; bools are not).
        IndexError: layer out of range (negative counts from the end).
        ValueError: bad mode, steps or inputs; a layer that cannot be iterated.
    """
    if mode not in ("model", "paper"):
        raise ValueError(f"mode must be 'model' or 'paper', got {mode!r}")
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    ad = get_adapter(model)
    layer = layer_index(layer, ad.n_layers)
    ly = ad.layers[layer]
    _check_iterable(ad, layer)
    dev = next(ad.model.parameters()).device
    ids, mask, x0, forward = _parse_inputs(inputs, ad.width(layer))
    if ids is None and forward is None:  # start from given hidden states; inputs of that length give the kwargs
        if ad.probe_inputs not in (None, token_inputs):  # the family takes no token ids (a vision tower)
            forward = ad.probe_inputs(ad.model, 1, x0.shape[1], dev)
        else:
            ids = torch.zeros(x0.shape[:2], dtype=torch.long)
    if forward is not None:  # the first sequence of each batched input
        forward = {k: (v[:1].to(dev) if isinstance(v, torch.Tensor) else v) for k, v in forward.items()}
    ids = None if ids is None else ids[:1].to(dev)
    mask = None if mask is None else mask[:1].to(dev)
    target = ly.block if mode == "model" else ly.attn_in
    args, kwargs = _capture(ad, ids, mask, target, forward)
    if x0 is None:
        block_args, block_kwargs = (args, kwargs) if mode == "model" else _capture(ad, ids, mask, ly.block, forward)
        x0 = block_kwargs.get("hidden_states", block_args[0] if block_args else None)
    x = x0[:1].to(dev, next(ad.model.parameters()).dtype)
    spec = spectra(ad, rank=rank, layers=[layer])[0]
    traj = Trajectory(layer, mode, spec, _plane(spec))
    valid = mask[0].bool() if mask is not None else torch.ones(x.shape[1], dtype=torch.bool, device=dev)
    with torch.no_grad():
        if mode == "paper":
            x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            bias = _attn_out(ly, torch.zeros_like(x), args, kwargs)  # O b_V + b_O, the same for every token
        traj.record(0, x[0][valid].double())
        for t in range(1, steps + 1):
            if mode == "model":
                x = _call(ly.block, x, args, kwargs)
            else:
                y = x + _attn_out(ly, x, args, kwargs) - bias
                x = y / torch.linalg.vector_norm(y, dim=-1, keepdim=True).clamp_min(1e-30)
            if not torch.isfinite(x).all():
                raise FloatingPointError(f"the iteration diverged (non-finite states) at step {t}")
            if t % record_every == 0 or t == steps:
                traj.record(t, x[0][valid].double())
    xf = x[0][valid].double()
    traj.final = (xf / torch.linalg.vector_norm(xf, dim=-1, keepdim=True)).cpu()
    return traj


def _attn_out(ly, x, args, kwargs) -> torch.Tensor:
    """O (sum_j A_ij V x_j + b_V) + b_O, read at the output projection's module."""
    got = {}
    h = ly.attn_out.register_forward_hook(lambda m, a, o: got.__setitem__("y", o[0] if isinstance(o, tuple) else o))
    try:
        _call(ly.attn_in, x, args, kwargs)
    finally:
        h.remove()
    return got["y"]


def _parse_inputs(inputs, d: int):
    """(ids, mask, hidden states, other forward kwargs); the ones not given are None."""
    if hasattr(inputs, "keys") and "input_ids" in inputs:
        ids = torch.as_tensor(inputs["input_ids"])
        mask = inputs.get("attention_mask")
        return (ids if ids.dim() == 2 else ids[None]), (None if mask is None else torch.as_tensor(mask)), None, None
    if hasattr(inputs, "keys"):
        return None, None, None, dict(inputs)
    t = torch.as_tensor(inputs)
    if not t.is_floating_point():
        return (t if t.dim() == 2 else t[None]), None, None, None
    if t.dim() == 2:
        t = t[None]
    if t.dim() != 3 or t.shape[-1] != d:
        raise ValueError(f"hidden states must have shape (1, n, d={d}); got {tuple(t.shape)}")
    return None, None, t, None


@dataclass
class Limit:
    """A predicted or measured limit. angle: radians per step (rotation), else None."""

    kind: str
    angle: float | None = None
    detail: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # a line, 4 significant digits: the full floats are in ``detail``
        detail = ", ".join(f"{k}={views.short(v, 60)}" for k, v in self.detail.items())
        angle = "" if self.angle is None else f", angle={self.angle:.4g} rad/step"
        return f"Limit({self.kind}{angle}{', ' + detail if detail else ''})"


def predict_limit(spectrum: LayerSpectrum) -> Limit:
    """What the spectrum predicts for the iterated layer (see the module docstring)."""
    lam = spectrum.lambda_1
    if spectrum.kind == "near-degenerate":
        return Limit("near-degenerate", detail={"gap_ratio": spectrum.gap_ratio})
    if spectrum.kind == "complex-dominant":
        step = (1 + lam) if spectrum.rank == "residual" else lam
        return Limit("rotation", angle=abs(math.atan2(step.imag, step.real)), detail={"lambda_1": lam})
    return Limit("consensus", detail={"lambda_1": lam, "note": "bipartite consensus on +-v_1 is possible but unstable"})


def classify_limit(traj: Trajectory, tol: float = 0.99, window: float = 0.1) -> Limit:
    """What the trajectory did, judged on its last ``window`` share of recorded steps."""
    n = len(traj.steps)
    w = max(2, int(n * window))
    last = slice(n - w, n)
    mean = lambda xs: sum(xs[last]) / len(xs[last])
    a, plane, cons = mean(traj.alignment), mean(traj.plane_alignment), mean(traj.consensus)
    detail = {"alignment": a, "plane_alignment": plane, "consensus": cons}
    angle = _angle_per_step(traj, last)
    detail["angle_per_step"] = angle
    k = traj.spectrum.k
    if k == 2 and a > tol and angle is not None and angle > 1e-3:
        return Limit("rotation", angle=angle, detail=detail)
    if a > tol and cons > tol:
        return Limit("consensus", detail=detail)
    if a > tol and k == 1 and abs(mean(traj.signed_cos)) < tol:
        return Limit("bipartite", detail=detail)
    if plane > tol:
        return Limit("near-degenerate", detail=detail)
    if cons > tol:  # tokens agree, on a direction the spectrum of F does not predict (FFN, norms)
        return Limit("consensus-off-subspace", detail=detail)
    return Limit("unconverged", detail=detail)


def _angle_per_step(traj: Trajectory, last: slice) -> float | None:
    """Mean |change of angle| per step in the plane, over the window (wrapped to (-pi, pi])."""
    C = torch.stack(traj.coords[last])  # (w, tokens, 2)
    if C.shape[0] < 2:
        return None
    ang = torch.atan2(C[..., 1], C[..., 0])
    d = torch.remainder(ang[1:] - ang[:-1] + math.pi, 2 * math.pi) - math.pi
    gaps = torch.tensor(traj.steps[last][1:]) - torch.tensor(traj.steps[last][:-1])
    return float((d.abs() / gaps[:, None]).mean())


def agree(pred: Limit, meas: Limit, angle_tol: float = 0.05) -> bool:
    """Whether a measured limit matches the prediction (kind, and angle for rotations)."""
    if pred.kind != meas.kind:
        return False
    if pred.kind == "rotation":
        return meas.angle is not None and abs(pred.angle - meas.angle) <= angle_tol
    return True

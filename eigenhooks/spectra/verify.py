"""``verify``: F read from the weights against F from the model's own forward (the identical-token probe).

Also checks each probe for linearity, so a layer with no weight rule is verified too (docs/design.md,
"Ground truth for F").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..linalg import views
from ..models import Adapter, get_adapter
from ..models.engines import engine_of
from ..models.probe import apply_attention_many, probe_matrices
from ..progress import bar
from .compute import _layer_list, _layer_name, _non_finite_message


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

    def __repr__(self) -> str:  # a line, 3 significant digits: the full floats are the fields
        what = "F from the weights vs the probe" if self.check == "weights" else "the probe's linearity"
        return (
            f"Verification(layer={self.layer}, {what}: relative {self.rel_diff:.3g} (max |ΔF| {self.max_abs_diff:.3g}"
            f" of |F| {self.max_abs_F:.3g}), {self.dtype}, {'linear' if self.linear else 'NOT linear'})"
        )


class Verifications(list):
    """``verify``'s answer: a list of ``Verification``, one per layer, that prints as a line on the worst layer;
    ``to_frame()`` gives every row."""

    def __repr__(self) -> str:
        if not self:
            return "Verifications(no layers)"
        worst = max(self, key=lambda v: v.rel_diff)
        bent = [v.layer for v in self if not v.linear]
        return (
            f"Verifications({len(self)} layers, {self[0].dtype}: worst relative |ΔF| {worst.rel_diff:.3g} at layer "
            f"{worst.layer}; {'every layer linear' if not bent else f'{len(bent)} NOT linear: {views.short(bent)}'}"
            "; .to_frame() for each layer)"
        )

    def _repr_pretty_(self, p, cycle) -> None:  # IPython would otherwise print the list item by item
        p.text(repr(self))

    def to_frame(self):
        """One row per layer: the fields and ``rel_diff``."""
        import pandas as pd

        return pd.DataFrame([asdict(v) | {"rel_diff": v.rel_diff} for v in self])


_LINEAR_TOL = {"float64": 1e-9, "float32": 1e-4}  # relative superposition residual of a linear map


def verify(model, layers: list[int] | None = None, n_tokens: int = 2, progress: bool | None = None) -> Verifications:
    """Compare F from the weights with F from the identical-token probe, layer by layer.

    The probe runs in the model's own dtype: expect ~1e-12 relative in float64, ~1e-6 in
    float32 and ~1e-3 in fp16/bf16. Every layer's probe is also checked for linearity
    (superposition and scaling on seeded random inputs); layers with no weight rule are
    verified by that check alone, so no row is NaN.

    Args:
        layers: indices to verify (default: all; negative counts from the end).
        n_tokens: length of the identical-token probe sequence (1 skips the softmax).
        progress: a bar on stderr (probes then run in about 10 steps of layers); None: on a terminal or
            in a notebook.

    Returns:
        One Verification per layer, in a ``Verifications`` list (it prints as one line; ``to_frame()``).

    Raises:
        TypeError: layers is not a list of ints. IndexError: a layer out of range.
        ValueError: non-finite weights (the layer and O, V or the probe named), as ``spectra`` says.
    """
    engine = engine_of(model)
    if engine is not None:
        raise engine.verify_error(model)
    adapter = get_adapter(model)
    idx = _layer_list(adapter, layers)
    probed, lin = {}, {}
    with bar(f"verify: {len(idx)} layers", len(idx), progress) as shown:
        step = -(-len(idx) // 10) if shown.on else len(idx)  # no bar: all layers in one probe, as fast
        for part in (idx[k : k + step] for k in range(0, len(idx), step)):
            probed.update(probe_matrices(adapter, part, n_tokens=n_tokens))
            _finite_or_raise(adapter, part, probed)
            lin.update(_linearity(adapter, part, probed, n_tokens))
            shown.advance(len(part))
    dtype = str(next(adapter.model.parameters()).dtype).replace("torch.", "")
    tol = _LINEAR_TOL.get(dtype, 1e-2)
    rows = Verifications()
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

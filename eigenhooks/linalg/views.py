"""How a spectrum prints: one line (``repr``), a table (``to_frame``) and a notebook table (``_repr_html_``).

A spectrum holds (d,) eigenvalues and (d, k) bases: printed whole, one SmolLM2 layer was 726 lines.
Its repr says what a reader looks for (layer, kind, |lambda_1|, k, gap) and gives the tensors by
shape; ``to_frame`` gives one row per layer and, with ``heads=True``, per head and group, so that
``pd.concat([s.to_frame() for s in specs])`` is the whole model's table. pandas is imported on use.
"""

from __future__ import annotations

import html
import math


def fmt_lambda(z: complex) -> str:
    """lambda as people read it: 4 significant digits, the imaginary part only when there is one."""
    if z.imag == 0:
        return f"{z.real:.4g}"
    return f"{z.real:.4g}{z.imag:+.4g}j"


def _shape(t) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _num(x: float, fmt: str = ".3f") -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def part_repr(p) -> str:
    """HeadSpectrum(head=3, real-dominant, λ1=0.627, k=1, gap=0.792, copying=+0.052, circuit=+0.915, basis (576, 1))."""
    which = f"head={p.head}" if hasattr(p, "head") else f"group={p.group}, heads={p.heads}"
    return (
        f"{type(p).__name__}({which}, {p.kind}, λ1={fmt_lambda(p.lambda_1)}, k={p.k}, gap={_num(p.gap_ratio)}, "
        f"copying={_num(p.copying_score, '+.3f')}, circuit={_num(p.circuit_copying, '+.3f')}, "
        f"eigenvalues {_shape(p.eigenvalues)}, basis {_shape(p.basis)})"
    )


def layer_repr(s) -> str:
    """LayerSpectrum(layer=0, ov/modulus, real-dominant, λ1=1.911, k=1, gap=0.796, 9 heads, 3 groups)."""
    parts = ""
    if s.heads is not None:
        parts += f", {len(s.heads)} heads"
    if s.groups is not None:
        parts += f", {len(s.groups)} groups"
    return (
        f"LayerSpectrum(layer={s.layer}, {s.variant}/{s.rank}, {s.kind}, λ1={fmt_lambda(s.lambda_1)}, k={s.k}, "
        f"gap={_num(s.gap_ratio)}{parts})"
    )


def _part_record(p, layer) -> dict:
    which = f"head {p.head}" if hasattr(p, "head") else f"group {p.group}"
    return {
        "layer": layer,
        "part": which,
        "kind": p.kind,
        "lambda_1": p.lambda_1,
        "abs_lambda_1": abs(p.lambda_1),
        "k": p.k,
        "gap_ratio": p.gap_ratio,
        "copying_score": p.copying_score,
        "circuit_copying": p.circuit_copying,
    }


def records(s) -> list[dict]:
    """One record for a layer spectrum, then one per head and group; one for a head's or a group's."""
    if not hasattr(s, "layer"):
        return [_part_record(s, None)]
    row = {
        "layer": s.layer,
        "part": "layer",
        "variant": s.variant,
        "rank": s.rank,
        "kind": s.kind,
        "lambda_1": s.lambda_1,
        "abs_lambda_1": abs(s.lambda_1),
        "k": s.k,
        "gap_ratio": s.gap_ratio,
    }
    parts = [
        _part_record(p, s.layer) | {"variant": s.variant, "rank": s.rank} for p in (s.heads or []) + (s.groups or [])
    ]
    return [row] + parts


def to_frame(s):
    """``records`` as a pandas DataFrame."""
    import pandas as pd

    return pd.DataFrame(records(s))


def repr_html(s) -> str:
    """A notebook's view: the repr line, then the table (head and group rows included)."""
    head = html.escape(layer_repr(s) if hasattr(s, "layer") else part_repr(s))
    frame = to_frame(s).drop(columns=["lambda_1"]).to_html(index=False, float_format=lambda x: f"{x:.4g}", na_rep="–")
    return f"<div><code>{head}</code>{frame}</div>"

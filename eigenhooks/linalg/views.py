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


def shape_of(t) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _num(x: float, fmt: str = ".3f") -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def part_repr(p) -> str:
    """HeadSpectrum(head=3, real-dominant, λ1=0.627, k=1, gap=0.792, copying=+0.052, circuit=+0.915, basis (576, 1))."""
    which = f"head={p.head}" if hasattr(p, "head") else f"group={p.group}, heads={p.heads}"
    return (
        f"{type(p).__name__}({which}, {p.kind}, λ1={fmt_lambda(p.lambda_1)}, k={p.k}, gap={_num(p.gap_ratio)}, "
        f"copying={_num(p.copying_score, '+.3f')}, circuit={_num(p.circuit_copying, '+.3f')}, "
        f"eigenvalues {shape_of(p.eigenvalues)}, basis {shape_of(p.basis)})"
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


# How any other eigenhooks object prints: a repr is read in a notebook cell or a traceback, so it says what the
# object is in at most 3 lines and 300 characters (tests/layout/test_public_objects_print_short.py); the rows it
# holds come whole from its ``to_frame()``.
def short(v, width: int = 40) -> str:
    """A value as a one-line repr shows it: a tensor by shape and dtype, a number to 4 significant digits, a
    long string cut, a container by its length once it would be long."""
    import torch

    if isinstance(v, torch.Tensor):
        return f"{v.item():.4g}" if v.dim() == 0 and not v.is_complex() else f"tensor {shape_of(v)}"
    if isinstance(v, bool) or v is None or isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        return format(v, ".4g")
    if isinstance(v, complex):
        return fmt_lambda(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= width else repr(v[: width - 1] + "…")
    if isinstance(v, (list, tuple, dict)):
        items = [f"{k}: {short(x, 20)}" for k, x in v.items()] if isinstance(v, dict) else [short(x, 20) for x in v]
        text = ", ".join(items)
        if len(text) <= width:
            return ("{%s}" if isinstance(v, dict) else "[%s]" if isinstance(v, list) else "(%s)") % text
        return f"{len(v)} {'keys' if isinstance(v, dict) else 'items'}"
    text = repr(v)
    return text if len(text) <= width and "\n" not in text else f"<{type(v).__name__}>"


def fields_repr(obj, *names: str, extra: str = "") -> str:
    """``Name(field=value, ...)`` for the named attributes, each through ``short``, then ``extra``."""
    parts = [f"{n}={short(getattr(obj, n))}" for n in names] + ([extra] if extra else [])
    return f"{type(obj).__name__}({', '.join(parts)})"

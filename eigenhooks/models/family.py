"""The pieces every family table is built from: a ``Family`` record and small weight readers.

A family is one ``model_type``. Its ``rows`` function takes the bare model and its config
and yields, per attention application and in forward order, a dict of ``Layer`` fields
(see ``row``). Everything else about the family is data on the ``Family`` record.

Weight layouts (docs/design.md, "Mathematics"): ``nn.Linear`` stores (out, in), so V = v_proj.weight and
O = o_proj.weight; GPT-2's ``Conv1D`` stores (in, out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..linalg.eig import Factors
from .base import NormPosition

Rows = Callable[[nn.Module, object], Iterable[dict]]
Inputs = Callable[[nn.Module, int, int, torch.device], dict]


def row(block, attn_in, attn_out, norm, factors, o_proj, **extra) -> dict:
    """One attention application: the ``Layer`` fields a family knows (index/group/name are filled in).

    ``extra`` may set any other ``Layer`` field: ``mid_in``, ``pre_in``, ``mid_out``, ``post_in``, ``post_out``,
    ``parallel``, ``stack``, ``kind``, ``probe_arg``, ``linear``, ``masked``, ``d_model``, ``norm_offset``.
    """
    return dict(block=block, attn_in=attn_in, attn_out=attn_out, norm=norm, factors=factors, o_proj=o_proj, **extra)


def token_inputs(model: nn.Module, b: int, n: int, device: torch.device) -> dict:
    """The probe's default forward inputs: n copies of a harmless token per row."""
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    tok = int(pad) if isinstance(pad, int) and pad >= 0 else 0
    ids = torch.full((b, n), tok, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@dataclass(frozen=True)
class Family:
    """What eigenhooks knows about one ``model_type``.

    Attributes:
        rows: (base, cfg) -> Layer-field dicts, one per attention application, in forward order.
        norm: 'pre' or 'post', or a config -> position rule.
        final: base -> the final norm whose input is the last block's output, or None.
        dims: config -> (d_model, query heads, kv heads).
        head_norm: attribute path, from the model with its head, of a final norm the head holds.
        notes: config -> facts the user should know (recorded in ``adapter.notes``).
        inputs: (model, batch, length, device) -> forward kwargs for the probe (token ids by default).
        probe_separately: probe one layer per forward (the layers' probes would interact).
        final_in: the final norm receives the last block's output unchanged.
        stacks: base -> {stack: (root module, mask kwarg or None)} (``Adapter.stacks``); {} for one stack.
        norm_offset: added to every norm's weight, the blocks' and the final one, to give its real scale
            (Gemma, Nemotron, Qwen3-Next: x_hat * (1 + w), offset 1.0); see ``base.norm_scale``.
    """

    rows: Rows
    norm: NormPosition | Callable[[object], NormPosition]
    final: Callable[[nn.Module], nn.Module | None] = lambda base: None
    dims: Callable[[object], tuple[int, int, int]] = lambda c: gqa_dims(c)
    head_norm: tuple[str, ...] = ()
    notes: Callable[[object], list[str]] = lambda c: []
    inputs: Inputs = token_inputs
    probe_separately: bool = False
    final_in: bool = True
    stacks: Callable[[nn.Module], dict] = lambda base: {}
    norm_offset: float = 0.0
    extra: dict = field(default_factory=dict)


def linear(v: nn.Module, o: nn.Module, n_heads: int, n_kv: int) -> Callable[[], Factors]:
    """(O, V) read from two ``nn.Linear`` projections (out, in)."""
    return lambda: Factors.from_stacked(o.weight, v.weight, n_heads, n_kv)


def attr(*path: str) -> Callable[[nn.Module], nn.Module | None]:
    """A getter for ``obj.path[0].path[1]...``, None where a step is missing; no path gives None."""

    def get(obj):
        if not path:
            return None
        for p in path:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj

    return get


def gqa_dims(c) -> tuple[int, int, int]:
    """(d, query heads, kv heads) of a Llama-style config."""
    H = c.num_attention_heads
    return c.hidden_size, H, getattr(c, "num_key_value_heads", None) or H


def mha_dims(width: str, heads: str) -> Callable[[object], tuple[int, int, int]]:
    """(d, H, H) read from two config keys."""
    return lambda c: (getattr(c, width), getattr(c, heads), getattr(c, heads))

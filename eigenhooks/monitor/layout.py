"""Where the monitor's taps go and what each call of a tapped module reads, made once per plan.

``build_slots`` matches a module's calls in one forward to the (layer, point) readings they are;
``attn_paths`` says which attention outputs need no tap (mid has its own) and where to find their
modules, so that ``taps.Taps.swapped`` can see another tool's swap without a hook.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..models import Adapter
from .plan import Plan


class TapLayout(NamedTuple):
    """Where the taps go and what each call reads, made once per plan."""

    attn_paths: dict  # layer -> (root, names, module): attentions with no tap (``attn_paths``)
    slots: dict  # (id(module), where) -> (module, where, {"uses", "roles"}) (``build_slots``)
    roles: dict  # (id(module), where) -> {call index: [(layer, point)]}
    once: dict  # (id(module), where) -> [(layer, point)] of a module called once a forward: no counting

    @classmethod
    def build(cls, adapter: Adapter, plan: Plan, points) -> TapLayout:
        paths = attn_paths(adapter, plan, points)
        slots = build_slots(adapter, plan, points, set(paths))
        roles = {key: entry[2]["roles"] for key, entry in slots.items()}
        once = {k: r[0] for k, r in roles.items() if list(r) == [0] and len(slots[k][2]["uses"]) == 1}
        return cls(paths, slots, roles, once)


def _tap_module(adapter: Adapter, tap):
    if tap.hook_name is not None:
        return adapter.model.hook_dict[tap.hook_name], "output"
    return tap.module, tap.where


def attn_paths(adapter: Adapter, plan: Plan, points: tuple[str, ...]) -> dict:
    """layer -> (root, names, module) for the layers whose attention output needs no tap: mid has its
    own tap (a sequential block; in a parallel one mid = pre + attn) and completes the layer, so the
    attention tap would only tell that the attention ran. That is told instead by finding its module
    at its path (``Taps.swapped``): HF, from the layer's block; TransformerLens, from the model by hook
    name (its ``hook_dict`` is built once and would not see a swapped HookPoint)."""
    out = {}
    for i, lp in plan.layers.items():
        if lp.mid_is_sum or not lp.need_mid or "mid" not in points or lp.last_point == "attn":
            continue
        tap = lp.reading.attn
        module, _ = _tap_module(adapter, tap)
        if tap.hook_name is not None:
            root, names = adapter.model, tuple(tap.hook_name.split("."))
        else:
            root = adapter.layers[i].block
            names = next((tuple(n.split(".")) for n, m in root.named_modules() if m is module and n), None)
        if names is None:
            continue
        m = root
        for n in names:
            m = m._modules.get(n) if isinstance(m, torch.nn.Module) else None
        if m is module:  # found where it is walked to
            out[i] = (root, names, module)
    return out


def build_slots(adapter: Adapter, plan: Plan, points: tuple[str, ...], untapped: set = frozenset()) -> dict:
    """(id(module), where) -> (module, where, {"uses", "roles"}): the roles of each of its calls in one
    forward, in order.

    A module shared by several layers (ALBERT) is called once per use, so its calls are matched to
    layers by order; post(t) is read at layer t+1's pre tap, one reading for both. The layers in
    ``untapped`` get no attention tap (``attn_paths``).
    """
    ad = adapter
    own_points = not ad.calls.by_module  # the model's own hook points, one per layer (TransformerLens)
    mods = [
        {id(m) for m in (ly.block, ly.attn_in, ly.attn_out, ly.norm, ly.mid_in, ly.pre_in, ly.mid_out) if m is not None}
        for ly in ad.layers
    ]
    slots: dict = {}

    def add(tap, owner: int | None, role):
        module, where = _tap_module(ad, tap)
        key = (id(module), where)
        if key not in slots:
            uses = [i for i, s in enumerate(mods) if id(module) in s] if not own_points else []
            if len({ad.layers[j].group for j in uses}) > 1:
                # layers with different attention weights meet at this module (a decoder layer's block, or
                # the norm between its self- and cross-attention): it runs once for all of them
                uses = uses[:1]
            slots[key] = (module, where, {"uses": uses or [owner], "roles": {}})
        entry = slots[key][2]
        idx = entry["uses"].index(owner) if owner in entry["uses"] else 0
        entry["roles"].setdefault(idx, []).append(role)

    for i, lp in sorted(plan.layers.items()):
        rp = lp.reading
        add(rp.pre, i, (i, "pre"))
        if i not in untapped:
            add(rp.attn, i, (i, "attn"))
        if "mid" in points and rp.mid is not None:
            add(rp.mid, i, (i, "mid"))
        if "post" in points:
            module, _ = _tap_module(ad, rp.post)
            nxt = i + 1 < ad.n_layers and not own_points and id(module) in mods[i + 1]
            owner = i + 1 if nxt else (i if not own_points and id(module) in mods[i] else None)
            add(rp.post, owner, (i, "post"))
    return slots

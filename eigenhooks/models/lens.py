"""TransformerLens models: TransformerBridge (4.x) and legacy HookedTransformer, by duck typing.

TransformerLens uses row vectors: W_V [n_heads, d_model, d_head], W_O [n_heads, d_head,
d_model], so its OV matrix is F^T. eigenhooks reads O_h = W_O[h]^T and V_h = W_V[h]^T and
keeps the column convention, so its eigenvectors are right eigenvectors of F (left
eigenvectors of TransformerLens's ``OV``). Nothing here imports transformer_lens.
"""

from __future__ import annotations

import torch

from ..linalg.eig import Factors
from .base import Adapter, Layer, ReadingPoints, StopForward, Tap

_POST_NORM_ARCHS = ("Bert", "Albert", "Roberta", "DistilBert")


def is_lens_model(model) -> bool:
    return all(hasattr(model, a) for a in ("cfg", "blocks", "run_with_hooks", "hook_dict"))


def is_bridge(model) -> bool:
    return type(model).__name__ == "TransformerBridge" or hasattr(model, "enable_compatibility_mode")


def _factors(attn, n_heads: int) -> Factors:
    W_O = attn.W_O  # (H, d_head, d)
    # Legacy HookedTransformer expands grouped values to every head in W_V; _W_V keeps the groups.
    W_V = getattr(attn, "_W_V", None)
    if W_V is None:
        W_V = attn.W_V  # (G, d, d_head); the bridge keeps kv groups
    G = W_V.shape[0]
    O_heads = W_O.transpose(1, 2)  # (H, d, d_head): O_h = W_O[h]^T
    V_groups = W_V.transpose(1, 2)  # (G, d_head, d): V_g = W_V[g]^T
    group_of_head = torch.arange(n_heads) // (n_heads // G)
    return Factors(O_heads, V_groups, group_of_head)


def _norm_module(ln):
    for obj in (ln, getattr(ln, "original_component", None)):
        if obj is not None and (getattr(obj, "weight", None) is not None or getattr(obj, "w", None) is not None):
            return obj
    return ln


class _LensNorm(torch.nn.Module):
    """A view that exposes a TransformerLens norm's scale as ``weight`` (legacy names it ``w``)."""

    def __init__(self, ln):
        super().__init__()
        self.inner = ln

    @property
    def weight(self):
        m = _norm_module(self.inner)
        w = getattr(m, "weight", None)
        return w if w is not None else getattr(m, "w", None)


def lens_adapter(model) -> Adapter:
    """Adapter for a TransformerBridge or a HookedTransformer-like model."""
    cfg = model.cfg
    bridge = is_bridge(model)
    H = cfg.n_heads
    G = getattr(cfg, "n_key_value_heads", None) or H
    arch = str(getattr(cfg, "architecture", None) or getattr(cfg, "original_architecture", None) or "")
    post = any(a in arch for a in _POST_NORM_ARCHS)
    layers = []
    for i, blk in enumerate(model.blocks):
        ln = getattr(blk, "ln1", None)
        attn = blk.attn
        layers.append(
            Layer(
                index=i,
                block=blk,
                attn_in=attn,
                attn_out=attn,
                norm=_LensNorm(ln) if ln is not None else None,
                factors=lambda attn=attn: _factors(attn, H),
                group=i,
                name=f"blocks.{i}.attn",
                # the bridge wraps the HF output projection; legacy HookedTransformer has none
                o_proj=getattr(getattr(attn, "o", None), "original_component", None),
            )
        )
    notes = []
    compat = bool(getattr(model, "compatibility_mode", False)) if bridge else None
    if bridge:
        notes.append(
            "TransformerBridge in compatibility mode: W_V/W_O as processed by TransformerLens "
            "(fold_ln folds ln1's scale into W_V, so F -> F diag(w_ln); center_writing_weights "
            "removes W_O's mean over d_model, so F -> (I - 11^T/d) F)"
            if compat
            else "TransformerBridge in raw mode: W_V/W_O are the HuggingFace weights, unprocessed"
        )
    else:
        notes.append(
            "HookedTransformer: W_V/W_O as loaded by TransformerLens (by default fold_ln and "
            "center_writing_weights are applied at load time)"
        )
    unembed = getattr(model, "unembed", None)

    def unembed_weight():
        W_U = getattr(model, "W_U", None)
        return None if W_U is None else W_U.detach().T  # TL stores (d, vocab)

    ad = Adapter(
        model=model,
        family="lens-bridge" if bridge else "lens-hooked",
        backend="lens",
        layers=layers,
        norm_position="post" if post else "pre",
        d_model=cfg.d_model,
        n_heads=H,
        n_kv_heads=G,
        final_norm_module=getattr(model, "ln_final", None),
        unembed_weight=unembed_weight,
        notes=notes,
        probe_runner=lens_runner,
        reading_points_fn=reading_points,
    )
    ad.compatibility_mode = compat  # type: ignore[attr-defined]
    ad.unembed_module = unembed  # type: ignore[attr-defined]
    return ad


def hook_names(adapter: Adapter, layer: int) -> dict[str, str]:
    """TransformerLens hook names around layer's attention block."""
    p = f"blocks.{layer}."
    bridge = adapter.family == "lens-bridge"
    return {
        "pre": p + "hook_resid_pre",
        "mid": p + "hook_resid_mid",
        "post": p + "hook_resid_post",
        "attn": p + "hook_attn_out",
        "attn_in": p + ("attn.hook_in" if bridge else "ln1.hook_normalized"),
        "attn_out": p + ("attn.hook_out" if bridge else "hook_attn_out"),
    }


def reading_points(adapter: Adapter, layer: int) -> ReadingPoints:
    """Hook points where the residual is consumed: ln1's input (pre), ln2's input (mid), the next
    block's ln1 input or ln_final's input (post); hook_resid_* where a model lacks those."""
    hd = adapter.model.hook_dict
    pick = lambda *names: next((n for n in names if n in hd), names[-1])
    n = hook_names(adapter, layer)
    p = f"blocks.{layer}."
    if layer + 1 < adapter.n_layers:
        q = f"blocks.{layer + 1}."
        post = pick(q + "ln1.hook_in", n["post"])
    else:
        post = pick("ln_final.hook_in", n["post"])
    post_norm = adapter.norm_position == "post"
    return ReadingPoints(
        pre=Tap(hook_name=n["pre"] if post_norm else pick(p + "ln1.hook_in", n["pre"])),
        attn=Tap(hook_name=n["attn"]),
        mid=Tap(hook_name=n["mid"] if post_norm else pick(p + "ln2.hook_in", n["mid"])),
        post=Tap(hook_name=n["post"] if post_norm else post),
    )


def lens_runner(adapter: Adapter, layers: list[int], x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Probe forward through TransformerLens hooks: replace attention's input, read its output."""
    model = adapter.model
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:
        names = hook_names(adapter, i)

        def replace(act, hook, i=i):
            return x.to(act.device, act.dtype)

        def capture(act, hook, i=i):
            captured[i] = act[:, -1, :].detach()
            if len(captured) == len(layers):
                raise StopForward

        hooks += [(names["attn_in"], replace), (names["attn_out"], capture)]
    b, n, _ = x.shape
    tokens = torch.zeros((b, n), dtype=torch.long, device=x.device)
    try:
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=hooks, return_type=None)
    except StopForward:
        pass
    return captured

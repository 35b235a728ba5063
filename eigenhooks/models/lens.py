"""TransformerLens models: TransformerBridge (4.x) and HookedTransformer (3.x), by duck typing.

TransformerLens uses row vectors: W_V [n_heads, d_model, d_head], W_O [n_heads, d_head,
d_model], so its OV matrix is F^T. eigenhooks reads O_h = W_O[h]^T and V_h = W_V[h]^T and
keeps the column convention, so its eigenvectors are right eigenvectors of F (left
eigenvectors of TransformerLens's ``OV``). Nothing here imports transformer_lens.
"""

from __future__ import annotations

import torch

from ..linalg.eig import Factors
from .base import Adapter, Layer, ReadingPoints, StopForward, Tap
from .calls import LensCalls

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


def _offset(ln) -> float:
    """1.0 for a bridge norm that scales by 1 + weight (Gemma, Nemotron: TransformerLens's
    ``uses_weight_offset``; after fold_ln its weight is 0, the identity), else 0.0."""
    return 1.0 if ln is not None and bool(getattr(ln, "uses_weight_offset", False)) else 0.0


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
                norm_offset=_offset(ln),
                factors=lambda attn=attn: _factors(attn, H),
                group=i,
                name=f"blocks.{i}.attn",
                # the bridge wraps the HF output projection; legacy HookedTransformer has none
                o_proj=getattr(getattr(attn, "o", None), "original_component", None),
            )
        )
    compat = bool(getattr(model, "compatibility_mode", False)) if bridge else None
    notes = [_bridge_note(compat) if bridge else _hooked_note(model)]
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
        final_norm_offset=_offset(getattr(model, "ln_final", None)),
        unembed_weight=unembed_weight,
        notes=notes,
        probe_runner=lens_runner,
        reading_points_fn=reading_points,
        calls=LensCalls(),
    )
    ad.compatibility_mode = compat  # type: ignore[attr-defined]
    ad.unembed_module = unembed  # type: ignore[attr-defined]
    return ad


def _bridge_note(compat: bool) -> str:
    if compat:
        return (
            "TransformerBridge in compatibility mode: W_V/W_O as processed by TransformerLens "
            "(fold_ln folds ln1's scale into W_V, so F -> F diag(w_ln); center_writing_weights "
            "removes W_O's mean over d_model, so F -> (I - 11^T/d) F)"
        )
    return "TransformerBridge in raw mode: W_V/W_O are the HuggingFace weights, unprocessed"


def _centred(W: torch.Tensor, dim: int) -> bool:
    """True if W's mean over ``dim`` (d_model) is zero, as TransformerLens's centring leaves it.

    TransformerLens processes weights in float32 whatever the model's dtype, hence float32's tolerance."""
    W = W.detach()
    tol = 64 * torch.finfo(torch.float32).eps * max(float(W.abs().max()), 1e-30)
    return bool(W.mean(dim).abs().max() <= tol)


def _hooked_note(model) -> str:
    """What ``process_weights_`` (or ``from_pretrained``, which calls it) did to F, read off the model.

    HookedTransformer records fold_ln in ``cfg.normalization_type`` (LN -> LNPre, RMS -> RMSPre);
    the centrings leave W_O (writing) and W_V (reading, with fold_ln on LayerNorm) with zero mean
    over d_model. F_raw below is O V of the weights before processing, P = I - 11^T/d.
    """
    norm = str(getattr(model.cfg, "normalization_type", None))
    attn = model.blocks[0].attn
    W_V = getattr(attn, "_W_V", None)
    W_V = attn.W_V if W_V is None else W_V
    write = _centred(attn.W_O, -1)  # W_O (H, d_head, d): mean over d_model
    read = _centred(W_V, -2)  # W_V (G, d, d_head): mean over d_model
    done = []
    if norm in ("LNPre", "RMSPre"):
        if read and norm == "LNPre":
            done.append(
                f"fold_ln folded ln1's scale into W_V and centred it (ln1 is {norm}): F_raw -> F_raw diag(w_ln1) P"
            )
        else:
            done.append(f"fold_ln folded ln1's scale into W_V (ln1 is {norm}): F_raw -> F_raw diag(w_ln1)")
    if write:
        done.append("W_O has zero mean over d_model (center_writing_weights): F -> P F")
    if not done:
        return (
            f"HookedTransformer with unprocessed weights (ln1 is {norm}, W_O not centred): F = O V of W_O/W_V as "
            "they are; process_weights_ / from_pretrained would change it (fold_ln: F diag(w_ln1); "
            "center_writing_weights: P F, P = I - 11^T/d)"
        )
    return "HookedTransformer with processed weights: " + "; ".join(done) + " (P = I - 11^T/d)"


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
    handles = []  # torch hooks on ln1 (HookedTransformer), removed in finally
    for i in layers:
        names = hook_names(adapter, i)

        def replace(act, hook, i=i):
            return x.to(act.device, act.dtype)

        def capture(act, hook, i=i):
            captured[i] = act[:, -1, :].detach()
            if len(captured) == len(layers):
                raise StopForward

        hooks.append((names["attn_out"], capture))
        if adapter.family == "lens-bridge":
            hooks.append((names["attn_in"], replace))
    b, n, _ = x.shape
    tokens = torch.zeros((b, n), dtype=torch.long, device=x.device)
    try:
        if adapter.family != "lens-bridge":
            # ln1.hook_normalized comes before ln1's scale and bias (LN, RMS), so replacing it would
            # probe F diag(w_ln1): replace ln1's output itself, which is exactly attention's input.
            for i in layers:
                ln1 = model.blocks[i].ln1
                handles.append(ln1.register_forward_hook(lambda mod, args, out: x.to(out.device, out.dtype)))
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=hooks, return_type=None)
    except StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured

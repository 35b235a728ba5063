"""The identical-token probe: F recovered from the attention module's own forward pass.

Feed attention a sequence whose tokens all equal x. All values are then equal, so every
attention row averages identical vectors, whatever the scores, masks or positions: the
module returns F x + c, with c = O b_V + b_O. Probing with 0 and the basis vectors gives
F column by column. This is the reference every weight-reading adapter is tested
against, and the fallback for architectures with no weight rule.
"""

from __future__ import annotations

import threading

import torch

from .base import Adapter, StopForward, UnsupportedModelError
from .family import token_inputs

N_TOKENS = 2  # a causal first token attends to itself alone; the second averages two equal values

# A probe hooks the model's own modules for one forward. Hooks are per module, not per thread,
# so two probes of one model side by side (spectra reads layers in a thread pool) would each run
# the other's hooks: one's StopForward ends the other's forward, one's inputs replace the other's.
# Probes therefore run one at a time in this process.
_PROBE_LOCK = threading.RLock()


def hf_runner(adapter: Adapter, layers: list[int], x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Run the HF model once with every probed layer's attention values replaced by x.

    The values are the attention's ``hidden_states`` (or ``Layer.probe_arg``, e.g. the
    encoder states of a cross-attention). Where the model's own sequence there is longer
    than x's (a vision tower's patches, an encoder's frames), x's first token is repeated
    to that length: the tokens are identical either way.

    Args:
        layers: layer indices, at most one per shared-weight group.
        x: (b, n, d) probe input in the model's dtype and device.

    Returns:
        {layer: (b, d)} the attention output at the last position.
    """
    model = adapter.model
    base = getattr(model, "base_model", model)
    outs_by_module = {id(adapter.layers[i].attn_out): i for i in layers}
    arg_of = {id(adapter.layers[i].attn_in): adapter.layers[i].probe_arg for i in layers}
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def fit(like: torch.Tensor | None, module) -> torch.Tensor:
        xi = x.to(_param_device(module))
        if like is not None and like.dim() == 3 and like.shape[1] != xi.shape[1]:
            xi = xi[:, :1].expand(xi.shape[0], like.shape[1], xi.shape[2]).contiguous()
        return xi

    def pre_hook(module, args, kwargs):
        key = arg_of[id(module)]
        if key is not None:
            if kwargs.get(key) is None:
                raise UnsupportedModelError(
                    f"probe: {type(module).__name__} was called without {key!r}; cannot place the probe"
                )
            kwargs[key] = fit(kwargs[key], module)
        elif "hidden_states" in kwargs:
            kwargs["hidden_states"] = fit(kwargs["hidden_states"], module)
        else:
            args = (fit(args[0], module), *args[1:])
        return args, kwargs

    def fwd_hook(module, args, output):
        i = outs_by_module[id(module)]
        if i not in captured:
            out = output[0] if isinstance(output, tuple) else output
            captured[i] = out[:, -1, :].detach()
        if len(captured) == len(layers):
            raise StopForward

    try:
        for i in layers:
            ly = adapter.layers[i]
            handles.append(ly.attn_in.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(ly.attn_out.register_forward_hook(fwd_hook))
        b, n, _ = x.shape
        dev = _input_device(base)
        kwargs = (adapter.probe_inputs or token_inputs)(model, b, n, dev)
        if getattr(getattr(model, "config", None), "use_cache", None) is not None:
            kwargs["use_cache"] = False
        try:
            with torch.no_grad():
                base(**kwargs)
        except StopForward:
            pass
    finally:
        for h in handles:
            h.remove()
    missing = [i for i in layers if i not in captured]
    if missing:
        raise RuntimeError(f"probe: attention of layers {missing} was never called in {type(model).__name__}'s forward")
    return captured


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's input embedding module, or None: vision towers' patch embeddings and models
    that do not implement ``get_input_embeddings`` (CLIPModel raises NotImplementedError)."""
    try:
        return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        return None


def _input_device(base: torch.nn.Module) -> torch.device:
    """Where the forward's inputs go: the token embedding's device (first under a device_map),
    else the first parameter's (a patch embedding has no ``.weight``)."""
    w = getattr(input_embeddings(base), "weight", None)
    return w.device if isinstance(w, torch.Tensor) else _param_device(base)


def _param_device(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def apply_attention(
    adapter: Adapter, layer: int, X: torch.Tensor, chunk: int = 512, n_tokens: int = N_TOKENS
) -> torch.Tensor:
    """Push each row of X through layer's attention module as an identical-token sequence.

    Args:
        X: (m, d) vectors.

    Returns:
        (m, d) float64 rows F x, with the bias terms removed (the output for x = 0 subtracted).
    """
    return apply_attention_many(adapter, [layer], X, chunk, n_tokens)[layer]


def apply_attention_many(
    adapter: Adapter, layers: list[int], X: torch.Tensor, chunk: int = 512, n_tokens: int = N_TOKENS
) -> dict[int, torch.Tensor]:
    """`apply_attention` for several layers, sharing one forward pass per chunk.

    n_tokens is the probe sequence's length. With 1, attention is trivially the identity
    on the values; with 2 or more the softmax really averages, so any rounding in it shows
    (TransformerLens's bridge computes rotary-model softmax in float32: ~1e-8 relative).
    """
    runner = adapter.probe_runner or hf_runner
    dtype = _model_dtype(adapter.model)
    rep = _representatives(adapter, layers)
    X = torch.cat([torch.zeros(1, X.shape[1], dtype=X.dtype, device=X.device), X])  # row 0 measures the bias
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in rep}
    groups = [[i] for i in rep] if adapter.probe_separately else [list(rep)]
    for s in range(0, X.shape[0], chunk):
        xb = X[s : s + chunk].to(dtype)
        x = xb[:, None, :].expand(xb.shape[0], n_tokens, xb.shape[1]).contiguous()  # (b, n, d)
        for g in groups:
            with _PROBE_LOCK:
                got = runner(adapter, g, x)
            for i in g:
                pieces[i].append(got[i].to("cpu", torch.float64))
    out = {}
    for i in layers:
        full = torch.cat(pieces[rep_of(adapter, i, rep)])
        out[i] = full[1:] - full[:1]
    return out


def probe_matrices(
    adapter: Adapter, layers: list[int] | None = None, chunk: int = 512, n_tokens: int = N_TOKENS
) -> dict[int, torch.Tensor]:
    """F (d, d) float64 of each layer, recovered from the model's forward code (d: its width)."""
    layers = list(range(adapter.n_layers)) if layers is None else list(layers)
    out: dict[int, torch.Tensor] = {}
    for d in sorted({adapter.width(i) for i in layers}):  # towers of one model may differ in width
        eye = torch.eye(d, dtype=torch.float64)
        rows = apply_attention_many(adapter, [i for i in layers if adapter.width(i) == d], eye, chunk, n_tokens)
        out.update({i: r.T for i, r in rows.items()})  # row i of r is F e_i, i.e. column i of F
    return {i: out[i] for i in layers}


def _representatives(adapter: Adapter, layers: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    for i in layers:
        seen.setdefault(adapter.layers[i].group, i)
    return list(seen.values())


def rep_of(adapter: Adapter, layer: int, reps: list[int]) -> int:
    g = adapter.layers[layer].group
    return next(r for r in reps if adapter.layers[r].group == g)


def _model_dtype(model) -> torch.dtype:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.float32

"""HuggingFace families: one short function per layout, and one table that maps them.

Each family function takes the bare model (``model.base_model``) and its config and yields,
per attention block: the block, the modules around attention, the norm and a factor rule.
Weight layouts (DESIGN.md §1): ``nn.Linear`` stores (out, in), so V = v_proj.weight and
O = o_proj.weight; GPT-2's ``Conv1D`` stores (in, out); GPT-NeoX interleaves q, k, v per head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from ..spectrum import Factors
from .base import Adapter, Layer, NormPosition, UnsupportedModelError

# (block, attn_in, attn_out, norm, factors) per attention application
Row = tuple[nn.Module, nn.Module, nn.Module, nn.Module | None, Callable[[], Factors]]


def _linear(v: nn.Linear, o: nn.Linear, n_heads: int, n_kv: int) -> Callable[[], Factors]:
    return lambda: Factors.from_stacked(o.weight, v.weight, n_heads, n_kv)


def _gpt2(base, cfg) -> Iterator[Row]:
    d = cfg.n_embd
    for blk in base.h:
        c_attn, c_proj = blk.attn.c_attn, blk.attn.c_proj

        # Conv1D stores (in, out): value columns are [2d, 3d); transpose to (out, in).
        def f(c_attn=c_attn, c_proj=c_proj):
            return Factors.from_stacked(c_proj.weight.T, c_attn.weight[:, 2 * d : 3 * d].T, cfg.n_head)

        yield blk, blk.attn, blk.attn, blk.ln_1, f


def _gpt_neo(base, cfg) -> Iterator[Row]:
    for blk in base.h:
        a = blk.attn.attention
        yield blk, blk.attn, blk.attn, blk.ln_1, _linear(a.v_proj, a.out_proj, cfg.num_heads, cfg.num_heads)


def _gpt_neox(base, cfg) -> Iterator[Row]:
    H = cfg.num_attention_heads
    for blk in base.layers:
        qkv, dense = blk.attention.query_key_value, blk.attention.dense

        # Fused per head: output feature h*3*d_head + j, with q, k, v at j in [0, dh), [dh, 2dh), [2dh, 3dh).
        def f(qkv=qkv, dense=dense):
            d = qkv.weight.shape[1]
            dh = d // H
            V = qkv.weight.view(H, 3 * dh, d)[:, 2 * dh :, :].reshape(H * dh, d)
            return Factors.from_stacked(dense.weight, V, H)

        yield blk, blk.attention, blk.attention, blk.input_layernorm, f


def _gptj(base, cfg) -> Iterator[Row]:
    for blk in base.h:
        a = blk.attn
        yield blk, a, a, blk.ln_1, _linear(a.v_proj, a.out_proj, cfg.n_head, cfg.n_head)


def _bert(base, cfg) -> Iterator[Row]:
    for blk in base.encoder.layer:
        s, o = blk.attention.self, blk.attention.output
        yield blk, s, o.dense, o.LayerNorm, _linear(s.value, o.dense, cfg.num_attention_heads, cfg.num_attention_heads)


def _distilbert(base, cfg) -> Iterator[Row]:
    for blk in base.transformer.layer:
        a = blk.attention
        yield blk, a, a, blk.sa_layer_norm, _linear(a.v_lin, a.out_lin, cfg.n_heads, cfg.n_heads)


def _albert(base, cfg) -> Iterator[Row]:
    groups = base.encoder.albert_layer_groups
    H = cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        g = int(i / (cfg.num_hidden_layers / cfg.num_hidden_groups))
        for blk in groups[g].albert_layers:
            a = blk.attention
            yield blk, a, a.dense, a.LayerNorm, _linear(a.value, a.dense, H, H)


def _llama(base, cfg) -> Iterator[Row]:
    H = cfg.num_attention_heads
    G = getattr(cfg, "num_key_value_heads", None) or H
    for blk in base.layers:
        a = blk.self_attn
        yield blk, a, a, blk.input_layernorm, _linear(a.v_proj, a.o_proj, H, G)


def _opt(base, cfg) -> Iterator[Row]:
    for blk in base.decoder.layers:
        a = blk.self_attn
        yield (
            blk,
            a,
            a,
            blk.self_attn_layer_norm,
            _linear(a.v_proj, a.out_proj, cfg.num_attention_heads, cfg.num_attention_heads),
        )


def _gqa_dims(c):
    """(d, query heads, kv heads) of a Llama-style config."""
    return c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads


def _unembedding_of(model):
    """The LM head's weight (vocab, d), or None for a bare model."""

    def get():
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return None if out is None else out.weight.detach()

    return get


def _final(*path: str):
    def get(base):
        obj = base
        for p in path:
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj

    return get


# model_type -> (layer rows, norm position (or a config rule), final norm, head counts)
FAMILIES: dict[str, tuple] = {
    "gpt2": (_gpt2, "pre", _final("ln_f"), lambda c: (c.n_embd, c.n_head, c.n_head)),
    "gpt_neo": (_gpt_neo, "pre", _final("ln_f"), lambda c: (c.hidden_size, c.num_heads, c.num_heads)),
    "gpt_neox": (
        _gpt_neox,
        "pre",
        _final("final_layer_norm"),
        lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads),
    ),
    "gptj": (_gptj, "pre", _final("ln_f"), lambda c: (c.n_embd, c.n_head, c.n_head)),
    "bert": (_bert, "post", _final(), lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads)),
    "roberta": (_bert, "post", _final(), lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads)),
    "xlm-roberta": (_bert, "post", _final(), lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads)),
    "distilbert": (_distilbert, "post", _final(), lambda c: (c.dim, c.n_heads, c.n_heads)),
    "albert": (_albert, "post", _final(), lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads)),
    "llama": (
        _llama,
        "pre",
        _final("norm"),
        _gqa_dims,
    ),
    "mistral": (
        _llama,
        "pre",
        _final("norm"),
        _gqa_dims,
    ),
    "qwen3": (
        _llama,
        "pre",
        _final("norm"),
        _gqa_dims,
    ),
    "qwen2": (
        _llama,
        "pre",
        _final("norm"),
        _gqa_dims,
    ),
    "opt": (
        _opt,
        lambda c: "pre" if c.do_layer_norm_before else "post",
        _final("decoder", "final_layer_norm"),
        lambda c: (c.hidden_size, c.num_attention_heads, c.num_attention_heads),
    ),
}

# Heads that sit on top of the bare model and hold a final norm of their own.
_HEAD_NORMS = {
    "distilbert": ("vocab_layer_norm",),
    "albert": ("predictions", "LayerNorm"),
    "bert": ("cls", "predictions", "transform", "LayerNorm"),
    "roberta": ("lm_head", "layer_norm"),
}


# model_type -> the module that receives the 'mid' residual (the MLP's norm), pre-norm blocks only
MID_IN = {
    "gpt2": lambda b: b.ln_2,
    "gpt_neo": lambda b: b.ln_2,
    "gpt_neox": lambda b: b.post_attention_layernorm,
    "llama": lambda b: b.post_attention_layernorm,
    "mistral": lambda b: b.post_attention_layernorm,
    "qwen2": lambda b: b.post_attention_layernorm,
    "qwen3": lambda b: b.post_attention_layernorm,
    "opt": lambda b: b.final_layer_norm,
}


# model_type -> the output projection of one block (for steering)
O_PROJ = {
    "gpt2": lambda b: b.attn.c_proj,
    "gpt_neo": lambda b: b.attn.attention.out_proj,
    "gpt_neox": lambda b: b.attention.dense,
    "gptj": lambda b: b.attn.out_proj,
    "bert": lambda b: b.attention.output.dense,
    "roberta": lambda b: b.attention.output.dense,
    "xlm-roberta": lambda b: b.attention.output.dense,
    "distilbert": lambda b: b.attention.out_lin,
    "albert": lambda b: b.attention.dense,
    "llama": lambda b: b.self_attn.o_proj,
    "mistral": lambda b: b.self_attn.o_proj,
    "qwen2": lambda b: b.self_attn.o_proj,
    "qwen3": lambda b: b.self_attn.o_proj,
    "opt": lambda b: b.self_attn.out_proj,
}


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def _group_ids(modules: list[nn.Module]) -> list[int]:
    seen: dict[int, int] = {}
    return [seen.setdefault(id(m), len(seen)) for m in modules]


def hf_adapter(model: nn.Module) -> Adapter:
    """Build the adapter for a HuggingFace model (bare or with a head)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"no HF family rule for model_type={model_type!r}")
    rows_fn, norm_pos, final_fn, dims = FAMILIES[model_type]
    base = getattr(model, "base_model", model)
    norm_position: NormPosition = norm_pos(cfg) if callable(norm_pos) else norm_pos
    rows = list(rows_fn(base, cfg))
    groups = _group_ids([r[2] for r in rows])
    parallel = model_type == "gptj" or bool(getattr(cfg, "use_parallel_residual", False))
    mid_in = MID_IN.get(model_type) if norm_position == "pre" and not parallel else None
    layers = [
        Layer(
            index=i,
            block=b,
            attn_in=ai,
            attn_out=ao,
            norm=n,
            factors=f,
            group=g,
            name=_name(model, ai),
            o_proj=O_PROJ[model_type](b),
            mid_in=None if mid_in is None else mid_in(b),
            parallel=parallel,
        )
        for i, ((b, ai, ao, n, f), g) in enumerate(zip(rows, groups))
    ]
    d, H, G = dims(cfg)
    final = final_fn(base)
    if final is None and model_type in _HEAD_NORMS:
        final = _final(*_HEAD_NORMS[model_type])(model)

    notes = []
    if model_type == "albert" and len(set(groups)) < len(groups):
        notes.append(f"shared weights: {len(groups)} attention applications use {len(set(groups))} distinct layer(s)")
    if parallel:
        notes.append("parallel attention/MLP block: 'mid' = pre + attention output, not a state the model forms")
    return Adapter(
        model=model,
        family=model_type,
        backend="hf",
        layers=layers,
        norm_position=norm_position,
        d_model=d,
        n_heads=H,
        n_kv_heads=G,
        final_norm_module=final,
        unembed_weight=_unembedding_of(model),
        notes=notes,
    )


def _name(model: nn.Module, module: nn.Module) -> str:
    for n, m in model.named_modules():
        if m is module:
            return n
    return ""


# ---- generic fallback: find the attention blocks, then read F from the probe ----

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "attn_layer")


def generic_adapter(model: nn.Module) -> Adapter:
    """Fallback for other HF models: locate the block list and each block's attention module.

    F then comes from the identical-token probe alone (no weight rule). Norm position is
    assumed 'pre' (the common case for current decoders); this is recorded in the notes.
    """
    blocks = _find_block_list(model)
    if blocks is None:
        raise UnsupportedModelError(
            f"could not find a list of attention blocks in {type(model).__name__}; "
            f"supported families: {', '.join(supported_families())}, TransformerLens models"
        )
    layers = []
    for i, blk in enumerate(blocks):
        attn = next(getattr(blk, n) for n in _ATTN_NAMES if isinstance(getattr(blk, n, None), nn.Module))
        layers.append(
            Layer(
                index=i,
                block=blk,
                attn_in=attn,
                attn_out=attn,
                norm=None,
                factors=None,
                group=i,
                name=_name(model, attn),
            )
        )
    d = _guess_width(model)
    cfg = getattr(model, "config", None)
    H = getattr(cfg, "num_attention_heads", 0) or 0
    G = getattr(cfg, "num_key_value_heads", None) or H
    base = getattr(model, "base_model", model)
    final = next((getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(base, n)), None)

    return Adapter(
        model=model,
        family=f"generic:{getattr(cfg, 'model_type', type(model).__name__)}",
        backend="hf",
        layers=layers,
        norm_position="pre",
        d_model=d,
        n_heads=H,
        n_kv_heads=G,
        final_norm_module=final,
        unembed_weight=_unembedding_of(model),
        notes=["generic adapter: F from the identical-token probe; norm position assumed 'pre'"],
    )


def _find_block_list(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for _, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        if all(any(isinstance(getattr(m, n, None), nn.Module) for n in _ATTN_NAMES) for m in mod):
            if best is None or len(mod) > len(best):
                best = mod
    return best


def _guess_width(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        return emb.weight.shape[1]
    raise UnsupportedModelError(f"cannot tell the residual width of {type(model).__name__}")


def is_hf_model(model) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type") and isinstance(model, nn.Module)


__all__ = ["FAMILIES", "generic_adapter", "hf_adapter", "is_hf_model", "supported_families"]

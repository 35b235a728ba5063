"""Llama-style decoders: separate (or fused) q/k/v/o projections in ``base.layers[i].self_attn``.

Every family here computes F = o_proj.weight @ v_proj.weight per kv group (docs/design.md, "Mathematics");
they differ in where the norms sit, and so in where ``pre`` and ``mid`` are read:

- pre-norm (Llama, Mistral, Qwen, Mixtral, ...): norm -> attention -> add; ``mid`` is the
  input of the MLP's norm.
- sandwich (Gemma 2/3, GLM-4): norm -> attention -> norm -> add; ``mid`` is the input of the
  norm in front of the MLP (the residual after the add), never the attention output's norm.
- post-only (OLMo 2/3, EXAONE 4): attention -> norm -> add, with no norm in front of
  attention: ``pre`` is the attention's own input and ``mid`` the MLP's input.
- parallel (Cohere, StableLM with ``use_parallel_residual``): attention and MLP read one
  normed input; no mid state exists.

q/k norms (Qwen3, OLMo 2, Gemma 3, Cohere's ``use_qk_norm``) act on queries and keys only,
so they change the attention pattern, never F: the identical-token probe checks this.
"""

from __future__ import annotations

from ..linalg.eig import Factors
from .base import UnsupportedModelError
from .family import Family, attr, gqa_dims, linear, row


def _attn(blk, cfg, *names: str):
    """The block's ``self_attn``, checked to hold the projections the rule reads.

    Raises:
        UnsupportedModelError: naming what the block holds instead (a patched or quantised
            attention the weight rule does not know).
    """
    a = getattr(blk, "self_attn", None)
    missing = [n for n in names if not hasattr(getattr(a, n, None), "weight")]
    if a is None or missing:
        found = sorted(n for n, _ in (a or blk).named_children())
        raise UnsupportedModelError(
            f"{cfg.model_type}: expected self_attn.{'/'.join(names)} with a .weight in {type(blk).__name__}, "
            f"found {type(a).__name__ if a is not None else 'no self_attn'} with children {found}; "
            "eh.verify and the probe still work through eigenhooks.models.hf.generic_adapter"
        )
    return a


def _pre_norm(norm: str, mid: str, nonlinear=lambda cfg: False):
    """Rows for norm -> attention -> (norm ->) add blocks.

    Args:
        norm: the block's attribute holding the norm that feeds attention.
        mid: the block's attribute holding the module that receives the residual right after
            the attention add (the MLP's norm; Gemma 2/3's ``pre_feedforward_layernorm``).
        nonlinear: cfg -> True where the value path is not linear in x.
    """

    def rows(base, cfg):
        _, H, G = gqa_dims(cfg)
        for blk in base.layers:
            a = _attn(blk, cfg, "v_proj", "o_proj")
            f = linear(a.v_proj, a.o_proj, H, G)
            yield row(
                blk,
                a,
                a,
                getattr(blk, norm),
                f,
                a.o_proj,
                mid_in=getattr(blk, mid),
                linear=not nonlinear(cfg),
            )

    return rows


def _post_only(base, cfg):
    """OLMo 2/3, EXAONE 4: attention -> norm -> add, no norm in front of attention.

    ``pre`` is the attention's input (the raw residual it consumes), ``mid`` the MLP's
    input (the residual after the add), and ``norm`` None: ``ov_ln`` equals ``ov``.
    """
    _, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = _attn(blk, cfg, "v_proj", "o_proj")
        yield row(blk, a, a, None, linear(a.v_proj, a.o_proj, H, G), a.o_proj, pre_in=a, mid_in=blk.mlp)


def _parallel(norm: str):
    """Rows for parallel blocks x + attn(N(x)) + mlp(N(x)) (Cohere, Cohere 2)."""

    def rows(base, cfg):
        _, H, G = gqa_dims(cfg)
        for blk in base.layers:
            a = _attn(blk, cfg, "v_proj", "o_proj")
            yield row(blk, a, a, getattr(blk, norm), linear(a.v_proj, a.o_proj, H, G), a.o_proj, parallel=True)

    return rows


def _stablelm(base, cfg):
    """StableLM: parallel or sequential by ``use_parallel_residual`` (LayerNorm in both)."""
    _, H, G = gqa_dims(cfg)
    parallel = bool(cfg.use_parallel_residual)
    for blk in base.layers:
        a = _attn(blk, cfg, "v_proj", "o_proj")
        mid = None if parallel else blk.post_attention_layernorm
        f = linear(a.v_proj, a.o_proj, H, G)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=mid, parallel=parallel)


def _phi3_factors(qkv, o_proj, H: int, G: int):
    """(O, V) of Phi-3's fused ``qkv_proj`` (out, in): rows [q (H dh) | k (G dh) | v (G dh)]."""

    def f():
        dh = o_proj.weight.shape[1] // H
        V = qkv.weight[(H + G) * dh : (H + 2 * G) * dh]  # (G dh, d)
        return Factors.from_stacked(o_proj.weight, V, H, G)

    return f


def _phi3(base, cfg):
    _, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = _attn(blk, cfg, "qkv_proj", "o_proj")
        f = _phi3_factors(a.qkv_proj, a.o_proj, H, G)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm)


def _bitnet_factors(a, H: int, G: int):
    """(O diag(w_sub), V) of BitNet: ``attn_sub_norm`` (scale w_sub, (H dh,)) sits between the heads and O.

    The attention output is o_proj(RMSNorm(sum_j A_ij V x_j)); the linear map of the
    weights is F = O diag(w_sub) V, which leaves out the RMS division (a scalar per token
    that depends on x): the value path is nonlinear and the probe only a local linearisation.
    """

    def f():
        w = a.attn_sub_norm.weight.detach().double()
        O = a.o_proj.weight.detach().double() * w[None, :]  # (d, H dh): column c scaled by w_sub[c], no rounding
        return Factors.from_stacked(O, a.v_proj.weight, H, G)

    return f


def _bitnet(base, cfg):
    _, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = _attn(blk, cfg, "v_proj", "o_proj", "attn_sub_norm")
        f = _bitnet_factors(a, H, G)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm, linear=False)


def _bitnet_notes(cfg) -> list[str]:
    return [
        "attn_sub_norm (RMSNorm) sits between the attention heads and o_proj: F = O diag(w_sub) V is the linear "
        "map of the weights without the per-token RMS division; the value path is nonlinear"
    ]


def _sink_notes(cfg) -> list[str]:
    return [
        "attention sinks: each head's output is scaled by sigmoid(logsumexp(scores) - sink), a factor in (0, 1) "
        "that depends on x, so the value path is nonlinear; F = O V is the linear map of the weights (the output "
        "with the sink scale at 1), the probe only a local linearisation"
    ]


def _olmo_clipped(cfg) -> bool:
    return getattr(cfg, "clip_qkv", None) is not None


def _olmo_notes(cfg) -> list[str]:
    if not _olmo_clipped(cfg):
        return []
    return [
        f"clip_qkv={cfg.clip_qkv}: values are clamped to [-clip, clip] before attention, so the value path is "
        "nonlinear; F = O V is the unclamped linear map of the weights (exact while |V x| <= clip), the probe "
        "only a local linearisation"
    ]


def _granite_notes(cfg) -> list[str]:
    m = cfg.residual_multiplier
    return [
        f"residual_multiplier={m}: the block adds {m}·(attention output), so one step is x + {m}·F x; "
        "F here is the attention's own O V, and 'mid' is read at the MLP norm's input, where the model's add put it"
    ]


def _parallel_note(cfg) -> list[str]:
    return ["parallel attention/MLP block: 'mid' = pre + attention output, not a state the model forms"]


def _sandwich_note(cfg) -> list[str]:
    return [
        "sandwich norms: the attention output is normalised before the residual add (x + N(F x)), so F is the "
        "attention's own O V and 'mid' the residual after the add, read where the MLP's norm receives it"
    ]


def _post_only_note(cfg) -> list[str]:
    return [
        "no norm before attention: 'pre' is the raw residual the attention consumes; the attention output is "
        "normalised before the add (x + N(F x)); 'mid' is the MLP's input; ov_ln equals ov"
    ]


def _gemma_note(cfg) -> list[str]:
    return ["Gemma RMSNorm scales by (1 + weight): ov_ln and the unembedding's final norm fold in 1 + weight"]


LLAMA_ROWS = _pre_norm("input_layernorm", "post_attention_layernorm")
LLAMA = Family(LLAMA_ROWS, "pre", attr("norm"))
GEMMA = Family(
    _pre_norm("input_layernorm", "post_attention_layernorm"), "pre", attr("norm"), notes=_gemma_note, norm_offset=1.0
)
GEMMA2 = Family(
    _pre_norm("input_layernorm", "pre_feedforward_layernorm"),
    "pre",
    attr("norm"),
    notes=lambda c: _gemma_note(c) + _sandwich_note(c),
    norm_offset=1.0,
)
GRANITE = Family(LLAMA_ROWS, "pre", attr("norm"), notes=_granite_notes)


def _gemma3_text_tower(base, cfg):
    """Gemma3ForConditionalGeneration: the language model's layers, as the ``text`` stack.

    The SigLIP vision tower's attention layers are not rows here (no weight rule yet);
    its image tokens enter the text stack as ordinary residual positions.
    """
    for r in GEMMA2.rows(base.language_model, cfg.text_config):
        yield dict(r, stack="text")


def _gemma3_notes(cfg) -> list[str]:
    t = cfg.text_config
    return (
        _gemma_note(t)
        + _sandwich_note(t)
        + ["Gemma 3 multimodal: only the language model's attention layers are measured, not the vision tower's"]
    )


POST_ONLY = Family(_post_only, "pre", attr("norm"), notes=_post_only_note)
PARALLEL = Family(_parallel("input_layernorm"), "pre", attr("norm"), notes=_parallel_note)

FAMILIES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "mixtral": LLAMA,
    "qwen2_moe": LLAMA,
    "qwen3_moe": LLAMA,
    "starcoder2": LLAMA,
    "smollm3": LLAMA,
    "helium": LLAMA,
    "glm": LLAMA,
    "ernie4_5": LLAMA,
    "seed_oss": LLAMA,
    "arcee": LLAMA,
    "ministral": LLAMA,
    "olmoe": LLAMA,
    "hunyuan_v1_dense": LLAMA,
    "hunyuan_v1_moe": LLAMA,
    "ernie4_5_moe": LLAMA,
    "glm4_moe": LLAMA,
    "phimoe": LLAMA,
    "exaone_moe": LLAMA,
    "ministral3": LLAMA,
    "jais2": LLAMA,
    "nanochat": Family(
        LLAMA_ROWS,
        "pre",
        attr("norm"),
        final_in=False,  # base.norm is also applied to the embeddings, before the first block
        notes=lambda c: ["the final norm is also applied to the embeddings: the last 'post' is the block output"],
    ),
    "mellum": LLAMA,
    "cwm": LLAMA,
    "solar_open": LLAMA,
    "granite": GRANITE,
    "granitemoe": GRANITE,
    "granite_swa": Family(
        _pre_norm("input_layernorm", "post_attention_layernorm", nonlinear=lambda c: True),
        "pre",
        attr("norm"),
        notes=lambda c: _granite_notes(c) + _sink_notes(c),
    ),
    "bitnet": Family(_bitnet, "pre", attr("norm"), notes=_bitnet_notes),
    "granitemoeshared": GRANITE,
    "hyperclovax": Family(
        LLAMA_ROWS,
        "pre",
        attr("norm"),
        notes=lambda c: _granite_notes(c) + (_sandwich_note(c) if c.use_post_norm else []),
    ),
    "olmo": Family(
        _pre_norm("input_layernorm", "post_attention_layernorm", nonlinear=_olmo_clipped),
        "pre",
        attr("norm"),
        notes=_olmo_notes,
    ),
    "nemotron": Family(
        _pre_norm("input_layernorm", "post_attention_layernorm"),
        "pre",
        attr("norm"),
        notes=lambda c: ["Nemotron LayerNorm1P scales by (1 + weight): ov_ln folds in 1 + weight"],
        norm_offset=1.0,
    ),
    "apertus": Family(_pre_norm("attention_layernorm", "feedforward_layernorm"), "pre", attr("norm")),
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA2,
    "gemma3": Family(
        _gemma3_text_tower,
        "pre",
        attr("language_model", "norm"),
        lambda c: gqa_dims(c.text_config),
        notes=_gemma3_notes,
        norm_offset=1.0,
    ),
    "glm4": Family(_pre_norm("input_layernorm", "post_attention_layernorm"), "pre", attr("norm"), notes=_sandwich_note),
    "olmo2": POST_ONLY,
    "olmo3": POST_ONLY,
    "exaone4": POST_ONLY,
    "phi3": Family(_phi3, "pre", attr("norm")),
    "cohere": PARALLEL,
    "cohere2": PARALLEL,
    "stablelm": Family(
        _stablelm,
        "pre",
        attr("norm"),
        notes=lambda c: _parallel_note(c) if c.use_parallel_residual else [],
    ),
}

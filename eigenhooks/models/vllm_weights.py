"""vLLM engines' weights: which architectures eigenhooks reads F for, where an engine's checkpoint is,
and the adapter over the attention weights read from that checkpoint (the engine's run-time layout, its
decoder layers and residual pair, is another module's).

A ``vllm.LLM`` cannot be read like a transformers model: its attention weights are merged
(``qkv_proj``), sharded across tensor-parallel workers, and repacked by the CPU backend (a worker's
``self_attn`` parameters show shape ``(0,)`` after loading). F = O V is therefore read from the
checkpoint the engine loaded, in the engine's dtype: the layout of each known vLLM architecture (one
row of ``ARCHITECTURES``) names the checkpoint tensors that hold V (or the merged q/k/v, split here by
the q/k/v sizes), O and the norm that feeds attention. The tensors themselves are read by ``zoo``
(``zoo.checkpoint``); this module only knows names and layouts. ``vllm`` is never imported: an engine
is recognised by its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..linalg.eig import Factors
from .base import Adapter, Layer, UnsupportedModelError


@dataclass(frozen=True)
class Layout:
    """Where one vLLM architecture's checkpoint keeps a layer's attention weights.

    Attributes:
        family: the HF ``model_type`` whose eigenhooks family reads the same model in transformers.
        v: the tensor holding V ((G d_head, d), out x in), or the merged q/k/v when ``merged_qkv``
            (rows [q (H d_head) | k (G d_head) | v (G d_head)]); ``{i}`` is the layer index.
        o: the output projection (d, H d_head).
        norm: the norm whose scale ``ov_ln`` folds in (the one feeding attention), or None (no norm
            in front of attention: ``ov_ln`` equals ``ov``).
        merged_qkv: the checkpoint itself stores q, k and v as one tensor.
        norm_offset: added to the stored norm weight to give its scale (Gemma: x_hat * (1 + w)).
    """

    family: str
    v: str = "layers.{i}.self_attn.v_proj.weight"
    o: str = "layers.{i}.self_attn.o_proj.weight"
    norm: str | None = "layers.{i}.input_layernorm.weight"
    merged_qkv: bool = False
    norm_offset: float = 0.0
    embed: str = "embed_tokens.weight"  # W_E (vocab, d); with ``unembed`` and ``final_norm``, read only
    unembed: str = "lm_head.weight"  # for the heads' full OV circuit (``spectra(heads=True)``)
    final_norm: str = "norm.weight"

    def names(self, i: int) -> dict[str, str]:
        """{'v', 'o'[, 'norm']}: the checkpoint names (without the model prefix) of layer i's tensors."""
        out = {"v": self.v.format(i=i), "o": self.o.format(i=i)}
        if self.norm is not None:
            out["norm"] = self.norm.format(i=i)
        return out


_LLAMA = Layout("llama")
# vLLM architecture name (``model_config.architecture``) -> its checkpoint layout. The q/k norms of
# Qwen3, Gemma 3 and OLMo 2, Gemma 2/3's sandwich norms and logit soft-capping, and Granite's attention and
# residual multipliers act on queries, keys, the attention output's scale or the add, never on F.
ARCHITECTURES: dict[str, Layout] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": Layout("mistral"),
    "Qwen2ForCausalLM": Layout("qwen2"),
    "Qwen3ForCausalLM": Layout("qwen3"),
    "Phi3ForCausalLM": Layout("phi3", v="layers.{i}.self_attn.qkv_proj.weight", merged_qkv=True),
    "GemmaForCausalLM": Layout("gemma", norm_offset=1.0),
    "Gemma2ForCausalLM": Layout("gemma2", norm_offset=1.0),
    "Gemma3ForCausalLM": Layout("gemma3_text", norm_offset=1.0),
    "GraniteForCausalLM": Layout("granite"),  # residual_multiplier scales the add, not F (the HF family's notes)
    "Olmo2ForCausalLM": Layout("olmo2", norm=None),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def layout_for(architecture: str) -> Layout:
    """The checkpoint layout of a vLLM architecture.

    Raises:
        UnsupportedModelError: an architecture this table does not know (named, with the known ones).
    """
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"eigenhooks does not know vLLM's {architecture} architecture; known: "
            f"{', '.join(supported_architectures())}. Load the checkpoint in transformers and pass that model."
        ) from None


def is_vllm_engine(obj) -> bool:
    """True for a ``vllm.LLM`` (recognised by its class, so vllm is never imported here)."""
    return any(c.__name__ == "LLM" and c.__module__.startswith("vllm.") for c in type(obj).__mro__)


@dataclass(frozen=True)
class EngineSource:
    """What a ``vllm.LLM`` loaded: the checkpoint (a folder, or a hub id vLLM resolved from its cache),
    the dtype it computes in, its architecture, and the dimensions of its attention."""

    model: str
    revision: str | None
    download_dir: str | None
    dtype: torch.dtype
    architecture: str
    config: SimpleNamespace  # n_layers, d_model, n_heads, n_kv_heads, d_head


def engine_source(llm) -> EngineSource:
    """Read an engine's model config: where its checkpoint is and how its attention is shaped.

    Raises:
        UnsupportedModelError: not a ``vllm.LLM``, or an architecture ``ARCHITECTURES`` does not know,
            or a quantized engine (its checkpoint does not hold F's weights as floats).
    """
    mc = getattr(llm, "model_config", None) or getattr(getattr(llm, "llm_engine", None), "model_config", None)
    if mc is None:
        raise UnsupportedModelError(f"expected a vllm.LLM with a model_config, got {type(llm).__name__}")
    layout_for(mc.architecture)  # an unknown architecture: one line, before anything is read
    if getattr(mc, "quantization", None):
        raise UnsupportedModelError(
            f"eigenhooks reads F from the checkpoint's float weights; this engine is quantized "
            f"({mc.quantization}): take spectra of the unquantized checkpoint loaded in transformers"
        )
    load = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    load = getattr(load, "load_config", None)
    return EngineSource(
        model=getattr(mc, "model_weights", "") or mc.model,
        revision=getattr(mc, "revision", None),
        download_dir=getattr(load, "download_dir", None),
        dtype=mc.dtype if isinstance(mc.dtype, torch.dtype) else getattr(torch, str(mc.dtype)),
        architecture=mc.architecture,
        config=attention_dims(mc.hf_text_config),
    )


def attention_dims(cfg) -> SimpleNamespace:
    """(n_layers, d_model, n_heads, n_kv_heads, d_head, tied) of a Llama-style config (an HF config object
    or config.json as a dict); ``tied``: the LM head is the input embedding."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, default=None: getattr(cfg, k, default)
    d, H = get("hidden_size"), get("num_attention_heads")
    G = get("num_key_value_heads") or H
    return SimpleNamespace(
        n_layers=get("num_hidden_layers"),
        d_model=d,
        n_heads=H,
        n_kv_heads=G,
        d_head=get("head_dim") or d // H,
        tied=bool(get("tie_word_embeddings", False)),
    )


def architecture_of(folder: str | Path, config: dict) -> str:
    """The architecture a checkpoint folder's config.json declares (its first ``architectures`` entry)."""
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError(f"{folder}/config.json names no architectures; pass architecture=...")
    return archs[0]


class _Attention(nn.Module):
    """The attention weights of one layer read from a checkpoint: V (G d_head, d), O (d, H d_head)."""

    def __init__(self, V: torch.Tensor, O: torch.Tensor):
        super().__init__()
        self.v_proj = nn.Linear(V.shape[1], V.shape[0], bias=False)
        self.o_proj = nn.Linear(O.shape[1], O.shape[0], bias=False)
        self.v_proj.weight = nn.Parameter(V, requires_grad=False)
        self.o_proj.weight = nn.Parameter(O, requires_grad=False)


class _Norm(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)


class _OnDemand(nn.Module):
    """A weight read from the checkpoint when first asked for (the embeddings: vocab x d, needed only by
    the heads' full OV circuit), then kept."""

    def __init__(self, read: Callable[[], torch.Tensor]):
        super().__init__()
        self._read, self._weight = read, None

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = self._read()
        return self._weight


class _Block(nn.Module):
    def __init__(self, attn: _Attention, norm: _Norm | None):
        super().__init__()
        self.self_attn = attn
        self.input_layernorm = norm


class CheckpointAttention(nn.Module):
    """Every layer's V, O and attention-norm weights as read from a checkpoint: what F needs, no forward.

    ``source`` says where they came from (the folder and the engine's dtype), for messages and notes.
    """

    def __init__(self, blocks: list[_Block], source: str, embed: _OnDemand | None = None):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.source = source
        self.embed_tokens = embed

    def get_input_embeddings(self) -> nn.Module | None:
        return self.embed_tokens

    def forward(self, *args, **kwargs):
        raise TypeError(
            "CheckpointAttention holds only the attention weights read from a checkpoint (for spectra); "
            "it has no forward. Run the model itself (the vllm.LLM, or transformers on the same folder)."
        )


def v_rows(t: torch.Tensor, layout: Layout, dims: SimpleNamespace) -> torch.Tensor:
    """V (G d_head, d) out of the tensor ``layout.v`` names: itself, or the v block of a merged q/k/v."""
    H, G, dh = dims.n_heads, dims.n_kv_heads, dims.d_head
    want = (H + 2 * G) * dh if layout.merged_qkv else G * dh
    if t.dim() != 2 or t.shape != (want, dims.d_model):
        what = "merged q/k/v" if layout.merged_qkv else "V"
        raise UnsupportedModelError(
            f"{layout.family}: the checkpoint's {what} weight has shape {tuple(t.shape)}, expected "
            f"({want}, {dims.d_model}) for {H} heads, {G} kv heads, head_dim {dh}; the checkpoint does not "
            "match its config (or is sharded/quantized)"
        )
    if layout.merged_qkv:
        return t[(H + G) * dh : (H + 2 * G) * dh]  # the v block: rows after q (H dh) and k (G dh)
    return t


def checkpoint_adapter(
    tensors: dict[str, torch.Tensor],
    layout: Layout,
    dims: SimpleNamespace,
    source: str,
    read: Callable[[str], torch.Tensor] | None = None,
) -> Adapter:
    """The adapter over the attention weights of a checkpoint, read into ``tensors`` by ``zoo.checkpoint``.

    Args:
        tensors: {name in ``layout.names(i)``: tensor}, in the dtype the engine computes in.
        layout: the architecture's row of ``ARCHITECTURES``.
        dims: ``attention_dims`` of its config.
        source: where the tensors came from (kept in ``adapter.notes``).
        read: name -> tensor, reading one more checkpoint tensor on demand (the embeddings, LM head and
            final norm, for ``spectra(heads=True)``'s full OV circuit); None: the adapter has none.

    Returns:
        An Adapter with every layer's factors (F = O V per kv group, the HF rule) and the attention norm;
        it has no reading points and no probe: the weights have no forward here.
    """
    blocks, layers = [], []
    for i in range(dims.n_layers):
        names = layout.names(i)
        V = v_rows(tensors[names["v"]], layout, dims)
        O = tensors[names["o"]]
        if O.shape != (dims.d_model, dims.n_heads * dims.d_head):
            raise UnsupportedModelError(
                f"{layout.family}: layer {i}'s O weight {names['o']} has shape {tuple(O.shape)}, expected "
                f"({dims.d_model}, {dims.n_heads * dims.d_head})"
            )
        norm = _Norm(tensors[names["norm"]]) if "norm" in names else None
        attn = _Attention(V, O)
        blocks.append(_Block(attn, norm))
        f = lambda a=attn: Factors.from_stacked(a.o_proj.weight, a.v_proj.weight, dims.n_heads, dims.n_kv_heads)
        layers.append(
            Layer(
                i,
                blocks[-1],
                attn,
                attn,
                norm,
                f,
                i,
                name=f"layers.{i}",
                o_proj=attn.o_proj,
                norm_offset=layout.norm_offset,
            )
        )
    embed = final = None
    unembed = lambda: None
    if read is not None:
        embed = _OnDemand(lambda: read(layout.embed))
        final = _OnDemand(lambda: read(layout.final_norm))
        unembed = (lambda: embed.weight) if dims.tied else (lambda: read(layout.unembed))
    model = CheckpointAttention(blocks, source, embed)
    return Adapter(
        model,
        f"{layout.family} (checkpoint)",
        "vllm",
        layers,
        "pre",
        dims.d_model,
        dims.n_heads,
        dims.n_kv_heads,
        final_norm_module=final,
        final_norm_offset=layout.norm_offset,  # Gemma's final norm scales by 1 + w too (models.base.norm_scale)
        unembed_weight=unembed,
        notes=[f"F read from the checkpoint the engine loaded: {source}"],
    )

"""vLLM's decoders: where their layers are and how their residual stream maps onto the reading points.

Most of vLLM's pre-norm decoder layers (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1, 2 and 3) pass the residual
stream as a pair: ``layer(positions, hidden, residual)`` returns ``(hidden, residual)`` and the norms fuse
the add (``input_layernorm(hidden, residual)`` returns ``(norm(hidden + residual), hidden + residual)``, in
place on some backends). No one tensor a hook sees is the residual stream; it is rebuilt from the pair:

- ``pre`` of layer i (the input of its ``input_layernorm``, as the HF adapter reads it): ``hidden +
  residual`` of the layer's input pair, or ``hidden`` alone at the first layer (residual None);
- ``attn``: what the attention sublayer adds to the residual stream: the ``self_attn`` output, or for the
  sandwich-norm Gemma 2 and 3 the ``post_attention_layernorm`` output (the HF adapter's mid is residual +
  that); ``mid`` (the input of the MLP's norm) is ``pre + attn``, the very add the next norm fuses;
- ``post``: ``pre`` of the next layer, or ``hidden + residual`` of the last layer's output (what the final
  norm fuses).

Granite's layers take ``(positions, hidden)`` and return the residual stream itself, adding each sublayer
scaled by ``residual_multiplier``: ``pre`` is the input, ``attn`` the ``self_attn`` output times the
multiplier (so ``mid`` is ``pre + attn`` as the layer computes it), ``post`` the output.

OLMo 2 runs through vLLM's transformers backend: its layers are transformers' own, called ``layer(hidden,
...)`` and returning the residual stream, each post-norm sublayer's output added to it; ``attn`` is the
``post_attention_layernorm`` output (the HF adapter's mid is the residual plus that).

An architecture not in ``VLLM_ARCHITECTURES`` is refused by name, never measured wrong. The batch is flat,
``(tokens, hidden)``, its
requests concatenated. This module knows layouts only; it imports nothing of vLLM (the engine wing hands
it the loaded model).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import UnsupportedModelError


@dataclass(frozen=True)
class VllmArch:
    """How one vLLM architecture's decoder layers carry the residual stream.

    Attributes:
        family: the HF ``model_type`` whose adapter defines the same reading points.
        attn: the layer's module whose output is what attention adds to the residual stream.
        scale: the layer's attribute that scales that output before the add (None: 1).
        pair: the layer returns ``(hidden, residual)`` (else the residual stream itself).
        hf: the layers are transformers' own (vLLM's transformers backend): called ``layer(hidden, ...)``.
    """

    family: str
    attn: str = "self_attn"
    scale: str | None = None
    pair: bool = True
    hf: bool = False


# vLLM architecture -> how its layers are read (their reading points are the HF family's)
VLLM_ARCHITECTURES = {
    "LlamaForCausalLM": VllmArch("llama"),
    "MistralForCausalLM": VllmArch("llama"),
    "Qwen2ForCausalLM": VllmArch("qwen2"),
    "Qwen3ForCausalLM": VllmArch("qwen3"),
    "Phi3ForCausalLM": VllmArch("phi3"),  # vLLM runs it as Llama layers over the merged qkv
    "GemmaForCausalLM": VllmArch("gemma"),
    "Gemma2ForCausalLM": VllmArch("gemma2", attn="post_attention_layernorm"),
    "Gemma3ForCausalLM": VllmArch("gemma3_text", attn="post_attention_layernorm"),
    "GraniteForCausalLM": VllmArch("granite", scale="residual_multiplier", pair=False),
    # vLLM runs OLMo 2 through its transformers backend: the HF layers, post-norm sublayers added to the stream
    "Olmo2ForCausalLM": VllmArch("olmo2", attn="post_attention_layernorm", pair=False, hf=True),
}


@dataclass(frozen=True)
class VllmLayout:
    """The decoder layers of a loaded vLLM model, each one's attention output module and its scale."""

    layers: list  # the decoder layers, in order
    attention: list  # each layer's module whose output attention adds to the residual stream
    scales: list  # each layer's scale of that output (1.0: none)
    pair: bool  # the layers return (hidden, residual); else the residual stream itself
    hf: bool = False  # transformers' layers, called layer(hidden, ...)


def check_architecture(architectures) -> str:
    """The vLLM architecture of an engine's model, if eigenhooks knows it.

    Raises:
        UnsupportedModelError: naming the architecture and the ones known.
    """
    archs = list(architectures or [])
    for a in archs:
        if a in VLLM_ARCHITECTURES:
            return a
    raise UnsupportedModelError(
        f"eigenhooks cannot monitor vLLM architecture {archs or 'unknown'}: how its decoder layers carry the "
        f"residual stream is known for {', '.join(sorted(VLLM_ARCHITECTURES))} only; measure the checkpoint in "
        "transformers instead"
    )


def vllm_layout(model, architecture: str | None = None) -> VllmLayout:
    """The decoder layers of a vLLM causal LM (``model.model.layers``) as its architecture (``architecture``,
    the engine's, else its class name, ``VLLM_ARCHITECTURES``) lays them out. Under vLLM's transformers
    backend the class is ``TransformersForCausalLM``, whatever the checkpoint's architecture.

    Raises:
        UnsupportedModelError: an unknown architecture, or the model is not laid out so (naming its class and
            what it holds).
    """
    name = architecture or type(model).__name__
    arch = VLLM_ARCHITECTURES.get(name)
    if arch is None:
        check_architecture([name])
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: expected the decoder layers at .model.layers, found "
            f"{sorted(n for n, _ in model.named_children())}"
        )
    layers = list(layers)
    missing = [i for i, blk in enumerate(layers) if getattr(blk, arch.attn, None) is None]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: layers {missing} hold no {arch.attn} ({type(layers[missing[0]]).__name__})"
        )
    scales = [float(getattr(blk, arch.scale)) if arch.scale else 1.0 for blk in layers]
    return VllmLayout(layers, [getattr(blk, arch.attn) for blk in layers], scales, arch.pair, arch.hf)


__all__ = ["VLLM_ARCHITECTURES", "VllmArch", "VllmLayout", "check_architecture", "vllm_layout"]

"""vLLM's decoders: where their layers are and how their dual residual stream maps onto the reading points.

vLLM's pre-norm decoder layers (Llama, Mistral, Qwen2/3) pass the residual stream as a pair:
``layer(positions, hidden, residual)`` returns ``(hidden, residual)`` and the norms fuse the add
(``input_layernorm(hidden, residual)`` returns ``(norm(hidden + residual), hidden + residual)``, in place
on some backends). No one tensor a hook sees is the residual stream; it is rebuilt from the pair:

- ``pre`` of layer i (the input of its ``input_layernorm``, as the HF Llama adapter reads it):
  ``hidden + residual`` of the layer's input pair, or ``hidden`` alone at the first layer (residual None);
- ``attn``: the ``self_attn`` output; ``mid`` (the input of the MLP's norm) is ``pre + attn``, the very add
  ``post_attention_layernorm`` fuses;
- ``post``: ``pre`` of the next layer, or ``hidden + residual`` of the last layer's output (what the final
  norm fuses).

The batch is flat, ``(tokens, hidden)``, its requests concatenated. This module knows layouts only; it
imports nothing of vLLM (the engine wing hands it the loaded model).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import UnsupportedModelError

# vLLM architecture -> the HF model_type whose adapter defines the same reading points
VLLM_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class VllmLayout:
    """The decoder layers of a loaded vLLM model and the attention module of each."""

    layers: list  # the decoder layers, in order: layer(positions, hidden, residual) -> (hidden, residual)
    attention: list  # each layer's ``self_attn``, whose output is the attention sublayer's


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
        f"eigenhooks cannot monitor vLLM architecture {archs or 'unknown'}: its decoder layers' residual pair "
        f"is known for {', '.join(sorted(VLLM_ARCHITECTURES))} only; measure the checkpoint in transformers instead"
    )


def vllm_layout(model) -> VllmLayout:
    """The decoder layers of a vLLM causal LM (``model.model.layers``), each holding ``self_attn``.

    Raises:
        UnsupportedModelError: the model is not laid out so (naming its class and what it holds).
    """
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: expected the decoder layers at .model.layers, found "
            f"{sorted(n for n, _ in model.named_children())}"
        )
    layers = list(layers)
    missing = [i for i, blk in enumerate(layers) if getattr(blk, "self_attn", None) is None]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}: layers {missing} hold no self_attn ({type(layers[missing[0]]).__name__})"
        )
    return VllmLayout(layers, [blk.self_attn for blk in layers])


__all__ = ["VLLM_ARCHITECTURES", "VllmLayout", "check_architecture", "vllm_layout"]

"""Directions to steer toward: a token's unembedding direction, or a contrast of prompts.

Both return unit float64 vectors in the residual stream (width d_model).
"""

from __future__ import annotations

import torch

from .models import get_adapter


def _unit(v: torch.Tensor, what: str) -> torch.Tensor:
    n = float(torch.linalg.vector_norm(v))
    if not n > 0 or not torch.isfinite(v).all():
        raise ValueError(f"{what} gives a zero or non-finite direction")
    return v / n


def token(model, tokenizer, text: str) -> torch.Tensor:
    """The residual direction that raises ``text``'s (first) token logit most.

    logits = W_U (w * x_hat + b), so with the final norm's scale w the direction in the
    normalised residual is w * W_U[t]; it is the unembedding row with the norm's scale
    taken into account.

    Raises:
        ValueError: the text is no token, or the model has no unembedding in d_model.
    """
    ad = get_adapter(model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{text!r} encodes to no token")
    if len(ids) > 1:
        import logging

        logging.getLogger(__name__).warning(
            "%r is %d tokens; using the first, %r", text, len(ids), tokenizer.decode(ids[:1])
        )
    W_U = ad.unembedding()
    if W_U is None or W_U.shape[1] != ad.d_model:
        raise ValueError(f"{ad.family}: no unembedding of width d_model={ad.d_model} to take a token direction from")
    u = W_U[ids[0]].detach().to("cpu", torch.float64)
    norm = ad.final_norm()
    w = getattr(norm, "weight", None)
    if w is not None:
        u = u * w.detach().to("cpu", torch.float64)
    return _unit(u, f"token {text!r}")


@torch.no_grad()
def contrast(model, tokenizer, pos_prompts: list[str], neg_prompts: list[str], layer: int = -1) -> torch.Tensor:
    """Mean residual (output of block ``layer``, all real tokens) of pos minus that of neg, unit."""
    ad = get_adapter(model)
    block = ad.layers[layer].block

    def mean_residual(prompts):
        total, count = None, 0
        for p in prompts:
            got = {}
            h = block.register_forward_hook(lambda m, a, o: got.__setitem__("x", o[0] if isinstance(o, tuple) else o))
            try:
                enc = tokenizer(p, return_tensors="pt")
                dev = next(model.parameters()).device
                model(**{k: v.to(dev) for k, v in enc.items()})
            finally:
                h.remove()
            x = got["x"][0].to("cpu", torch.float64)  # (n, d)
            total = x.sum(0) if total is None else total + x.sum(0)
            count += x.shape[0]
        return total / count

    if not pos_prompts or not neg_prompts:
        raise ValueError("contrast needs at least one positive and one negative prompt")
    return _unit(mean_residual(pos_prompts) - mean_residual(neg_prompts), "contrast")

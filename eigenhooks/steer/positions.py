"""Where a steered run is read: each sequence's last real token, and the real tokens' final residuals.

``summary(target_token=...)`` reports a token's next-token probability; with right padding a batch's last
column is a pad for its shorter sequences, so each sequence is read at the last position its
``attention_mask`` keeps (docs/steering.md, "Which tokens move which way, and where the report reads them").
"""

from __future__ import annotations

import logging

import torch

from .calibration import token_logits

log = logging.getLogger(__name__)


def mean_abs_cos(X: torch.Tensor, u: torch.Tensor, real: torch.Tensor | None = None) -> float:
    """Mean |<x, u>| / ||x|| over the tokens of X (..., d); with ``real`` (batch, >= seq) bool, over the real
    tokens of X (batch, seq, d) only (its last seq columns: under ``generate`` the mask spans the cache)."""
    if real is not None and X.dim() == 3 and real.shape[0] == X.shape[0] and real.shape[1] >= X.shape[1]:
        X = X[real[:, -X.shape[1] :].to(X.device)]  # (tokens, d): a report, after the forward: a sync is fine
    X = X.to(torch.float64).reshape(-1, X.shape[-1])
    return float(((X @ u.to(X.device)).abs() / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)).mean())


NO_LOGITS = object()  # a steered output without (batch, seq, vocab) logits


def real_tokens(call) -> torch.Tensor | None:
    """The call's ``attention_mask`` (batch, seq) as bool, or None: every position is a real token."""
    mask = call[1].get("attention_mask") if call else None
    return mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def last_logits(output, real: torch.Tensor | None = None):
    """Each sequence's logits at its last real token (batch, 1, vocab), detached (no graph kept alive), or
    ``NO_LOGITS``. The last real token is the last position ``real`` keeps; without a mask, and under left
    padding, that is the batch's last column, but with right padding a shorter sequence's last column is a pad,
    whose next-token probabilities mean nothing."""
    logits = token_logits(output)
    if logits is None:
        return NO_LOGITS
    n = logits.shape[1]
    if real is None or real.shape[0] != logits.shape[0] or real.shape[1] < n:
        return logits[:, -1:].detach()
    keep = real[:, -n:].to(logits.device)  # (batch, seq); under generate the mask spans the cache too
    last = n - 1 - keep.flip(1).int().argmax(1)  # (batch,) each row's last True (a row of none: the last column)
    return logits[torch.arange(len(last), device=logits.device), last][:, None].detach()


def next_token_probs(output, token: int) -> torch.Tensor | None:
    """The token's probability at each sequence's last real token (batch,) float64, from ``last_logits``'s
    (batch, 1, vocab); None without an LM head."""
    logits = token_logits(output)
    if logits is None:
        log.warning("the model's output has no (batch, seq, vocab) logits: no token probability to report")
        return None
    return torch.softmax(logits[:, -1].double(), -1)[:, token]


def prompt_batch(tok, prompts: list[str]):
    """Prompts as one right-padded batch, and its real tokens (prompts, seq) bool. Right padding keeps each
    prompt's positions as they are alone; a tokenizer without a pad token pads with its end token."""
    if len(prompts) > 1:
        if getattr(tok, "pad_token", None) is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
    batch = tok(prompts, return_tensors="pt", padding=len(prompts) > 1)
    return batch, batch["attention_mask"].bool()


def last_token_probs(output, real: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's next-token probabilities (batch, vocab) float64, at its last real token (``last_logits``)."""
    return torch.softmax(last_logits(output, real)[:, 0].double(), -1)

"""The parity harness: the HF monitor's table for the tokens a vLLM engine processed, and the comparison.

For a checkpoint, prompts and the tokens vLLM generated (greedy), the engine's forwards processed each
request's prompt plus its generated tokens but the last (the last one was sampled, never fed back).
``hf_table`` runs ``eh.monitor`` on the transformers model loaded from the same folder (float32) over
those tokens, each request its own sequence; ``compare`` checks a table against it with the issue's
tolerances and names the first row and column that differ:

- ``n_tokens``, ``null_tokens`` and ``n_sequences`` (the cluster is the request) exact;
- ``gamma_pre``/``gamma_mid``/``gamma_post`` to 1e-4 relative (float32);
- ``rho`` within 3 tokens' share (3 / n_tokens): a token whose delta sits at 0 may flip;
- ``p_null`` within 2 / (K + 1), K the null draws (two draws' worth of the Monte-Carlo p).

It lives with the tests, not in eigenhooks: it is the oracle of the vllm tier (its tolerances are
test tolerances), and a user checks their own engine the way docs/vllm.md shows, with ``eh.monitor``
on the HF model over the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

import eigenhooks as eh

EXACT = ("n_tokens", "null_tokens", "n_sequences")
GAMMAS = ("gamma_pre", "gamma_mid", "gamma_post")
GAMMA_RTOL = 1e-4
RHO_TOKENS = 3
P_DRAWS = 2
KEY = ("layer", "target")


@dataclass(frozen=True)
class Sequence:
    """One sequence the engine's forwards processed: its id as the user sees it, and its token ids."""

    request_id: str
    token_ids: tuple[int, ...]


def processed_tokens(outputs) -> list[Sequence]:
    """The token sequences vLLM's forwards processed, from ``llm.generate``'s ``RequestOutput`` list.

    Each sample (``n > 1``: each of a request's outputs) is its own sequence: the prompt's ids plus its
    generated ids but the last. Ids are ``request_id`` for one sample, ``f"{request_id}/{index}"`` else.
    """
    seqs = []
    for out in outputs:
        for c in out.outputs:
            rid = out.request_id if len(out.outputs) == 1 else f"{out.request_id}/{c.index}"
            seqs.append(Sequence(rid, tuple(out.prompt_token_ids) + tuple(c.token_ids[:-1])))
    return seqs


def hf_model(folder: str | Path):
    """The transformers model of a checkpoint folder, float32, eval mode."""
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_table(model, sequences, batch_size: int = 1, **monitor_kw) -> pd.DataFrame:
    """``eh.monitor(model, **monitor_kw)``'s summary over ``sequences``, each its own sequence.

    Args:
        model: a transformers causal LM (``hf_model``) or a checkpoint folder.
        sequences: ``Sequence``s or lists of token ids.
        batch_size: sequences per forward, right-padded with an attention mask (the monitor excludes the
            padding); the table must not depend on it.
        monitor_kw: the monitor's options (those the engine's monitor was given).

    Returns:
        The summary table, one row per (layer, target).
    """
    if isinstance(model, str | Path):
        model = hf_model(model)
    ids = [list(s.token_ids) if isinstance(s, Sequence) else list(s) for s in sequences]
    with eh.monitor(model, **monitor_kw) as mon, torch.no_grad():
        for k in range(0, len(ids), batch_size):
            part = ids[k : k + batch_size]
            n = max(map(len, part))
            batch = torch.zeros(len(part), n, dtype=torch.long)  # (b, n), right-padded
            mask = torch.zeros(len(part), n, dtype=torch.long)
            for r, s in enumerate(part):
                batch[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
            model(input_ids=batch, attention_mask=mask)
    return mon.summary()


def differences(got: pd.DataFrame, want: pd.DataFrame) -> list[str]:
    """Every (row, column) where ``got`` differs from ``want`` beyond the tolerances, first first.

    Rows are matched by (layer, target); a row in one table only is a difference too.
    """
    g, w = got.set_index(list(KEY)), want.set_index(list(KEY))
    out = [f"row {k}: missing from the table checked" for k in w.index if k not in g.index]
    out += [f"row {k}: not in the HF table" for k in g.index if k not in w.index]
    for k in w.index:
        if k not in g.index:
            continue
        a, b = g.loc[k], w.loc[k]
        n = b.get("n_tokens", float("nan"))
        K = b.get("null_draws", float("nan"))
        for col in [c for c in (*EXACT, *GAMMAS, "rho", "p_null") if c in w.columns]:
            if col not in g.columns:
                out.append(f"row {k}, column {col}: absent from the table checked")
                continue
            x, y = _num(a[col]), _num(b[col])
            if col in EXACT:
                tol, what = 0.0, "exact"
            elif col in GAMMAS:
                tol, what = GAMMA_RTOL * abs(y), f"{GAMMA_RTOL:g} relative"
            elif col == "rho":
                tol, what = RHO_TOKENS / n if n > 0 else 0.0, f"{RHO_TOKENS} tokens' share"
            else:
                tol, what = P_DRAWS / (K + 1) if K >= 0 else 0.0, f"{P_DRAWS}/(K+1)"
            if not _close(x, y, tol):
                out.append(f"row {k}, column {col}: got {x!r}, HF {y!r} (tolerance {what}: {tol:.3g})")
    return out


def compare(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Raise AssertionError naming the first row and column where ``got`` differs from the HF table."""
    diffs = differences(got, want)
    if diffs:
        raise AssertionError(f"{len(diffs)} difference(s) from the HF monitor; first: {diffs[0]}")


def _num(v) -> float:
    return float("nan") if v is None else float(v)


def _close(x: float, y: float, tol: float) -> bool:
    """Equal within tol; NaN only equals NaN (a statistic with nothing measured is NaN on both sides)."""
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= tol

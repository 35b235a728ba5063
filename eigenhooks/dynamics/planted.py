"""Tiny real HF models whose layer matrix F has a spectrum you choose (for tests and learning).

``planted_matrix`` builds F = S Lambda S^T with S orthogonal and Lambda block-diagonal (a
real eigenvalue is a 1x1 block, a complex pair r e^{+-i theta} a 2x2 rotation-scale block).
``planted_albert`` / ``planted_gpt2`` put it in a real model: value projection = identity,
output projection = F, biases 0, and (by default) query/key weights 0 so attention is
uniform: the linear limit of the paper.
"""

from __future__ import annotations

import math

import torch


def planted_matrix(eigenvalues: list[complex], d: int, seed: int = 0, rest: float = 0.3) -> torch.Tensor:
    """(d, d) float64 F with the given eigenvalues (complex ones stand for their conjugate pair
    too) and the remaining ones real, drawn uniformly in [-rest, rest]."""
    g = torch.Generator().manual_seed(seed)
    L = torch.zeros(d, d, dtype=torch.float64)
    i = 0
    for lam in eigenvalues:
        lam = complex(lam)
        if abs(lam.imag) > 0:
            r, th = abs(lam), math.atan2(lam.imag, lam.real)
            L[i : i + 2, i : i + 2] = r * torch.tensor(
                [[math.cos(th), -math.sin(th)], [math.sin(th), math.cos(th)]], dtype=torch.float64
            )
            i += 2
        else:
            L[i, i] = lam.real
            i += 1
    if i > d:
        raise ValueError(f"{len(eigenvalues)} eigenvalues need more than d={d} dimensions")
    L[range(i, d), range(i, d)] = (torch.rand(d - i, generator=g, dtype=torch.float64) * 2 - 1) * rest
    S, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return S @ L @ S.T


def _zero_qk_and_biases(lins, uniform: bool):
    for name, lin in lins.items():
        if lin.bias is not None:
            lin.bias.zero_()
        if uniform and name in ("q", "k"):
            lin.weight.zero_()


@torch.no_grad()
def planted_albert(F: torch.Tensor, n_heads: int = 2, uniform: bool = True, layers: int = 4):
    """An AlbertModel (one shared layer) whose F is the given (d, d) matrix, float64."""
    from transformers import AlbertConfig, AlbertModel

    d = F.shape[0]
    cfg = AlbertConfig(
        vocab_size=64,
        embedding_size=d,
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        intermediate_size=2 * d,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    m = AlbertModel(cfg).double().eval()
    a = m.encoder.albert_layer_groups[0].albert_layers[0].attention
    a.value.weight.copy_(torch.eye(d))
    a.dense.weight.copy_(F)
    _zero_qk_and_biases({"q": a.query, "k": a.key, "v": a.value, "o": a.dense}, uniform)
    return m


@torch.no_grad()
def planted_gpt2(F: torch.Tensor, n_heads: int = 2, uniform: bool = True, layers: int = 1):
    """A GPT2Model whose every layer has the given F (used "as if shared"), float64."""
    from transformers import GPT2Config, GPT2Model

    d = F.shape[0]
    torch.manual_seed(0)
    m = GPT2Model(GPT2Config(n_layer=layers, n_head=n_heads, n_embd=d, vocab_size=64, n_positions=64)).double().eval()
    for blk in m.h:
        W = blk.attn.c_attn.weight  # Conv1D (in, out): q | k | v column blocks
        if uniform:
            W[:, : 2 * d].zero_()
        W[:, 2 * d :].copy_(torch.eye(d))
        blk.attn.c_attn.bias.zero_()
        blk.attn.c_proj.weight.copy_(F.T)  # (in, out): O = weight^T
        blk.attn.c_proj.bias.zero_()
    return m

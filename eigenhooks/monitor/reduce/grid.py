"""Which tokens of one call count, and where each sits in its own sequence: the ``Grid``.

The null subsample is chosen by each token's index among its own sequence's valid tokens
(counted across a KV cache's forwards), never by where it sits in a batch, so the same
sequences give the same numbers however they are batched, padded, sharded or generated
(docs/design.md, "Statistics").
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Count(NamedTuple):
    """(b, 1) valid tokens of each open sequence as base + k, k a host int: what one-token steps with every
    row valid count, kept without an op a step (``Grid.cat`` makes their indices in one)."""

    base: torch.Tensor
    k: int

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def device(self) -> torch.device:
        return self.base.device

    def tensor(self) -> torch.Tensor:
        return self.base + self.k if self.k else self.base

    @staticmethod
    def of(seen) -> Count:
        return seen if isinstance(seen, Count) else Count(seen, 0)


def as_tensor(seen) -> torch.Tensor:
    """A count (``Count`` or (b, 1) tensor) as a tensor."""
    return seen.tensor() if isinstance(seen, Count) else seen


class Grid:
    """Which tokens of one call count, and where each sits in its own sequence.

    Args:
        mask: (b, n) bool, the valid (non-padding) tokens.
        vi: (b, n) int64, each token's index among its sequence's valid tokens, counted from the
            sequence's start (under a KV cache, across forwards). Default: from this call alone.
        after: (b, 1) valid tokens of each sequence once this call is counted, when the caller has it.
    """

    def __init__(self, mask: torch.Tensor, vi: torch.Tensor | Count | None = None, after=None):
        self.mask = mask
        self._vi = mask.cumsum(1) - 1 if vi is None else vi  # a Count: a one-token step's, made when needed
        self._after = after
        self._subs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @property
    def vi(self) -> torch.Tensor:
        if isinstance(self._vi, Count):
            self._vi = self._vi.tensor()
        return self._vi

    @property
    def after(self) -> torch.Tensor | Count:
        """(b, 1): the valid tokens each sequence has counted once this call is (the next call's start);
        a ``Count`` after a one-token step that made none."""
        if self._after is None:
            self._after = self.vi[:, -1:] + 1
        return self._after

    def sub(self, null_stride: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The null subsample: valid tokens whose index in their sequence is a multiple of null_stride.

        Returns (flat, ok): flat (b*M,) int64, the flat (b*n) position of each row's j-th chosen
        token (M = ceil(n/null_stride) slots a row: a row of n tokens holds at most that many), or None when
        null_stride == 1 (every token: no gather); ok (b, M) bool, which slots hold a chosen token. Fixed
        shapes, made on the device without reading anything back.
        """
        if null_stride not in self._subs:
            b, n = self.mask.shape
            if null_stride == 1:
                self._subs[null_stride] = (None, self.mask)
            else:
                M = -(-n // null_stride)
                chosen = self.mask & (self.vi % null_stride == 0)
                count = chosen.cumsum(1)  # (b, n): chosen tokens up to each position
                j = torch.arange(1, M + 1, device=count.device).expand(b, M).contiguous()
                col = torch.searchsorted(count, j)  # (b, M): the j-th chosen token's column, n if none
                ok = col < n
                flat = col.clamp_max(n - 1) + torch.arange(0, b * n, n, device=count.device)[:, None]
                self._subs[null_stride] = (flat.reshape(-1), ok)
        return self._subs[null_stride]

    @staticmethod
    def cat(grids: list[Grid]) -> Grid:
        """Calls side by side along the positions (buffered single-position forwards); steps counted from one
        base, one after another (``Count``), get their indices in one op: base + (k, k + 1, ...)."""
        mask = torch.cat([g.mask for g in grids], 1)
        vis = [g._vi for g in grids]
        v0 = vis[0]
        if isinstance(v0, Count) and all(
            [isinstance(v, Count) and v.base is v0.base and v.k == v0.k + j for j, v in enumerate(vis)]
        ):
            return Grid(mask, v0.base + torch.arange(v0.k, v0.k + len(vis), device=v0.base.device))
        return Grid(mask, torch.cat([g.vi for g in grids], 1))

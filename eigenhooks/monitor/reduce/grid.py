"""Which tokens of one call count, and where each sits in its own sequence: the ``Grid``.

The null subsample is chosen by each token's index among its own sequence's valid tokens
(counted across a KV cache's forwards), never by where it sits in a batch, so the same
sequences give the same numbers however they are batched, padded, sharded or generated
(docs/design.md, "Statistics").
"""

from __future__ import annotations

import torch


class Grid:
    """Which tokens of one call count, and where each sits in its own sequence.

    Args:
        mask: (b, n) bool, the valid (non-padding) tokens.
        vi: (b, n) int64, each token's index among its sequence's valid tokens, counted from the
            sequence's start (under a KV cache, across forwards). Default: from this call alone.
        after: (b, 1) valid tokens of each sequence once this call is counted, when the caller has it.
    """

    def __init__(self, mask: torch.Tensor, vi: torch.Tensor | None = None, after: torch.Tensor | None = None):
        self.mask = mask
        self.vi = mask.cumsum(1) - 1 if vi is None else vi
        self._after = after
        self._subs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @property
    def after(self) -> torch.Tensor:
        """(b, 1): the valid tokens each sequence has counted once this call is (the next call's start)."""
        if self._after is None:
            self._after = self.vi[:, -1:] + 1
        return self._after

    def sub(self, s: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The null subsample: valid tokens whose index in their sequence is a multiple of s.

        Returns (flat, ok): flat (b*M,) int64, the flat (b*n) position of each row's j-th chosen
        token (M = ceil(n/s) slots a row: a row of n tokens holds at most that many), or None when
        s == 1 (every token: no gather); ok (b, M) bool, which slots hold a chosen token. Fixed
        shapes, made on the device without reading anything back.
        """
        if s not in self._subs:
            b, n = self.mask.shape
            if s == 1:
                self._subs[s] = (None, self.mask)
            else:
                M = -(-n // s)
                chosen = self.mask & (self.vi % s == 0)
                count = chosen.cumsum(1)  # (b, n): chosen tokens up to each position
                j = torch.arange(1, M + 1, device=count.device).expand(b, M).contiguous()
                col = torch.searchsorted(count, j)  # (b, M): the j-th chosen token's column, n if none
                ok = col < n
                flat = col.clamp_max(n - 1) + torch.arange(0, b * n, n, device=count.device)[:, None]
                self._subs[s] = (flat.reshape(-1), ok)
        return self._subs[s]

    @staticmethod
    def cat(grids: list[Grid]) -> Grid:
        """Calls side by side along the positions (buffered single-position forwards)."""
        return Grid(torch.cat([g.mask for g in grids], 1), torch.cat([g.vi for g in grids], 1))

"""``Factors``: one layer's attention factors O and V, column convention, as the model stores them.

Pure torch. F = sum_h O_h V_{g(h)} = Ô V (docs/design.md, "Layer matrix").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import views


@dataclass
class Factors:
    """The attention factors of one layer, column convention, as the model stores them.

    Attributes:
        O_heads: (H, d, d_head) head h's slice of the output projection.
        V_groups: (G, d_head, d) the value projection of each key/value group.
        group_of_head: (H,) the group each head reads its values from (G == H without GQA).
    """

    O_heads: torch.Tensor
    V_groups: torch.Tensor
    group_of_head: torch.Tensor

    @classmethod
    def from_stacked(cls, O: torch.Tensor, V: torch.Tensor, n_heads: int, n_kv_heads: int | None = None):
        """Split O (d, H*d_head) and V (G*d_head, d) into heads; G = n_kv_heads or n_heads."""
        n_kv = n_kv_heads or n_heads
        d = O.shape[0]
        d_head = O.shape[1] // n_heads
        if O.shape[1] != n_heads * d_head or V.shape != (n_kv * d_head, d):
            raise ValueError(
                f"factor shapes do not fit {n_heads} heads / {n_kv} kv groups: {tuple(O.shape)=}, {tuple(V.shape)=}"
            )
        O_heads = O.reshape(d, n_heads, d_head).permute(1, 0, 2)  # (H, d, d_head)
        V_groups = V.reshape(n_kv, d_head, d)  # (G, d_head, d)
        group_of_head = torch.arange(n_heads) // (n_heads // n_kv)
        return cls(O_heads, V_groups, group_of_head)

    @property
    def d_model(self) -> int:
        return self.O_heads.shape[1]

    def __repr__(self) -> str:  # a line: the sizes a reader checks, the tensors by shape (views.py)
        H, d, d_head = self.O_heads.shape
        return (
            f"Factors({H} heads, {self.V_groups.shape[0]} groups, d={d}, d_head={d_head}, "
            f"O_heads {views.shape_of(self.O_heads)}, V_groups {views.shape_of(self.V_groups)})"
        )

    def stacked(self, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (Ô, V): Ô (d, G*d_head) sums the O_h of each group, V (G*d_head, d), so F = Ô V.

        Ô is always a fresh tensor; V may share the factors' storage when it is already
        ``dtype`` on the CPU (it is only read).
        """
        G, d_head, d = self.V_groups.shape
        V = self.V_groups.detach().to("cpu", dtype).reshape(G * d_head, d)
        return self._o_hat(dtype), V

    def _o_hat(self, dtype) -> torch.Tensor:
        """Ô (d, G*d_head): the sum of O_h over the heads of each group, computed in ``dtype``."""
        O_h = self.O_heads.detach().to("cpu")  # (H, d, d_head)
        H, d, d_head = O_h.shape
        G = self.V_groups.shape[0]
        groups = self.group_of_head.cpu()
        if H % G == 0 and torch.equal(groups, torch.arange(H) // (H // G)):
            # The heads of a group are adjacent (HF's GQA layout): (d, H, dh) -> (d, G, H/G, dh), a
            # view of the model's (d, H*dh) o_proj, summed over the heads of each group. No
            # index_add into zeros and no float64 copy of the permuted (H, d, dh) layout.
            O = O_h.permute(1, 0, 2).reshape(d, G, H // G, d_head)  # (d, G, H/G, dh)
            return O.sum(2, dtype=dtype).reshape(d, G * d_head)  # (d, G*dh), fresh, summed in dtype
        O_hat = torch.zeros(G, d, d_head, dtype=dtype)
        O_hat.index_add_(0, groups, O_h.to(dtype))
        return O_hat.permute(1, 0, 2).reshape(d, G * d_head)

    def matrix(self, dtype=torch.float64) -> torch.Tensor:
        """F = Ô V, (d, d)."""
        O, V = self.stacked(dtype)
        return O @ V

    def scaled(self, left: torch.Tensor | None = None, right: torch.Tensor | None = None) -> Factors:
        """Factors of diag(left) F diag(right): folds a norm's scale in (the ``ov_ln`` variant).

        The scaled factor is float64 whatever the model's dtype: a bf16 product w * V would round
        each entry to 8 bits before the float64 eig ever saw it. The other factor is left as stored.
        """
        O_heads, V_groups = self.O_heads, self.V_groups
        if left is not None:
            O_heads = O_heads.to(torch.float64) * left.to(O_heads.device, torch.float64)[None, :, None]
        if right is not None:
            V_groups = V_groups.to(torch.float64) * right.to(V_groups.device, torch.float64)[None, None, :]
        return Factors(O_heads, V_groups, self.group_of_head)

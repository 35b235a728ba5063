"""The F-null: directions orth(F g), one power step from a Gaussian start (``power_step_frames``).

Frames: {variant: (fnull_draws, d, k_max)}, one set per variant whose F the layer's targets are
measured under (``TargetSpec.variant``); none when ``fnull_draws`` is 0. Columns: per variant, in
sorted order, ``fnull_draws * frame_width`` columns of ``Bn64``. State: ``fnull_up`` (T,
fnull_draws), each target's up-counts of its variant's F-null directions of its own k.
"""

from __future__ import annotations

import torch

from .base import Builtin
from .haar import prefix_norms


def power_step_frames(apply_F, d: int, k_max: int, K: int, seed: int) -> torch.Tensor:
    """K frames (K, d, k_max) spanning orth(F g_1 .. F g_k), g Gaussian: one power step.

    Args:
        apply_F: maps (d, m) float64 to F @ it.
    """
    g = torch.Generator().manual_seed(int(seed))
    G = torch.randn(d, K * k_max, generator=g, dtype=torch.float64)
    FG = apply_F(G).T.reshape(K, k_max, d).transpose(1, 2)  # (K, d, k_max)
    Q, R = torch.linalg.qr(FG)
    return Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]


class FNull(Builtin):
    name = "fnull"
    fields = ("fnull_up",)
    settings = ("fnull_draws",)
    null = True

    def draw(self, at):
        """Every target's variant's frames: the layer targets' variants drawn first (seeds 1, 2, ...), so that
        head targets never move their draws."""
        from ...spectra.compute import layer_stacked
        from .. import head_targets as H

        if not at.config.fnull_draws:
            return None
        frames: dict[str, torch.Tensor] = {}
        first = sorted({t.variant for t, h in zip(at.targets, at.heads) if not h})
        for key in first + sorted({t.variant for t in at.targets} - set(first)):
            O, V = layer_stacked(at.adapter, at.layer, key)
            apply_F = lambda G, O=O, V=V: O @ (V @ G)  # noqa: E731
            j = 1 + len(frames)
            f = power_step_frames(apply_F, at.adapter.width(at.layer), at.k_draw, at.config.fnull_draws, at.seed(j))
            frames[key] = H.widen(f, at.k_max, at.seed(H.WIDEN_SEED + j), apply_F)
        return frames

    def draws(self, frames):
        return next(iter(frames.values())).shape[0]

    def kind(self, frames, lb):
        return (self.draws(frames), tuple(sorted(frames)), tuple(t.variant for t in lb.targets))

    def zero(self, size):
        return {"fnull_up": torch.zeros(size.T, size.draws.get(self.name, 0), dtype=torch.float64)}

    def columns(self, lb, width):
        frames = lb.frames.get(self.name, {})
        return [frames[key].permute(1, 0, 2).reshape(lb.d, -1) for key in sorted(frames)]

    def constants(self, bases, picks, dev):
        if self.name in bases[0].frames and len({tuple(k) for k in picks["k_index"]}) > 1:  # picks float32 counts
            hot = torch.nn.functional.one_hot(torch.tensor(picks["k_index"]), len(bases[0].group_ks)).transpose(1, 2)
            return {"fk_hot": hot.to(dev, torch.float32)}
        return {}

    def align(self, stk, P, inv):
        bases = stk.bases
        frames = bases.frames.get(self.name, {})
        if not frames:
            return {}
        L, N, Kf = *P.shape[:2], self.draws(frames)
        w = Kf * bases.frame_width
        out = {}
        for i, key in enumerate(sorted(frames)):
            Fp = P[..., i * w : (i + 1) * w].reshape(L, N, Kf, bases.frame_width)
            out["f:" + key] = prefix_norms(Fp, bases.group_ks) * inv[..., None, None]  # (L, N, Kf, n_k)
        return out

    def up(self, stk, aligned, on_null, cols, st, scratch):
        """(L, T, fnull_draws): up-counts of the F-null directions, each layer at its own target's k."""
        bases, L = stk.bases, stk.L
        if self.name not in bases.frames:  # no F-null at these layers (fnull_draws = 0)
            self.no_mid(stk, st)
            return
        zmid, zref, up = on_null["mid"], scratch["zref"], stk.grew
        out = torch.zeros(L, bases.T, self.draws(bases.frames[self.name]), device=stk.dev)
        fk_hot, k0 = stk.consts.get("fk_hot"), stk.picks["k_index"][0]
        for ti, t in enumerate(bases.targets):
            key = "f:" + t.variant
            if fk_hot is None:  # every layer reads the same k: that column alone
                j = k0[ti]
                out[:, ti] = up(zmid[key][..., j], zref[key][..., j]).sum(1, dtype=torch.float32)
            else:  # each layer its own k: up-counts at every k, each layer's picked by its one-hot
                ups = up(zmid[key], zref[key]).sum(1, dtype=torch.float32)  # (L, Kf, n_k)
                out[:, ti] = (ups * fk_hot[:, None, :, ti]).sum(-1)
        st["fnull_up"] = out

    def no_mid(self, stk, st):
        frames = stk.bases.frames.get(self.name)
        st["fnull_up"] = torch.zeros(stk.L, stk.bases.T, self.draws(frames) if frames else 0, device=stk.dev)

    def summary(self, row, out: dict) -> dict:
        """The F-null's mean up-rate, and the target's percentile among its directions."""
        import numpy as np

        from ..stats import percentile

        ns, fu = row.t["n_sub"], row.state["fnull_up"]
        fn = fu[row.ti].numpy() / ns if ns > 0 and fu.shape[1] else np.array([])
        return {
            "fnull_rho_mean": float(fn.mean()) if fn.size else float("nan"),
            "fnull_percentile": percentile(out["rho_null_tokens"], fn),
        }

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub, row) -> None:
        """Plain float64: each target's F-null up-counts on one sequence's subsample."""
        from .plain import align_frames, up

        if "mid" not in Y:
            return
        for ti, t in enumerate(ls.bases.targets):
            if t.fnull is not None:
                ups = up(align_frames(Y["mid"], t.fnull, t.k), align_frames(Yr, t.fnull, t.k))
                ls.state["fnull_up"][ti] += ups.sum(0)


FNULL = FNull()

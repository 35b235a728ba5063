"""The F-null: directions orth(F g), one power step from a Gaussian start (``stats.power_step_frames``).

Columns: per F-null variant (``LayerBases.fkeys``), ``fnull_draws * frame_width`` columns of
``Bn64``. State: ``fnull_up`` (T, fnull_draws), each target's up-counts of the F-null directions of
its own k.
"""

from __future__ import annotations

import torch

from .base import Builtin
from .haar import prefix_norms


class FNull(Builtin):
    name = "fnull"
    fields = ("fnull_up",)
    settings = ("fnull_draws",)
    null = True

    def zero(self, size):
        return {"fnull_up": torch.zeros(size.T, size.Kf, dtype=torch.float64)}

    def columns(self, lb, width):
        kw = lb.frame_width
        return [lb._fnull[key].permute(1, 0, 2).reshape(lb.d, lb.fnull_draws * kw) for key in lb.fkeys]

    def constants(self, bases, picks, dev):
        if picks["fk_index"][0] and len({tuple(f) for f in picks["fk_index"]}) > 1:  # picks float32 counts
            hot = torch.nn.functional.one_hot(torch.tensor(picks["fk_index"]), len(bases[0].group_fks)).transpose(1, 2)
            return {"fk_hot": hot.to(dev, torch.float32)}
        return {}

    def align(self, stk, P, inv):
        bases = stk.bases
        L, N = P.shape[:2]
        w = bases.fnull_draws * bases.frame_width
        out = {}
        for i, key in enumerate(bases.fkeys):
            Fp = P[..., i * w : (i + 1) * w].reshape(L, N, bases.fnull_draws, bases.frame_width)
            out["f:" + key] = prefix_norms(Fp, bases.group_fks) * inv[..., None, None]  # (L, N, Kf, len(fks))
        return out

    def up(self, stk, aligned, on_null, cols, st, scratch):
        """(L, T, fnull_draws): up-counts of the F-null directions, each layer at its own target's k."""
        bases, L = stk.bases, stk.L
        zmid, zref, up = on_null["mid"], scratch["zref"], stk.grew
        out = torch.zeros(L, bases.T, bases.fnull_draws, device=stk.dev)
        fk_hot, f0 = stk.consts.get("fk_hot"), stk.picks["fk_index"][0]
        for i, (ti, fkey, _) in enumerate(bases.fnull_targets):
            key = "f:" + fkey
            if fk_hot is None:  # every layer reads the same k: that column alone
                j = f0[i]
                out[:, ti] = up(zmid[key][..., j], zref[key][..., j]).sum(1, dtype=torch.float32)
            else:  # each layer its own k: up-counts at every k, each layer's picked by its one-hot
                ups = up(zmid[key], zref[key]).sum(1, dtype=torch.float32)  # (L, Kf, n_fk)
                out[:, ti] = (ups * fk_hot[:, None, :, i]).sum(-1)
        st["fnull_up"] = out

    def no_mid(self, stk, st):
        st["fnull_up"] = torch.zeros(stk.L, stk.bases.T, stk.bases.fnull_draws, device=stk.dev)

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

"""A null family is one file and one registration line (issue 56): a second one, written here, runs in a real
monitor and its columns are what numpy makes of readings that hooks of our own recorded.

The family: K random k-subspaces of the first C coordinates (a frame drawn from a seeded Gaussian in that
coordinate subspace). Its sums are its draws' alignments at pre and mid on the null's tokens; its columns are the
draws' mean γ_pre and Δγ, the target's one-sided Monte-Carlo p of Δγ among the draws', and, over the table, that
p's BH q. Nothing outside this file names it: the plan draws its frames, the reduction projects and sums them,
the summary and the table ask it for its columns, all by iterating over the registry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import measures, stats
from eigenhooks.monitor.measures import Builtin
from eigenhooks.monitor.measures.haar import prefix_norms

from .readings import Recorder
from .summaries import bh_by_hand

C, K, WHICH = 4, 6, 3000  # coordinates, draws, the draws' seed kind (``plan.seed``)
SETTINGS = dict(null_draws=8, fnull_draws=4, eig_top=2, null_stride=1, null_seed=5, verdict_draws=19)
TEXTS = ["def f(x):\n    return x + 1", "The for statement iterates over a sequence.", "import os", "x = [1, 2]"]


def coord_frames(d: int, k: int, seed: int) -> torch.Tensor:
    """K orthonormal frames (K, d, k) inside the first C coordinates, from a seeded Gaussian."""
    g = torch.Generator().manual_seed(int(seed))
    Q, _ = torch.linalg.qr(torch.randn(K, C, k, generator=g, dtype=torch.float64))
    return torch.nn.functional.pad(Q, (0, 0, 0, d - C))  # zero rows below the C coordinates


class Coord(Builtin):
    name = "coord"
    fields = ("coord_pre", "coord_mid")
    null = True
    per_k = ("coord_pre", "coord_mid")
    table_columns = ("coord_q",)

    def draw(self, at):
        return coord_frames(at.adapter.width(at.layer), at.k_max, at.seed(WHICH))

    def zero(self, size):
        n = size.draws.get(self.name, 0)
        return {f: torch.zeros(size.n_k, n, dtype=torch.float64) for f in self.fields}

    def columns(self, lb, width):
        frames = lb.frames[self.name]
        return [frames.permute(1, 0, 2).reshape(lb.d, -1)]  # column j * frame_width + i

    def align(self, stk, P, inv):
        L, N = P.shape[:2]
        H = P.reshape(L, N, K, stk.bases.frame_width)
        return {"coord": prefix_norms(H, stk.bases.group_ks).transpose(2, 3) * inv[..., None, None]}  # (L, N, n_k, K)

    def point_sums(self, stk, null_all, n_points, N):
        a = null_all["coord"]
        return {"coord_sum": a.reshape(stk.L, n_points, N, *a.shape[2:]).nansum(2)}

    def sums(self, stk, aligned, on_null, cols, st):
        st["coord_pre"] = on_null["pre"]["coord_sum"]

    def up(self, stk, aligned, on_null, cols, st, scratch):
        st["coord_mid"] = on_null["mid"]["coord_sum"]

    def no_mid(self, stk, st):
        st["coord_mid"] = torch.zeros(stk.L, len(stk.bases.group_ks), K, device=stk.dev)

    def summary(self, row, out):
        pre = row.state["coord_pre"][row.k_index].numpy() / row.t["n_pre_sub"]
        dg = row.state["coord_mid"][row.k_index].numpy() / row.t["n_sub"] - pre
        return {
            "coord_gamma_pre": float(pre.mean()),
            "coord_dgamma": float(dg.mean()),
            "coord_p": float((1 + (dg >= out["dgamma"]).sum()) / (K + 1)),
        }

    def table(self, df, at):
        df["coord_q"] = at.q(at.shared(df["coord_p"].tolist()))


COORD = Coord()


def align(X: np.ndarray, U: np.ndarray) -> np.ndarray:
    return np.linalg.norm(X @ U, axis=-1) / np.linalg.norm(X, axis=-1)


def run(model, batch, probe):
    mon = eh.monitor(model, targets=[("ov", "modulus"), ("probe", probe)], **SETTINGS)
    with torch.no_grad(), mon, Recorder(model) as rec:
        model(**batch)
    return mon, mon.summary(), rec


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    tok.pad_token = tok.eos_token
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    G = torch.randn(model.config.n_embd, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return model, batch, torch.linalg.qr(G)[0]  # a plane: with v_1's planes and lines, layers of other k stack


def test_a_registered_null_family_measures_what_numpy_makes_of_the_readings(gpt2):
    model, batch, probe = gpt2
    before = measures.registered()
    plain, want_plain, _ = run(model, batch, probe)
    with measures.register(COORD):  # the one registration line
        mon, df, rec = run(model, batch, probe)
    assert measures.registered() == before  # the registry is as it was
    assert not {"coord_gamma_pre", "coord_q"} & set(run(model, batch, probe)[1].columns)

    assert {"coord_gamma_pre", "coord_dgamma", "coord_p", "coord_q"} <= set(df.columns)
    assert {"coord_pre", "coord_mid"} <= set(mon.state_dict()["layers"]["0"])
    assert mon.state_dict()["fingerprint"] == plain.state_dict()["fingerprint"]  # it adds no setting
    # the built-in columns, in their order, are what they are without it (float32 sums of another matmul's shape)
    common = [c for c in df.columns if c in want_plain.columns]
    assert common == list(want_plain.columns)
    for c in ("rho", "gamma_pre", "dgamma", "null_rho_mean", "null_dgamma_mean", "fnull_rho_mean", "tilt"):
        np.testing.assert_allclose(df[c], want_plain[c], rtol=1e-6, atol=1e-7, err_msg=c)
    assert (df["verdict"] == want_plain["verdict"]).all()

    ks = {tuple(sorted(set(g))) for _, g in df.groupby("layer")["k"]}
    assert ks == {(2,), (1, 2)}  # a layer reduced beside one of more k reads its own k's rows back
    (fw,) = rec.forwards
    specs = eh.spectra(model)
    ps = []
    for r in df.itertuples():
        rd, valid = fw.layers[r.layer], fw.mask.bool()
        pre, mid = rd.pre[valid].double().numpy(), rd.mid[valid].double().numpy()
        U = (specs[r.layer].basis if r.target == "ov/modulus" else probe).numpy()
        k_max = df.loc[df["layer"] == r.layer, "k"].max()  # the layer's frames are drawn this wide
        seed = stats.draw_seed(SETTINGS["null_seed"], r.layer, WHICH)
        frames = coord_frames(model.config.n_embd, k_max, seed)[..., : r.k]
        g_pre = np.array([align(pre, Q).mean() for Q in frames.numpy()])
        dg = np.array([(align(mid, Q) - align(pre, Q)).mean() for Q in frames.numpy()])
        target_dg = (align(mid, U) - align(pre, U)).mean()
        assert r.null_tokens == valid.sum()
        assert r.coord_gamma_pre == pytest.approx(g_pre.mean(), rel=1e-5, abs=1e-7)
        assert r.coord_dgamma == pytest.approx(dg.mean(), rel=1e-4, abs=1e-6)
        assert abs(r.dgamma - target_dg) < 1e-6 and np.abs(dg - target_dg).min() > 1e-5  # no tie to round either way
        ps.append((1 + (dg >= target_dg).sum()) / (K + 1))
        assert r.coord_p == ps[-1]
    assert len(set(ps)) > 1  # the p's are not all one value
    np.testing.assert_allclose(df["coord_q"], bh_by_hand(ps), rtol=1e-12)  # every row is its own hypothesis


def test_a_family_whose_names_are_taken_is_refused():
    class Twin(Coord):
        name = "haar"

    with pytest.raises(ValueError, match=r"'haar'.*already registered"):
        measures.register(Twin())
    assert Twin not in {type(m) for m in measures.registered()}

"""Does the monitor's test see anything on a real model? Power from planted effects (issue 51).

    python benchmarks/power.py run [--seeds 0 1 2] [--layers 9 18 27] [--sizes ...]   # appends passes
    python benchmarks/power.py write                                                  # the findings section

An alignment of known size is planted at one layer L of SmolLM2 per pass: the paper's rank-1 change
O_L' = O_L + alpha u wᵀ (``eh.steer(method="paper")``) with u = the layer's unedited v_1 (real,
k = 1), so F' u = (lambda_1 + alpha ||V u||) u: u stays an eigenvector and, with alpha of
lambda_1's sign, stays principal (the other eigenvalues of a rank-1 change along an eigenvector do
not move). The strength is s = alpha ||V u|| / lambda_1 (lambda_1' = (1 + s) lambda_1). The target
is the unedited v_1 (the edited one spans the same line). The size of what was planted is measured
as the true change, on the same tokens, of rho (Δρ) and of gamma_mid - gamma_pre (Δγ) against the
unedited model. Layers after L are downstream of the edit, not "unplanted".

Each pass is one monitored forward of 4 x 128 tokens of the bundled text (window ``seed``, which
no choice of the study was made on), ``null_seed = seed``, with K = KMAX Haar draws; the
statistics at a smaller K are read from the first K draws, which are the draws a run at that K
makes (``measures.haar.haar_frames`` draws them in order; checked by ``check``). Per pass and candidate
statistic, detection at L is the verdict the run would print: Benjamini-Hochberg over the run's
hypotheses (the default targets' distinct (layer, subspace)), q < 0.05. False positives: random
unit targets (each added to the table as the user would add one: its 30 rows join the family) and
the default targets at layers before L (compared with the unedited pass).

Candidates (each a p-value per row; q by BH over the table):
- ``rho_mc@K``: today's p_null, rho against the K Haar draws, two-sided Monte-Carlo p (floor 2/(K+1));
- ``rho_fit@128``: rho against a normal fitted to the first 128 draws (prediction t, K-1 df);
- ``dg_mc@K``, ``dg_fit@128``: the same for Δγ = gamma_mid - gamma_pre on the null's tokens (the CSV's
  p_dg_fit128 is the normal tail, too light for Δγ's draws; ``write`` reads Δγ's t_8 tail, ``dg_t128``,
  the verdict's test since 2026-12, from the rows' dg_mean128 and dg_sd128);
- eig rank (rank among F's top 16 eigen-subspaces) and the F-null percentile (64 draws) are recorded;
  their p-values have floors 1/17 and 2/65, above 0.05 / m for any m > 1.

Raw per-row results go to benchmarks/power_results.csv (one line per pass, layer and target);
``write`` reads only that file.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from eigenhooks.monitor.measures import TGT_FIELDS

HERE = Path(__file__).resolve().parent
RAW = HERE / "power_results.csv"
DOC = HERE.parent / "docs" / "findings.md"
BEGIN, END = "<!-- power: begin (benchmarks/power.py) -->", "<!-- power: end -->"
MODEL = "smollm2-135m"
KMAX = 1999
KS = (128, 512, KMAX)
N_RANDOM = 2
SIZES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
LAYERS = (9, 18, 27)
SEEDS = (0, 1, 2)
SHAPE = (4, 128)
ALPHA = 0.05


def tail_p(x: float, draws: np.ndarray) -> float:
    """Two-sided p of x against a normal fitted to the draws: the prediction t with K - 1 df."""
    from scipy.stats import t as student

    K = draws.size
    sd = draws.std(ddof=1) if K > 1 else 0.0
    if not (math.isfinite(x) and sd > 0):
        return float("nan")
    z = (x - draws.mean()) / (sd * math.sqrt(1 + 1 / K))
    return float(min(1.0, 2 * student.sf(abs(z), K - 1)))


def _tokens(tok, seed: int):
    from importlib.resources import files

    import torch

    text = files("eigenhooks.data").joinpath("sample.txt").read_text()
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    n = SHAPE[0] * SHAPE[1]
    if (seed + 1) * n > ids.numel():
        raise SystemExit(f"seed {seed}: the bundled text has {ids.numel()} tokens, {n} a window")
    return ids[seed * n : (seed + 1) * n].reshape(SHAPE).clone(), torch


def _pass(model, batch, seed: int, randoms, layer=None, s=0.0) -> list[dict]:
    """One monitored forward (planted at ``layer`` with strength s, or none); its rows as dicts."""
    import torch

    import eigenhooks as eh
    from eigenhooks.models import get_adapter
    from eigenhooks.monitor import stats
    from eigenhooks.monitor.plan import seed as layer_seed
    from eigenhooks.steer.rank1 import value_stack

    targets = [("ov", "modulus"), ("ov", "residual")] + randoms
    kw = dict(targets=targets, null_draws=ARGS.kmax, fnull_draws=64, eig_top=16, null_seed=seed)
    nan = float("nan")
    edit, info = None, dict(alpha=nan, lambda_1=nan, lambda_1_after=nan)
    if layer is not None:
        spec = eh.spectra(model, rank="modulus")[layer]
        u = spec.basis[:, 0].double()
        lam = float(spec.lambda_1.real)
        vu = float((value_stack(get_adapter(model).factors(layer)) @ u).norm())
        alpha = s * lam / vu
        edit = eh.steer(model, u.float(), layer=layer, alpha=alpha, method="paper", mode="edit")
        info = dict(alpha=alpha, lambda_1=lam, lambda_1_after=float(edit.after.lambda_1.real))
        edit.__enter__()
    try:
        with eh.monitor(model, **kw) as mon, torch.no_grad():
            model(input_ids=batch)
        df = mon.summary()
        plan = mon._plan
        states = {i: mon._acc.current(i) for i in plan.layers}
    finally:
        if edit is not None:
            edit.__exit__(None, None, None)
    rows = []
    for r in df.to_dict("records"):
        L = r["layer"]
        lp = plan.layers[L]
        ti = [m.name for m in lp.meta].index(r["target"])
        ki = lp.bases.k_index[ti]
        st = states[L]
        ns = r["null_tokens"]
        rho_d = st["null_up"][ki].numpy() / ns
        dg_d = st["null_mid"][ki].numpy() / ns - st["null_pre"][ki].numpy() / ns
        t = dict(zip(TGT_FIELDS, st["tgt"][ti].tolist()))
        rho_s = t["n_up_sub"] / ns
        dg_s = t["sum_mid_sub"] / ns - t["sum_pre_sub"] / t["n_pre_sub"]
        tie = layer_seed(_Cfg(seed), L, 1000)
        row = dict(
            seed=seed, planted=-1 if layer is None else layer, s=s, layer=L, target=r["target"], k=r["k"],
            rho=r["rho"], gamma_pre=r["gamma_pre"], gamma_mid=r["gamma_mid"], rho_sub=rho_s, dg_sub=dg_s,
            null_tokens=ns, lift_ci_lo=r["lift_ci_lo"], lift_ci_hi=r["lift_ci_hi"], eig_rank=r["eig_rank"],
            fnull_percentile=r["fnull_percentile"], p_null_run=r["p_null"],
            rho_mean128=rho_d[:128].mean(), rho_sd128=rho_d[:128].std(ddof=1),
            dg_mean128=dg_d[:128].mean(), dg_sd128=dg_d[:128].std(ddof=1),
        )  # fmt: skip
        for K in [k for k in KS if k < ARGS.kmax] + [ARGS.kmax]:
            row[f"p_rho_mc{K}"] = stats.mc_p_value(rho_s, rho_d[:K], tie)
            row[f"p_dg_mc{K}"] = stats.mc_p_value(dg_s, dg_d[:K], tie)
        row["p_rho_fit128"] = tail_p(rho_s, rho_d[:128])
        row["p_dg_fit128"] = tail_p(dg_s, dg_d[:128])
        row.update({k: (v if L == layer else nan) for k, v in info.items()})
        rows.append(row)
    return rows


class _Cfg:  # what plan.seed reads of a config
    def __init__(self, null_seed):
        self.null_seed = null_seed


def run(args) -> None:
    import pandas as pd
    import torch

    import eigenhooks as eh

    torch.set_num_threads(2)
    model, tok = eh.load_model(MODEL)
    raw = Path(args.raw)
    done = pd.read_csv(raw) if raw.exists() else None
    have = set() if done is None else set(zip(done.seed, done.planted, done.s))
    d = model.config.hidden_size
    for seed in args.seeds:
        batch, _ = _tokens(tok, seed)
        g = torch.Generator().manual_seed(10_000 + seed)
        randoms = []
        for j in range(N_RANDOM):
            v = torch.randn(d, generator=g, dtype=torch.float64)
            randoms.append((f"random{j}", v / v.norm()))
        todo = [(None, 0.0)] + [(L, s) for L in args.layers for s in args.sizes]
        for layer, s in todo:
            key = (seed, -1 if layer is None else layer, s)
            if key in have:
                continue
            t0 = time.time()
            rows = _pass(model, batch, seed, randoms, layer, s)
            out = pd.DataFrame(rows)
            out.to_csv(raw, mode="a", header=not raw.exists(), index=False, float_format="%.6g")
            have.add(key)
            print(f"seed {seed} planted {key[1]} s {s}: {time.time() - t0:.1f} s", flush=True)
            if args.budget and time.time() - START > args.budget:
                print("budget reached; run again to go on")
                return


LEVELS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
NUS = (None, 30, 15, 10, 8, 6)  # None: the normal prediction (t with K - 1 df)
CAL = HERE / "power_calibration.json"


def calibrate(args) -> None:
    """The fitted tails' calibration: Haar draws are exchangeable with a random target, so each of a run's
    KMAX draws is a random target, tested against a normal (or t_nu) fitted to 128 other draws (15 disjoint
    blocks of 128, each tested on the draws outside it). Share of p < level, per model, statistic and tail."""
    import json

    import torch
    from scipy.stats import t as student

    import eigenhooks as eh

    torch.set_num_threads(2)
    out = json.loads(CAL.read_text()) if CAL.exists() else {}
    for name in args.models:
        model, tok = eh.load_model(name)
        for seed in args.seeds:
            key = f"{name}/{seed}"
            if key in out:
                continue
            batch, _ = _tokens(tok, seed)
            with eh.monitor(model, null_draws=KMAX, fnull_draws=0, eig_top=0, null_seed=seed) as mon, torch.no_grad():
                model(input_ids=batch)
            df = mon.summary()
            hits = {}
            n_tests = 0
            for L in mon._plan.layers:
                st = mon._acc.current(L)
                ns = float(df[df.layer == L]["null_tokens"].iloc[0])
                nps = float(st["tgt"][0][list(TGT_FIELDS).index("n_pre_sub")])
                for ki in range(st["null_up"].shape[0]):
                    rho = st["null_up"][ki].numpy() / ns
                    dg = st["null_mid"][ki].numpy() / ns - st["null_pre"][ki].numpy() / nps
                    for stat, x in (("rho", rho), ("dg", dg)):
                        for b in range(0, KMAX - 128, 128):
                            fit, test = x[b : b + 128], np.concatenate([x[:b], x[b + 128 :]])
                            z = np.abs(test - fit.mean()) / (fit.std(ddof=1) * math.sqrt(1 + 1 / 128))
                            for nu in NUS:
                                p = 2 * student.sf(z, 127 if nu is None else nu)
                                h = hits.setdefault(f"{stat}/{nu or 'normal'}", np.zeros(len(LEVELS)))
                                h += [(p < a).sum() for a in LEVELS]
                            n_tests += test.size if stat == "rho" else 0
            out[key] = {"tests": n_tests, "levels": LEVELS, "hits": {k: v.tolist() for k, v in hits.items()}}
            CAL.write_text(json.dumps(out, indent=1))
            print(key, n_tests, {k: np.round(np.array(v) / n_tests / LEVELS, 2).tolist() for k, v in hits.items()})


NU_DG = 8  # the t tail of the Δγ null (calibrate)
STATS = (
    ("rho_mc128", "ρ, Monte-Carlo p, K = 128 (today)"),
    ("rho_mc512", "ρ, Monte-Carlo p, K = 512"),
    (f"rho_mc{KMAX}", f"ρ, Monte-Carlo p, K = {KMAX}"),
    ("rho_fit128", "ρ, normal tail fitted to 128 draws"),
    ("dg_mc128", "Δγ, Monte-Carlo p, K = 128"),
    (f"dg_mc{KMAX}", f"Δγ, Monte-Carlo p, K = {KMAX}"),
    ("dg_t128", f"Δγ, t_{NU_DG} tail fitted to 128 draws"),
)


def _bh(p: np.ndarray) -> np.ndarray:
    from eigenhooks.monitor.stats import bh

    return np.asarray(bh(p))


def _tail(x, mean, sd, nu, K=128):
    from scipy.stats import t as student

    z = np.abs(np.asarray(x) - mean) / (sd * math.sqrt(1 + 1 / K))
    return np.where(sd > 0, 2 * student.sf(z, nu), np.nan)


def _with_p(d):
    """The candidates' p-values and the sign of each statistic's departure, per row."""
    d = d.copy()
    d["p_dg_t128"] = _tail(d.dg_sub, d.dg_mean128, d.dg_sd128, NU_DG)
    d["up_rho"] = d.rho_sub > d.rho_mean128
    d["up_dg"] = d.dg_sub > d.dg_mean128
    return d


def _q(table, stat: str) -> np.ndarray:
    """BH q over a table's distinct (layer, subspace): rows with equal numbers are one subspace."""
    key = _key(table)
    first = ~key.duplicated()
    q = pd_series(_bh(table.loc[first, f"p_{stat}"].to_numpy()), key[first])
    return key.map(q).to_numpy()


def pd_series(values, index):
    import pandas as pd

    return pd.Series(values, index=index.to_numpy())


def analyse(d):
    """Per pass: detection at the planted layer per statistic, the true Δρ and Δγ; false positives."""
    import pandas as pd

    d = _with_p(d)
    default = d.target.isin(["ov/modulus", "ov/residual"])
    base = d[(d.planted == -1) & default].set_index(["seed", "layer", "target"])
    det, fp = [], []
    for (seed, planted, s), g in d.groupby(["seed", "planted", "s"]):
        tab = g[g.target.isin(["ov/modulus", "ov/residual"])].reset_index(drop=True)
        qs = {st: _q(tab, st) for st, _ in STATS}
        b_qs = None
        if planted >= 0:
            b = base.loc[seed].reset_index()
            b_qs = {st: _q(b, st) for st, _ in STATS}
            row = tab[(tab.layer == planted) & (tab.target == "ov/modulus")].iloc[0]
            b0 = base.loc[(seed, planted, "ov/modulus")]
            out = dict(seed=seed, planted=planted, s=s, d_rho=row.rho - b0.rho,
                       d_gamma=(row.gamma_mid - row.gamma_pre) - (b0.gamma_mid - b0.gamma_pre))  # fmt: skip
            i = tab.index[(tab.layer == planted) & (tab.target == "ov/modulus")][0]
            for st, _ in STATS:
                up = row.up_rho if st.startswith("rho") else row.up_dg
                out[st] = bool(qs[st][i] < ALPHA and up)
                before = (tab.layer < planted).to_numpy()
                out[f"{st}_before"] = int(((qs[st] < ALPHA) & before & ~(b_qs[st] < ALPHA)).sum())
            det.append(out)
        for rname in sorted(t for t in g.target.unique() if t.startswith("random")):
            tr = pd.concat([tab, g[g.target == rname]], ignore_index=True)
            is_r = (tr.target == rname).to_numpy()
            rec = dict(seed=seed, planted=planted, s=s, target=rname)
            for st, _ in STATS:
                q = _q(tr, st)
                rec[st] = int(((q < ALPHA) & is_r).sum())
                rec[f"{st}_calls"] = int((q < ALPHA).sum())
                rec[f"{st}_p05"] = int(((tr[f"p_{st}"] < 0.05) & is_r).sum())
            rec["rows"] = int(is_r.sum())
            fp.append(rec)
    return pd.DataFrame(det), pd.DataFrame(fp)


def write(args) -> None:
    import pandas as pd

    d = pd.read_csv(RAW)
    det, fp = analyse(d)
    n_pass = d.groupby(["seed", "planted", "s"]).ngroups
    lines = [BEGIN, "## Does the test see anything? Planted effects on SmolLM2", ""]
    lines += [_intro(d, det, n_pass), "", _verdict(det), "", _unedited(d)]
    by = det.groupby("s")
    heads = ["s", "passes", "Δρ median [range]", "Δγ median [range]"] + [st for st, _ in STATS]
    lines += ["", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for s, g in by:
        cells = [f"{s:g}", str(len(g)), _med(g.d_rho, 3), _med(g.d_gamma, 4)]
        cells += [f"{g[st].mean():.2f}" for st, _ in STATS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Columns: " + "; ".join(f"`{st}`: {txt}" for st, txt in STATS) + "."]
    for col, name, edges, nd in (("d_rho", "Δρ", RHO_BINS, 2), ("d_gamma", "Δγ", DG_BINS, 3)):
        lines += ["", f"Detection rate by the planted {name} (passes pooled over strengths, layers and windows):", ""]
        lines += _bins(det, col, edges, nd)
    lines += ["", _needed(det), "", _false(det, fp), "", _detectable(d, det), ""] + _calibration() + ["", END]
    text = "\n".join(lines)
    doc = DOC.read_text()
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    DOC.write_text(doc)
    print(text)


RHO_BINS = (-1.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0)
DG_BINS = (-1.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 1.0)


def _bins(det, col: str, edges, nd: int) -> list[str]:
    import pandas as pd

    cut = pd.cut(det[col], list(edges), right=False)
    heads = ["bin", "passes"] + [st for st, _ in STATS]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for b, g in det.groupby(cut, observed=True):
        lo = "<" if b.left == edges[0] else f"{b.left:.{nd}f}–"
        label = f"{lo}{b.right:.{nd}f}" if b.right != edges[-1] else f"≥ {b.left:.{nd}f}"
        out.append("| " + " | ".join([label, str(len(g))] + [f"{g[st].mean():.2f}" for st, _ in STATS]) + " |")
    return out


def from_bin(det, st: str, col: str, edges, power: float = 0.8):
    """The lower edge of the smallest bin of ``col`` from which every bin is detected in >= power of its passes."""
    import pandas as pd

    rates = det.groupby(pd.cut(det[col], list(edges), right=False), observed=True)[st].mean()
    ok = None
    for b, r in list(rates.items())[::-1]:
        if r < power:
            break
        ok = b.left
    return ok


def _verdict(det) -> str:
    today, rho_big, new = "rho_mc128", f"rho_mc{KMAX}", "dg_t128"
    f = lambda st, c, e: from_bin(det, st, c, e)  # noqa: E731
    say = lambda x, nd: "never on this grid" if x is None else f"from {x:.{nd}f}"  # noqa: E731
    return (
        "**What it says.** 80% power, read by the planted size (the tables below: the smallest bin from which "
        f"every bin is called in at least 80% of its passes). Today's test (ρ, Monte-Carlo p at K = 128): "
        f"Δρ {say(f(today, 'd_rho', RHO_BINS), 2)}: its floor 2/129 keeps a lone layer under BH whatever the "
        f"effect, and only a planted layer whose downstream layers move too could ever be called. ρ at "
        f"K = {KMAX}: Δρ {say(f(rho_big, 'd_rho', RHO_BINS), 2)}, Δγ {say(f(rho_big, 'd_gamma', DG_BINS), 3)}; "
        f"ρ's normal tail at K = 128: Δρ {say(f('rho_fit128', 'd_rho', RHO_BINS), 2)} (ρ is a share in [0, 1] "
        "whose random-subspace band spans most of it: the threshold a lone row needs sits near or above 1). "
        f"Δγ with its t_8 tail at K = 128: Δρ {say(f(new, 'd_rho', RHO_BINS), 2)}, Δγ "
        f"{say(f(new, 'd_gamma', DG_BINS), 3)}, random targets called within BH's rate (below). That is less than half the "
        "size ρ needs even at K = 1999, at the default K and at no cost to the forward (Δγ comes from sums the "
        "monitor keeps already), so since 2026-12 it is the verdict's test (docs/concepts.md, \"The verdict's "
        "test\"), ρ's p kept as `p_rho_mc` and `p_rho_tail`. The eig-rank comparison cannot be a test under BH: "
        "its p (rank among F's top 16 eigen-subspaces and the target) is at least 1/17 > 0.05. A null matched to "
        "the update's anisotropy is out: drawn from the updates' covariance, it needs that covariance before the "
        "draws (a pre-pass), and draws that depend on the data seen differ between forwards and processes, so "
        "their counts do not merge; the F-null (orth(F g), matched to F, one pass and mergeable) is another "
        "hypothesis (a random target is not exchangeable with its draws, so random targets cannot calibrate it), "
        "and a plant along v_1 tilts its draws toward v_1 too (its percentile is kept as `fnull_percentile`)."
    )


def _unedited(d) -> str:
    """What the verdict's test calls on the unedited model, window by window."""
    d = _with_p(d)
    out, tws, aws = [], [], []
    for seed, g in d[(d.planted == -1) & d.target.isin(["ov/modulus", "ov/residual"])].groupby("seed"):
        g = g.reset_index(drop=True)
        hit = g[_q(g, "dg_t128") < ALPHA]
        tw = sorted({int(x) for x in hit[hit.up_dg].layer})
        aw = sorted({int(x) for x in hit[~hit.up_dg].layer})
        old = int((_q(g, "rho_mc128") < ALPHA).sum())
        tws.append(set(tw))
        aws.append(set(aw))
        out.append(
            f"window {int(seed)}: toward at layers {tw or 'none'}, away at {aw or 'none'} (rows called by today's test: {old})"
        )
    return (
        "**On the unedited model** (the same passes, 512 tokens each, K = 128, BH over 32 hypotheses), the "
        "verdict's test calls: " + "; ".join(out) + f". In every window: toward at {sorted(set.intersection(*tws))}, "
        f"away at {sorted(set.intersection(*aws))}."
    )


def _med(x, nd: int) -> str:
    return f"{x.median():.{nd}f} [{x.min():.{nd}f}, {x.max():.{nd}f}]"


def needed(det, st: str, power: float = 0.8):
    """The smallest strength whose detection rate (over layers and seeds) is >= power, with its median sizes."""
    for s, g in det.groupby("s"):
        if g[st].mean() >= power and all(h[st].mean() >= power for t, h in det.groupby("s") if t >= s):
            return s, g.d_rho.median(), g.d_gamma.median()
    return None


def _needed(det) -> str:
    out = ["At 80% power (the smallest strength from which every larger one is detected in >= 80% of passes):", ""]
    for st, txt in STATS:
        n = needed(det, st)
        out.append(
            f"- {txt}: "
            + ("not reached on this grid" if n is None else f"s = {n[0]:g}, Δρ ≈ {n[1]:.3f}, Δγ ≈ {n[2]:.4f}")
        )
    return "\n".join(out)


def _false(det, fp) -> str:
    out = [
        "False positives. Random unit targets, each added to its pass's table (its 30 rows join BH's family; "
        "a random target is exchangeable with a Haar draw, so its rows are true nulls). BH bounds the false "
        "discovery *rate*: where a planted layer and its downstream layers give many true calls, it may call a "
        "random row too. So per statistic: tables of an unedited pass that call a random row; over all tables, "
        "the mean share of a table's calls that are random rows (0 where it calls nothing: a lower bound on the "
        "false discovery proportion, as the default targets' own calls cannot be scored); rows at p < 0.05; "
        "and calls at layers before the planted one that the unedited pass does not make:",
        "",
    ]
    un = fp[fp.planted == -1]
    for st, txt in STATS:
        fdp = np.where(fp[f"{st}_calls"] > 0, fp[st] / fp[f"{st}_calls"].clip(lower=1), 0.0)
        out.append(
            f"- {txt}: unedited {int((un[st] > 0).sum())} of {len(un)}; random share of calls "
            f"{fdp.mean():.3f} over {len(fp)} tables ({int(fp[st].sum())} of {int(fp.rows.sum())} random rows "
            f"called); p < 0.05: {fp[f'{st}_p05'].sum() / fp.rows.sum():.3f}; before the planted layer: "
            f"{int(det[f'{st}_before'].sum())} in {len(det)} passes"
        )
    return "\n".join(out)


def _detectable(d, det) -> str:
    """The summary's ``detectable_dgamma`` / ``detectable_rho`` of the planted row in its unedited pass, against
    what planting then did: are the planted effects at least that large detected?"""
    from eigenhooks.monitor import stats

    base = d[(d.planted == -1) & d.target.isin(["ov/modulus", "ov/residual"])]
    m = {seed: int((~(_key(g)).duplicated()).sum()) for seed, g in base.groupby("seed")}
    rows = []
    for r in det.to_dict("records"):
        b = base[(base.seed == r["seed"]) & (base.layer == r["planted"]) & (base.target == "ov/modulus")].iloc[0]
        mde_g = stats.detectable(b.dg_sub, b.dg_mean128, b.dg_sd128, 128, m[r["seed"]], stats.DGAMMA_TAIL_DF)
        se = (b.lift_ci_hi - b.lift_ci_lo) / (2 * stats.Z95)
        mde_r = stats.detectable(b.rho_sub, b.rho_mean128, b.rho_sd128, 128, m[r["seed"]], None, se)
        rows.append(
            (r["d_gamma"] >= mde_g, r["dg_t128"], r["d_rho"] >= mde_r and b.rho_sub + mde_r <= 1, r["rho_fit128"])
        )
    a = np.array(rows, dtype=float)
    over_g, over_r = a[:, 0] == 1, a[:, 2] == 1
    return (
        f"The summary's `detectable_dgamma` and `detectable_rho` (the smallest Δγ and Δρ a lone row would be "
        f"called at with 80% power, from the run's own sums), taken from each planted row's unedited pass "
        f"(m = {sorted(set(m.values()))} hypotheses): of the {int(over_g.sum())} planted passes whose true Δγ is "
        f"at least the row's `detectable_dgamma`, {a[over_g, 1].mean():.2f} are called by the verdict's test "
        f"(below it: {int((~over_g).sum())} passes, {a[~over_g, 1].mean():.2f} called). Of the "
        f"{int(over_r.sum())} whose Δρ is at least `detectable_rho`, {_rate(a[over_r, 3])} are called by rho's "
        f"fitted tail (below it: {int((~over_r).sum())}, {_rate(a[~over_r, 3])})."
    )


def _calibration() -> list[str]:
    """The fitted tails' calibration (``calibrate``): share of Haar draws at p < a, over a, per model."""
    import json

    if not CAL.exists():
        return ["(No calibration file: run `python benchmarks/power.py calibrate`.)"]
    cal = json.loads(CAL.read_text())
    tails = (("dg/8", "Δγ, t_8 (the verdict's)"), ("dg/normal", "Δγ, normal"), ("rho/normal", "ρ, normal"))
    out = [
        "Calibration of the fitted tails (`python benchmarks/power.py calibrate`, raw counts in "
        "`benchmarks/power_calibration.json`): one monitored pass of 4 x 128 tokens per text window, K = "
        f"{KMAX}; each Haar draw, exchangeable with a random target, is tested against the tail fitted to 128 "
        "other draws (15 disjoint blocks, each tested on the draws outside it). Share of p < a divided by a "
        "(1 = exact; below 1 conservative), pooled over windows, layers and k:",
        "",
        "| model | windows | (draw, fit) pairs | tail | " + " | ".join(f"a = {a:g}" for a in LEVELS) + " |",
        "|" + "---|" * (4 + len(LEVELS)),
    ]
    models = sorted({k.split("/")[0] for k in cal}, key=lambda m: (m == MODEL, m))
    for name in models:
        runs = [v for k, v in cal.items() if k.split("/")[0] == name]
        n = sum(v["tests"] for v in runs)
        for key, label in tails:
            hits = np.sum([v["hits"][key] for v in runs], axis=0)
            cells = [name, str(len(runs)), str(n), label] + [f"{h / n / a:.2f}" for h, a in zip(hits, LEVELS)]
            out.append("| " + " | ".join(cells) + " |")
    return out


def _rate(x) -> str:
    return f"{x.mean():.2f}" if x.size else "none"


def _key(table):
    return table[["layer", "k", "rho", "gamma_pre", "gamma_mid"]].round(12).astype(str).agg("|".join, axis=1)


def _intro(d, det, n_pass) -> str:
    seeds = [int(x) for x in sorted(d.seed.unique())]
    layers = [int(x) for x in sorted(det.planted.unique())] if len(det) else []
    return (
        f"`python benchmarks/power.py run` then `write` (raw rows: `benchmarks/power_results.csv`). {n_pass} "
        f"monitored passes of {SHAPE[0]} x {SHAPE[1]} tokens (text windows {seeds} of the bundled text, null seed "
        f"= window), K = {KMAX} Haar draws (smaller K: the first draws), planted one layer at a time at layers "
        f"{layers}: O' = O + alpha v_1 wᵀ, lambda_1' = (1 + s) lambda_1, target the unedited v_1. Detection: the "
        f"planted layer's ov/modulus row has q < 0.05 (BH over the pass's distinct (layer, subspace) hypotheses "
        f"of the default targets) in the planted direction. Δρ and Δγ (γ_mid - γ_pre) are the true changes on "
        f"all tokens against the unedited pass on the same window. Cost: 2.5-36 s of wall time a pass (about 20 "
        f"minutes in all) on this project's 2-core machine, shared with other work, one heavy job at a time."
    )


START = time.time()
ARGS = argparse.Namespace(kmax=KMAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    r.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    r.add_argument("--sizes", type=float, nargs="+", default=list(SIZES))
    r.add_argument("--kmax", type=int, default=KMAX, help="Haar draws of each pass (the study's: 1999)")
    r.add_argument("--raw", default=str(RAW), help="the CSV the passes are appended to")
    r.add_argument("--budget", type=float, default=540.0, help="stop starting passes after this many seconds")
    c = sub.add_parser("calibrate")
    c.add_argument("--models", nargs="+", default=["gpt2-tiny", "albert-tiny", MODEL])
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sub.add_parser("write")
    args = ap.parse_args()
    if args.cmd == "run":
        ARGS.kmax = args.kmax
        run(args)
    elif args.cmd == "calibrate":
        calibrate(args)
    else:
        write(args)


if __name__ == "__main__":
    main()

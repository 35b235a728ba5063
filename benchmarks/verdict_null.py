"""The verdict's null, checked before it entered the monitor: own hooks, own F = O V, own draws (issue 56).

Nothing here calls eigenhooks' monitor or spectra. The residual stream is read with plain forward pre-hooks on each
layer's two norms (pre: the input of the attention's norm; mid: the input of the MLP's norm), F is formed from the
weights by hand and decomposed with numpy, and every statistic is a few lines of numpy on the captured tokens.

The design under test (docs/concepts.md, "The verdict"):
- the unit is the sequence (a document); each is sent by a seeded hash to the estimation half E or the scoring half S;
- the null: K directions u = Σ_E^{1/2} g / ||.|| (g standard normal), Σ_E the uncentred covariance of the unit
  residual vectors at ``pre`` over E's tokens (k = 2: two such draws, orthonormalised);
- the statistic of a subspace U on S: Δγ = mean over S's tokens of ||Uᵀx̂_mid|| − ||Uᵀx̂_pre|| (the tilt), and
  γ_pre = mean of ||Uᵀx̂_pre|| (static alignment); the p-value is v_1's two-sided rank among the K draws;
- the interval: a cluster bootstrap over S's sequences of the target's Δγ.

What it prints, per layer: v_1's Δγ with its interval, the null band, p; the share of targets drawn by the null's
own rule from disjoint text (a third part, C) called at p < 0.05 and p < 0.01 with their one-sided 95% binomial
upper bounds (the acid test); the share of F's eigen-subspaces 2..16 and of Haar-random directions called; and with
``--replicate``, the calls on two disjoint halves of the corpus.

Run: python benchmarks/verdict_null.py [--model smollm2-135m] [--docs 600] [--tokens 64] [--replicate]
     [--control random|permuted]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import torch

from eigenhooks.run.corpus import describe, split, stdlib_docstrings
from eigenhooks.zoo import load_model


def layers_of(model):
    """(attention-norm, mlp-norm, attention module, kind) per layer, by hand for the two families used here."""
    if hasattr(model, "transformer"):  # GPT-2
        return [(b.ln_1, b.ln_2, b.attn, "gpt2") for b in model.transformer.h]
    return [(b.input_layernorm, b.post_attention_layernorm, b.self_attn, "llama") for b in model.model.layers]


def layer_F(attn, kind, cfg) -> np.ndarray:
    """F = sum_h O_h V_g(h) from the weights, float64."""
    if kind == "gpt2":
        d = cfg.n_embd
        W = attn.c_attn.weight.detach().double()  # (d, 3d), Conv1D (in, out)
        return (W[:, 2 * d :] @ attn.c_proj.weight.detach().double()).T.numpy()
    O = attn.o_proj.weight.detach().double()  # (d, H dh)
    V = attn.v_proj.weight.detach().double()  # (n_kv dh, d)
    H, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = O.shape[1] // H
    Og = O.reshape(O.shape[0], nkv, H // nkv, dh).sum(2).reshape(O.shape[0], nkv * dh)  # per-group sums of O_h
    return (Og @ V).numpy()


def principal(F: np.ndarray, top: int = 16) -> list[np.ndarray]:
    """Orthonormal bases (d, k) of F's top eigen-subspaces by |λ| (a conjugate pair: one plane), best first."""
    w, V = np.linalg.eig(F)
    order = np.argsort(-np.abs(w), kind="stable")
    out, used = [], set()
    for i in order:
        if i in used or len(out) >= top:
            continue
        used.add(i)
        v = V[:, i]
        if abs(w[i].imag) > 1e-12 * max(abs(w[i]), 1e-30):
            j = min((j for j in order if j not in used), key=lambda j: abs(w[j] - np.conj(w[i])))
            used.add(j)
            Q, _ = np.linalg.qr(np.stack([v.real, v.imag], 1))
        else:
            Q = (v.real / np.linalg.norm(v.real))[:, None]
        out.append(Q)
    return out


def capture(model, tok, docs, n_tokens: int, batch: int = 16):
    """Unit residual vectors at pre and mid of every layer for each document's first n_tokens tokens.

    Returns (pre, mid, seq): pre/mid lists per layer of (N, d) float32, seq (N,) the document index of each token."""
    layers = layers_of(model)
    L = len(layers)
    got: dict = {}

    def hook(i, point):
        def fn(module, args):
            got[(i, point)] = args[0].detach()

        return fn

    handles = []
    try:
        for i, (ln1, ln2, _, _) in enumerate(layers):
            handles.append(ln1.register_forward_pre_hook(hook(i, "pre")))
            handles.append(ln2.register_forward_pre_hook(hook(i, "mid")))
        pre = [[] for _ in range(L)]
        mid = [[] for _ in range(L)]
        seq = []
        tok.padding_side = "right"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        for s in range(0, len(docs), batch):
            texts = [d.text for d in docs[s : s + batch]]
            enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=n_tokens)
            with torch.no_grad():
                model(**enc)
            mask = enc["attention_mask"].bool()
            seq.append(np.repeat(np.arange(s, s + len(texts)), mask.sum(1).numpy()))
            for i in range(L):
                for point, into in (("pre", pre), ("mid", mid)):
                    x = got[(i, point)][mask].float()
                    into[i].append((x / x.norm(dim=-1, keepdim=True)).half().numpy())  # memory: upcast per layer
    finally:
        for h in handles:
            h.remove()
    return [np.concatenate(p) for p in pre], [np.concatenate(m) for m in mid], np.concatenate(seq)


def cov_draws(X: np.ndarray, seq: np.ndarray, K: int, k: int, rng) -> np.ndarray:
    """K orthonormal (d, k) frames, each column drawn from N(0, Σ_j), Σ_j the uncentred covariance of X's rows over
    a bootstrap resample of their sequences (one resample a draw): u = Xᵀ(√w ⊙ z), w each token's multiplicity."""
    _, s = np.unique(seq, return_inverse=True)
    S = s.max() + 1
    mult = np.stack([np.bincount(rng.integers(0, S, S), minlength=S) for _ in range(K)])  # (K, S)
    w = np.sqrt(mult[:, s]).T.astype(np.float32)  # (n, K)
    X32 = X.astype(np.float32)
    cols = []
    for _j in range(k):
        z = rng.standard_normal((len(X), K), dtype=np.float32) * w
        cols.append((X32.T @ z).T.astype(np.float64))  # (K, d)
    out = np.stack(cols, 2)  # (K, d, k)
    if k == 1:
        return out / np.linalg.norm(out, axis=1, keepdims=True)
    u1 = out[:, :, 0] / np.linalg.norm(out[:, :, 0], axis=1, keepdims=True)
    c2 = out[:, :, 1] - (u1 * out[:, :, 1]).sum(1, keepdims=True) * u1
    return np.stack([u1, c2 / np.linalg.norm(c2, axis=1, keepdims=True)], 2)


def haar_draws(d: int, K: int, k: int, rng) -> np.ndarray:
    return np.linalg.qr(rng.standard_normal((K, d, k)))[0]


def per_seq(U: np.ndarray, Xp, Xm, seq, n_seq):
    """Per-sequence sums of a(pre) and a(mid) for a stack of bases U (M, d, k): (M, n_seq) each, and counts."""
    M, d, k = U.shape
    onehot = np.zeros((len(seq), n_seq), np.float32)
    onehot[np.arange(len(seq)), seq] = 1.0  # (N, n_seq): sums per sequence as one matmul
    sp, sm = np.zeros((M, n_seq)), np.zeros((M, n_seq))
    X32 = [Xp.astype(np.float32), Xm.astype(np.float32)]
    for c in range(0, M, 1024):  # (N, chunk * k) at a time: memory bounded; float32 products, float64 sums
        Uc = U[c : c + 1024].transpose(1, 0, 2).reshape(d, -1).astype(np.float32)
        for X, into in zip(X32, (sp, sm)):
            P = X @ Uc
            a = np.abs(P) if k == 1 else np.sqrt((P.reshape(len(X), -1, k) ** 2).sum(-1))  # (N, chunk)
            into[c : c + 1024] = a.T @ onehot
    return sp, sm, onehot.sum(0).astype(float)


def rank_p(t: np.ndarray, null: np.ndarray, rng) -> np.ndarray:
    """Two-sided Monte-Carlo p of each t (T,) among the null's (K,) values, ties broken at random."""
    K = len(null)
    below = (null[None, :] < t[:, None]).sum(1)
    ties = (null[None, :] == t[:, None]).sum(1)
    r = below + 1 + np.floor(rng.random(len(t)) * (ties + 1))
    return np.minimum(1.0, 2 * np.minimum(r, K + 2 - r) / (K + 1))


def bh(p: np.ndarray) -> np.ndarray:
    p = np.asarray(p, float)
    m = len(p)
    o = np.argsort(p)
    q = np.minimum.accumulate((p[o] * m / np.arange(1, m + 1))[::-1])[::-1]
    out = np.empty(m)
    out[o] = np.minimum(q, 1)
    return out


def upper95(x: int, n: int) -> float:
    """One-sided 95% Clopper-Pearson upper bound of a share x/n."""
    from scipy.stats import beta

    return 1.0 if x >= n else float(beta.ppf(0.95, x + 1, n - x))


def seq_split(n_seq: int, seed: int, parts: int) -> np.ndarray:
    return np.array(
        [
            int.from_bytes(hashlib.sha256(f"split{seed}:{s}".encode()).digest()[:8], "little") % parts
            for s in range(n_seq)
        ]
    )


def study(pre, mid, seq, Fs, args, label: str, calibrate: bool):
    """Per layer: v_1's test under the covariance null on S (E estimates it), and the acid test on C."""
    rng = np.random.default_rng(args.seed)
    n_seq = int(seq.max()) + 1
    part = seq_split(n_seq, args.seed, 3 if calibrate else 2)
    E, S = part == 0, part == 1
    tokE, tokS = E[seq], S[seq]
    remap = -np.ones(n_seq, int)
    remap[S] = np.arange(S.sum())
    seqS = remap[seq[tokS]]
    nS = int(S.sum())
    rows = []
    for i, F in enumerate(Fs):
        bases = principal(F, 16)
        U1 = bases[0]
        k = U1.shape[1]
        Xp, Xm = pre[i].astype(np.float64), mid[i].astype(np.float64)
        draws = cov_draws(Xp[tokE], seq[tokE], args.K, k, rng)
        sp, sm, n = per_seq(np.concatenate([U1[None], draws]), Xp[tokS], Xm[tokS], seqS, nS)
        dg = (sm - sp).sum(1) / n.sum()  # (1 + K,) Δγ on S's tokens
        g0 = sp.sum(1) / n.sum()
        p_tilt = rank_p(dg[:1], dg[1:], rng)[0]
        p_static = rank_p(g0[:1], g0[1:], rng)[0]
        # the target's Δγ interval: a cluster bootstrap over S's sequences
        W = rng.multinomial(nS, np.full(nS, 1 / nS), size=args.boot).astype(float)  # (B, nS)
        boot = (W @ (sm[0] - sp[0])) / (W @ n)
        lo, hi = np.quantile(boot, [0.025, 0.975])
        row = dict(
            layer=i, k=k, dgamma=dg[0], lo=lo, hi=hi, null_lo=np.quantile(dg[1:], 0.025),
            null_hi=np.quantile(dg[1:], 0.975), null_med=np.median(dg[1:]), p=p_tilt, gamma_pre=g0[0], p_static=p_static,
        )  # fmt: skip
        # F's eigen-subspaces 2..16 and Haar directions, each tested as v_1 is (k of its own: draws of that k)
        others = bases[1:]
        null_of = {k: dg[1:]}
        for kk in {Q.shape[1] for Q in others} - {k}:
            a, b, _ = per_seq(cov_draws(Xp[tokE], seq[tokE], args.K, kk, rng), Xp[tokS], Xm[tokS], seqS, nS)
            null_of[kk] = (b - a).sum(1) / n.sum()
        d_eig, pe = [], []
        for Q in others:  # each of F's other subspaces tested as v_1 is, against the draws of its own k
            a, b, _ = per_seq(Q[None], Xp[tokS], Xm[tokS], seqS, nS)
            d_eig.append(((b - a).sum(1) / n.sum())[0])
            pe.append(rank_p(np.array(d_eig[-1:]), null_of[Q.shape[1]], rng)[0])
        row["eig_called"] = float(np.mean(np.array(pe) < 0.05))
        row["eig_pct"] = float(np.mean(dg[0] > np.array(d_eig)))  # v_1's percentile on Δγ among F's 2..16
        hz = haar_draws(F.shape[0], args.haar, k, rng)
        a, b, _ = per_seq(hz, Xp[tokS], Xm[tokS], seqS, nS)
        row["haar_called"] = float(np.mean(rank_p((b - a).sum(1) / n.sum(), dg[1:], rng) < 0.05))
        if calibrate:  # targets drawn by the null's own rule from disjoint text (C), against a large pool from E
            tokC = (part == 2)[seq]
            pool = cov_draws(Xp[tokE], seq[tokE], args.pool, k, rng)
            targ = cov_draws(Xp[tokC], seq[tokC], args.targets, k, rng)
            a, b, _ = per_seq(np.concatenate([targ, pool]), Xp[tokS], Xm[tokS], seqS, nS)
            d_ = (b - a).sum(1) / n.sum()
            g_ = a.sum(1) / n.sum()
            for name, v in (("tilt", d_), ("static", g_)):
                pt = rank_p(v[: args.targets], v[args.targets :], rng)
                for a_ in (0.05, 0.01):
                    x = int((pt < a_).sum())
                    row[f"cal_{name}_{a_}"] = x / args.targets
                    row[f"cal_{name}_{a_}_ub"] = upper95(x, args.targets)
        rows.append(row)
        print(
            f"[{label}] layer {i:2d} k={k} Δγ {dg[0]:+.4f} [{lo:+.4f}, {hi:+.4f}] null {row['null_lo']:+.4f}..{row['null_hi']:+.4f}"
            f" p {p_tilt:.4f} | γpre {g0[0]:.3f} p {p_static:.4f} | eig2-16 called {row['eig_called']:.2f}"
            f" v1 pct among them {row['eig_pct']:.2f} | haar called {row['haar_called']:.2f}"
            + (
                f" | cal tilt .05 {row['cal_tilt_0.05']:.4f} (ub {row['cal_tilt_0.05_ub']:.4f}) .01 {row['cal_tilt_0.01']:.4f}"
                f" (ub {row['cal_tilt_0.01_ub']:.4f}) static .05 {row['cal_static_0.05']:.4f} (ub {row['cal_static_0.05_ub']:.4f})"
                f" .01 {row['cal_static_0.01']:.4f} (ub {row['cal_static_0.01_ub']:.4f})"
                if calibrate
                else ""
            ),
            flush=True,
        )
    q = bh([r["p"] for r in rows])
    qs = bh([r["p_static"] for r in rows])
    for r, qi, qsi in zip(rows, q, qs):
        r["q"], r["q_static"] = qi, qsi
        r["call"] = ("toward" if r["dgamma"] > r["null_med"] else "away") if qi < 0.05 else "-"
    print(f"[{label}] tilt calls: " + ", ".join(f"{r['layer']}:{r['call']}" for r in rows if r["call"] != "-"))
    print(f"[{label}] static calls (q<.05): " + ", ".join(str(r["layer"]) for r in rows if r["q_static"] < 0.05))
    return rows


def control(model, how: str, seed: int):
    """The model's weights replaced: freshly initialised (``random``) or each layer's O columns permuted."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if how == "random":
            for p in model.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * model.config.initializer_range)
        else:
            for _, _, attn, kind in layers_of(model):
                W = attn.o_proj.weight if kind == "llama" else attn.c_proj.weight
                cols = W.shape[1] if kind == "llama" else W.shape[0]
                perm = torch.randperm(cols, generator=g)
                W.copy_(W[:, perm] if kind == "llama" else W[perm])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--K", type=int, default=999)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--haar", type=int, default=200)
    ap.add_argument("--pool", type=int, default=20000)
    ap.add_argument("--targets", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--replicate", action="store_true")
    ap.add_argument("--control", choices=["random", "permuted"])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.time()
    model, tok = load_model(args.model, dtype=torch.float32)
    if args.control:
        control(model, args.control, args.seed)
    docs = stdlib_docstrings()
    print(describe(docs))
    Fs = [layer_F(attn, kind, model.config) for _, _, attn, kind in layers_of(model)]
    halves = split(docs, seed=0)
    ds = halves[0][: args.docs // 2] + halves[1][: args.docs // 2]
    half = np.array([0] * len(halves[0][: args.docs // 2]) + [1] * len(halves[1][: args.docs // 2]))
    cache = f"/tmp/verdict_null_{args.model}_{args.control or 'trained'}_{len(ds)}_{args.tokens}.npz"
    try:
        z = np.load(cache)
        L = len(Fs)
        pre, mid, seq = [z[f"pre{i}"] for i in range(L)], [z[f"mid{i}"] for i in range(L)], z["seq"]
        print(f"[capture] read {cache}")
    except FileNotFoundError:
        pre, mid, seq = capture(model, tok, ds, args.tokens)
        np.savez(
            cache, seq=seq, **{f"pre{i}": p for i, p in enumerate(pre)}, **{f"mid{i}": m for i, m in enumerate(mid)}
        )
    print(f"{len(ds)} documents, {len(seq)} tokens, captured in {time.time() - t0:.0f} s", flush=True)
    if args.calibrate:
        study(pre, mid, seq, Fs, args, "all, calibration", True)
    if args.replicate:
        out = {}
        for j in (0, 1):
            keep = half[seq] == j
            _, s_ = np.unique(seq[keep], return_inverse=True)
            out[j] = study([p[keep] for p in pre], [m[keep] for m in mid], s_, Fs, args, f"half {j}", False)
        a, b = out[0], out[1]
        called = [r["layer"] for r in a if r["call"] != "-"]
        lift = lambda r: np.sign(r["dgamma"] - r["null_med"])  # noqa: E731
        same = [i for i in called if b[i]["call"] == a[i]["call"] or (b[i]["p"] < 0.05 and lift(b[i]) == lift(a[i]))]
        print(f"replication: {len(called)} rows called on half 0 ({called}); {len(same)} replicate on half 1 ({same})")
        excl = [r["layer"] for r in a if r["lo"] > 0 or r["hi"] < 0]
        agree = [i for i in excl if np.sign(a[i]["dgamma"]) == np.sign(b[i]["dgamma"])]
        print(f"  Δγ interval excludes 0 on half 0 at {len(excl)} layers; same sign on half 1 at {len(agree)}")
    if not (args.calibrate or args.replicate):
        study(pre, mid, seq, Fs, args, "all", False)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

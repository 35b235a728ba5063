"""The oracle: the fast monitor (reduce/'s stacked reduction) against the plain float64 reference.

Each case runs a tiny model once with the monitor and, at the same time, with hooks of our own
(``readings.Recorder``); the reference (``eigenhooks.monitor.reference``) re-derives the bases
from the spectra and the seeds and every state sum from the recorded readings. Compared:

(a) every field of every layer's state: counts exactly (they are sums of 0/1, or products of
    them: float32 and float64 hold them exactly), the rational cluster sums that divide by K to
    1e-12, and the sums of alignments, cosines and consensus to ``RTOL`` = 1e-5 relative plus
    ``ATOL_PER_TERM`` = 1e-6 per summed term. Why: the monitor computes alignments in float32, each
    off by about sqrt(d) * 2^-24 <= 1e-6 for d <= 128 (a(x) is in [0, 1]), and sums them in float32
    (relative error ~log2(N) * 2^-24); the reference is float64 throughout;
(b) every column of ``summary()``, with the reference's state loaded into a fresh monitor of the
    same settings: the columns made from counts alone (p_rho_mc, eig_rank, the percentiles, rho, the
    null quantiles ...) exactly, the means of alignments and what is made from them (Δγ, the verdict's
    p_null and q_null) to the same RTOL, and the verdict exactly.
    The two gamma percentiles rank float sums among the draws' sums: exact while no draw lies
    within rounding of the target's, as on these inputs.

Up-counts are exact because no delta on these inputs lies within float32 rounding of GROWTH_EPS. If a
change of the fast path's float order makes a count differ by one, look at that token's delta first.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import transformers as T
from harness import DECODER_BASE, assert_tiny  # the decoder cases' tiny GQA Llama

import eigenhooks as eh
from eigenhooks.dynamics.planted import planted_gpt2, planted_matrix
from eigenhooks.models import get_adapter
from eigenhooks.monitor import stats as M
from eigenhooks.monitor.config import POINTS
from eigenhooks.monitor.measures import TGT_FIELDS
from eigenhooks.monitor.measures.haar import haar_frames
from eigenhooks.monitor.reference import (
    LayerReading,
    PlainBases,
    Recorded,
    TargetBases,
    build_bases,
    reference_sample,
    reference_states,
    to_sample_dict,
    to_state_dict_layers,
)
from eigenhooks.monitor.verdict import SAMPLE_COLUMNS

from .readings import Recorder

RTOL = 1e-5
ATOL_PER_TERM = 1e-6
# verdict_tokens=24: fewer than most cases' null tokens, so the kept sample's bound is exercised
SETTINGS = dict(
    null_draws=16, fnull_draws=8, eig_top=4, null_stride=3, null_seed=7, verdict_tokens=24, verdict_draws=199
)
DEFAULT = [("ov", "modulus"), ("ov", "residual")]

COUNTS = {f for f in TGT_FIELDS if f.startswith("n") or f in ("clu_u2", "clu_un", "clu_n2", "clu_ns2")}
RATIONAL = {"clu_w2", "clu_wn"}  # made from u_s - (up-counts summed over draws) / K
# summary columns made from counts alone: equal counts give equal numbers
EXACT_COLUMNS = [
    "n_tokens", "n_nonfinite", "n_sequences", "rho", "rho_null_tokens", "null_tokens", "null_rho_mean",
    "null_rho_lo", "null_rho_hi", "rho_percentile", "p_rho_mc", "p_rho_tail", "null_rho_sd", "lift", "eig_rank",
    "eig_rho_median", "fnull_rho_mean", "fnull_percentile", "p_binom", "rho_norm_only", "rho_ci_lo", "rho_ci_hi",
    "design_effect", "gamma_pre_percentile", "gamma_mid_percentile", "dgamma_percentile", "null_draws", "k",
    "layer", "null_seed",
]  # fmt: skip
NEAR_EXACT_COLUMNS = ["lift_ci_lo", "lift_ci_hi", "detectable_rho"]  # from the rational cluster sums
TEXT_COLUMNS = ["target", "variant", "rank", "kind", "verdict", "verdict_static", "verdict_haar"]
# the verdict's columns (its kept tokens are compared to the twin's in ``compare_sample``): counts exactly, the
# rest (means of float32 alignments, and ranks among draws made from them) to RTOL
VERDICT_EXACT = ["verdict_sequences", "verdict_tokens", "verdict_draws"]
VERDICT_FLOAT = [c for c in SAMPLE_COLUMNS if c not in VERDICT_EXACT + TEXT_COLUMNS]
FLOAT_COLUMNS = [  # means of alignments, cosines and consensus (to RTOL), and the spectrum's numbers
    "gamma_pre", "gamma_mid", "gamma_post", "delta_mean", "null_gamma_pre_mean", "null_gamma_pre_lo",
    "null_gamma_pre_hi", "null_gamma_mid_mean", "cos_pre", "cos_mid", "cos_post", "consensus_pre",
    "consensus_mid", "consensus_post", "lambda_1_re", "lambda_1_im", "abs_lambda_1", "gap_ratio",
    # the verdict's test: Δγ of the target and of each draw are differences of alignment means
    "dgamma", "null_dgamma_mean", "null_dgamma_sd", "null_dgamma_lo", "null_dgamma_hi", "dgamma_lift", "p_null",
    "q_null", "detectable_dgamma",
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these matrices are tiny, so more threads only add hand-offs, which on a busy
    machine made the generate case an order of magnitude slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(model):
    assert_tiny(model)
    return model.eval()


def run(model, feed, targets=DEFAULT, settings=SETTINGS, points=POINTS):
    """Run ``feed(model)`` under the monitor and the recorder; (monitor, reference states, recorder)."""
    mon = eh.monitor(model, targets=targets, reading_points=points, **settings)
    with torch.no_grad(), mon, Recorder(model, points) as rec:
        feed(model)
    bases = build_bases(
        get_adapter(model),
        targets,
        settings["null_draws"],
        settings["fnull_draws"],
        settings["eig_top"],
        settings["null_seed"],
    )
    ref = Reference(reference_states(rec.forwards, bases, settings["null_stride"]))
    R = settings.get("verdict_tokens", eh.monitor.DEFAULTS.verdict_tokens)
    seed = settings.get("sample_seed", 0)
    ref.sample = reference_sample(rec.forwards, R, seed, settings["null_stride"]) if "mid" in points else None
    return mon, ref, rec


class Reference(dict):
    """The reference's states by layer, and its verdict sample (``reference_sample``) as ``.sample``."""

    sample = None


def compare_sample(fast: dict | None, ref, R: int) -> None:
    """(a'): the verdict's kept tokens: the same (key, sequence, position) of every layer, in key order, exactly;
    their unit readings to float32's rounding."""
    if ref.sample is None:
        assert fast is None, "the monitor kept a verdict sample without a mid reading"
        return
    from eigenhooks.monitor.verdict import Sample

    got = Sample.from_dict(fast, R)
    assert sorted(got.layers) == sorted(ref.sample), "the layers with kept tokens differ"
    for i, want in ref.sample.items():
        h = got.host(i)
        order = torch.argsort(h["keys"])
        for k in ("keys", "seq", "pos"):
            assert torch.equal(h[k][order], want[k]), f"layer {i}, {k}: {h[k][order].tolist()} vs {want[k].tolist()}"
        torch.testing.assert_close(h["X"][order].double(), want["X"], rtol=1e-5, atol=1e-6)


def compare_states(fast_layers: dict, ref: dict) -> None:
    """(a): every field of every layer."""
    assert sorted(fast_layers) == sorted(str(i) for i in ref), "the layers measured differ"
    for i, want in ref.items():
        got = {k: torch.tensor(v, dtype=torch.float64) for k, v in fast_layers[str(i)].items()}
        assert got.keys() == want.keys(), f"layer {i}: fields {sorted(got)} vs {sorted(want)}"
        for key, w in want.items():
            g = got[key]
            assert g.shape == w.shape, f"layer {i} {key}: shape {tuple(g.shape)} vs the reference's {tuple(w.shape)}"
            if key in ("null_up", "eig_up", "fnull_up"):
                assert torch.equal(g.nan_to_num(-1.0), w.nan_to_num(-1.0)), f"layer {i} {key}:\n{g}\nvs\n{w}"
            elif key in ("null_pre", "null_mid"):
                terms = want["tgt"][0, TGT_FIELDS.index("n_pre_sub")]
                torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL_PER_TERM * max(1.0, float(terms)))
        for j, name in enumerate(TGT_FIELDS):
            g, w = got["tgt"][:, j], want["tgt"][:, j]
            msg = f"layer {i}, field {name}: fast {g.tolist()} vs reference {w.tolist()}"
            if name in COUNTS:
                assert torch.equal(g, w), msg
            elif name in RATIONAL:
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-9, msg=msg)
            else:
                terms = float(want["tgt"][:, TGT_FIELDS.index("n")].max())
                torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL_PER_TERM * max(1.0, terms), msg=msg)


def compare_summaries(model, mon, ref, targets=DEFAULT, settings=SETTINGS, points=POINTS) -> pd.DataFrame:
    """(b): every column of summary(), the reference's state loaded into a fresh monitor."""
    fresh = eh.monitor(model, targets=targets, reading_points=points, **settings)
    state = {"fingerprint": mon.state_dict()["fingerprint"], "layers": to_state_dict_layers(ref)}
    if getattr(ref, "sample", None) is not None:
        state["sample"] = to_sample_dict(ref.sample, settings.get("verdict_tokens", eh.monitor.DEFAULTS.verdict_tokens))
    fresh.load_state_dict(state)
    got, want = mon.summary(), fresh.summary()
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    exact = EXACT_COLUMNS + (["head"] if "head" in got.columns else [])  # head targets' query head
    kinds = [exact + VERDICT_EXACT, NEAR_EXACT_COLUMNS, TEXT_COLUMNS, FLOAT_COLUMNS + VERDICT_FLOAT]
    assert set(got.columns) == set().union(*kinds), "a summary column this oracle does not classify (add it above)"
    for col in got.columns:
        g, w = got[col].to_numpy(), want[col].to_numpy()
        if col in TEXT_COLUMNS:
            assert list(g) == list(w), f"column {col}: {list(g)} vs {list(w)}"
            continue
        g, w = torch.tensor(g.astype(float)), torch.tensor(w.astype(float))
        if col in exact + VERDICT_EXACT:
            assert torch.equal(g.nan_to_num(-9.0), w.nan_to_num(-9.0)), f"column {col}: {g.tolist()} vs {w.tolist()}"
        elif col in NEAR_EXACT_COLUMNS:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, equal_nan=True, msg=f"column {col}")
        else:
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL_PER_TERM, equal_nan=True, msg=f"column {col}")
    return got


def check(model, mon, ref, targets=DEFAULT, settings=SETTINGS, points=POINTS) -> pd.DataFrame:
    state = mon.state_dict()
    compare_states(state["layers"], ref)
    if isinstance(ref, Reference):
        compare_sample(state.get("sample"), ref, settings.get("verdict_tokens", eh.monitor.DEFAULTS.verdict_tokens))
    return compare_summaries(model, mon, ref, targets, settings, points)


# ---- models ----


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    return tiny(model), tok


TEXTS = ["def f(x): return x + 1", "the quick brown fox jumps over the lazy dog again and again", "a b"]


def ids_batch(vocab: int, lengths: list[int], seed: int = 0, left: bool = False) -> dict:
    """Random token ids, padded (right by default) to the longest length, with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for r, ln in enumerate(lengths):
        mask[r, n - ln :] = 1 if left else 0
        mask[r, :ln] = 0 if left else 1
    return {"input_ids": ids, "attention_mask": mask}


def seeded(build):
    torch.manual_seed(0)
    return tiny(build())


def test_gpt2_right_padded_batch(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    assert tok.padding_side == "right" and not batch["attention_mask"].all()
    targets = [*DEFAULT, ("ov_ln", "modulus")]  # a second variant: its own spectra and F-null frames
    mon, ref, rec = run(model, lambda m: m(**batch), targets)
    assert len(rec.forwards) == 1
    df = check(model, mon, ref, targets)
    assert (df["n_tokens"] == int(batch["attention_mask"].sum())).all()


@pytest.mark.parametrize("points", [("pre", "mid"), ("pre",)], ids=["no-post", "pre-only"])
def test_reading_points(gpt2, points):
    """Fewer reading points: without mid there is no delta (no up-count, no cluster, no null up-count)."""
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    mon, ref, _ = run(model, lambda m: m(**batch), points=points)
    df = check(model, mon, ref, points=points)
    assert df["gamma_post"].isna().all() and df["rho"].isna().all() == ("mid" not in points)


def test_albert_shared_post_norm():
    model, _ = eh.zoo.load("albert-tiny")
    tiny(model)
    batch = ids_batch(model.config.vocab_size, [9, 14, 5])
    mon, ref, _ = run(model, lambda m: m(**batch))
    df = check(model, mon, ref)
    assert df["rho_norm_only"].notna().all()  # post-norm: the equal-normalisation baseline is in use


def test_bert_post_norm():
    cfg = T.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = seeded(lambda: T.BertModel(cfg))
    batch = ids_batch(64, [12, 7, 16], seed=1)
    mon, ref, _ = run(model, lambda m: m(**batch))
    check(model, mon, ref)


def test_llama_gqa():
    cfg = T.LlamaConfig(**{**DECODER_BASE, "max_position_embeddings": 64})
    model = seeded(lambda: T.LlamaForCausalLM(cfg))
    assert get_adapter(model).n_kv_heads < get_adapter(model).n_heads
    batch = ids_batch(64, [20, 11], seed=2)
    mon, ref, _ = run(model, lambda m: m(**batch))
    check(model, mon, ref)


def test_verdict_from_the_kept_tokens_equals_the_twins():
    """Enough sequences for a verdict in both halves (48 of 12 tokens, in three batches, one left-padded): the
    kept tokens (96 of ~192 candidates: the bound binds) and every verdict column equal the float64 twin's."""
    cfg = T.LlamaConfig(**{**DECODER_BASE, "max_position_embeddings": 64})
    model = seeded(lambda: T.LlamaForCausalLM(cfg))
    settings = {**SETTINGS, "verdict_tokens": 96}
    batches = [ids_batch(64, [12] * 16, seed=s, left=s == 1) for s in range(3)]

    def feed(m):
        for b in batches:
            m(**b)

    mon, ref, _ = run(model, feed, settings=settings)
    df = check(model, mon, ref, settings=settings)
    assert (df["verdict_sequences"] >= 10).all() and df["p_tilt"].notna().all(), df[["verdict_sequences", "p_tilt"]]
    assert df["verdict"].isin(["toward", "away", "indistinguishable"]).all()


@pytest.fixture(scope="module")
def planted():
    """GPT-2 (d = 16) with a complex top eigenvalue in layer 0 and a real one (a complex pair next) in layer 1."""
    complex_top = planted_matrix([1.5 * complex(math.cos(1.0), math.sin(1.0))], d=16, seed=1)
    real_top = planted_matrix([1.2, complex(0.6, 0.5)], d=16, seed=2)
    model = planted_gpt2(complex_top, uniform=False, layers=2)
    with torch.no_grad():
        model.h[1].attn.c_proj.weight.copy_(real_top.T)
    return tiny(model.float())


def test_complex_top_eigenvector_beside_a_real_one(planted):
    kinds = [s.kind for s in eh.spectra(planted)]
    assert kinds == ["complex-dominant", "real-dominant"]
    batch = ids_batch(64, [18, 10], seed=3)
    mon, ref, _ = run(planted, lambda m: m(**batch))
    df = check(planted, mon, ref)
    assert df.loc[df["target"] == "ov/modulus", "k"].tolist() == [2, 1]


@pytest.mark.parametrize("per_layer", [False, True], ids=["shared", "per-layer"])
def test_custom_targets(planted, per_layer):
    """A unit vector and a plane: shared by both layers (which then reduce as one padded group: layer 1's
    1-dimensional top subspace stacked beside layer 0's plane), or the plane on layer 1 only."""
    d = 16
    g = torch.Generator().manual_seed(5)
    u = torch.randn(d, generator=g)
    B = torch.linalg.qr(torch.randn(d, 2, generator=g)).Q
    targets = [("ov", "modulus"), ("probe", u / u.norm()), ("plane", {-1: B} if per_layer else B)]
    batch = ids_batch(64, [15, 9, 4], seed=4)
    mon, ref, _ = run(planted, lambda m: m(**batch), targets)
    df = check(planted, mon, ref, targets)
    assert df.loc[df["target"] == "plane", "layer"].tolist() == ([1] if per_layer else [0, 1])


HEAD_TARGETS = [("ov", "modulus"), ("ov_head", "modulus"), ("ov_head", "residual")]


def test_head_targets_gpt2(gpt2):
    """Head targets beside a layer target: each head's subspace (a plane beside a layer's line somewhere,
    so the null frames are widened) in the fast path and the reference alike."""
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    mon, ref, _ = run(model, lambda m: m(**batch), HEAD_TARGETS)
    df = check(model, mon, ref, HEAD_TARGETS)
    assert df["head"].notna().sum() == 2 * 4 * 4 and df.loc[df["head"].isna(), "target"].eq("ov/modulus").all()


def test_head_targets_llama_gqa():
    """Under GQA: query heads reading one key/value group each get their own subspace."""
    cfg = T.LlamaConfig(**{**DECODER_BASE, "max_position_embeddings": 64})
    model = seeded(lambda: T.LlamaForCausalLM(cfg))
    batch = ids_batch(64, [20, 11], seed=2)
    mon, ref, _ = run(model, lambda m: m(**batch), HEAD_TARGETS)
    df = check(model, mon, ref, HEAD_TARGETS)
    assert df["head"].notna().sum() == 2 * 2 * 4


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-mask"])
def test_generate_with_kv_cache_past_a_buffer_flush(gpt2, padded):
    """Without padding transformers passes no attention mask: the token indices then come from the
    monitor's own count of each open sequence's tokens, not from a mask over the cache."""
    model, tok = gpt2
    if padded:
        tok.padding_side = "left"
        try:
            batch = tok(TEXTS[:2], return_tensors="pt", padding=True)
        finally:
            tok.padding_side = "right"
        assert not batch["attention_mask"].all()
    else:
        batch = {"input_ids": ids_batch(model.config.vocab_size, [7, 7], seed=8)["input_ids"]}
    new = 140  # 2 sequences x 140 single-token steps: past the monitor's 256-token buffer
    prompt = int(batch["attention_mask"].sum()) if padded else batch["input_ids"].numel()

    def feed(m):
        m.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)

    mon, ref, rec = run(model, feed)
    assert 2 * (len(rec.forwards) - 1) > 256 and all(f.continues for f in rec.forwards[1:])
    df = check(model, mon, ref)
    assert (df["n_sequences"] == 2).all()  # each sequence one cluster across its forwards
    assert (df["n_tokens"] == prompt + 2 * (new - 1)).all()


def test_merged_states(gpt2):
    model, tok = gpt2
    a = tok(TEXTS, return_tensors="pt", padding=True)
    b = tok(["another batch of text", "and one more"], return_tensors="pt", padding=True)
    mon, ref_a, rec_a = run(model, lambda m: m(**a))
    other, _, rec_b = run(model, lambda m: m(**b))
    mon.merge_state_dict(other.state_dict())
    bases = build_bases(
        get_adapter(model), DEFAULT, *(SETTINGS[k] for k in ("null_draws", "fnull_draws", "eig_top", "null_seed"))
    )
    ref = Reference(reference_states(rec_a.forwards + rec_b.forwards, bases, SETTINGS["null_stride"]))  # b: new
    ref.sample = reference_sample(
        rec_a.forwards + rec_b.forwards, SETTINGS["verdict_tokens"], 0, SETTINGS["null_stride"]
    )
    check(model, mon, ref)


def test_non_finite_tokens(gpt2):
    """A token made inf before layer 1: it and every later token of its sequence (attention mixes it in)
    count as non-finite there, and its sequence leaves consensus."""
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)

    def poison(module, args, kwargs):
        if "hidden_states" in kwargs:
            x = kwargs["hidden_states"].clone()
            x[0, 3] = float("inf")
            return args, {**kwargs, "hidden_states": x}
        x = args[0].clone()
        x[0, 3] = float("inf")
        return (x, *args[1:]), kwargs

    handle = model.transformer.h[1].register_forward_pre_hook(poison, with_kwargs=True)
    try:
        mon, ref, _ = run(model, lambda m: m(**batch))
    finally:
        handle.remove()
    df = check(model, mon, ref)
    assert (df.loc[df["layer"] >= 1, "n_nonfinite"] > 0).all()


def test_near_ablated_attention():
    """Layer 1's attention output scaled by 1e-7: its delta is float32 rounding, under GROWTH_EPS, so no
    token grows there, in the fast path as in the float64 reference."""
    cfg = T.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    model = seeded(lambda: T.GPT2Model(cfg))
    with torch.no_grad():
        model.h[1].attn.c_proj.weight.mul_(1e-7)
        model.h[1].attn.c_proj.bias.mul_(1e-7)
    batch = ids_batch(64, [20, 13], seed=6)
    mon, ref, _ = run(model, lambda m: m(**batch))
    df = check(model, mon, ref)
    assert (df.loc[df["layer"] == 1, "rho"] == 0).all() and (df.loc[df["layer"] == 0, "rho"] > 0).all()


def test_reference_against_the_definitions():
    """The reference itself, on readings made up here, against the definitions written out the long way
    (a pairwise n x n cosine matrix, explicit loops over tokens): the oracle's oracle."""
    g = torch.Generator().manual_seed(9)
    d, K, s = 4, 3, 2
    U = torch.eye(d, dtype=torch.float64)[:, :1]
    haar = haar_frames(d, 1, K, seed=1)
    bases = {0: PlainBases([TargetBases("e1", U, [], None)], haar, ks=[1])}
    pre, mid = torch.randn(2, 5, d, generator=g), torch.randn(2, 5, d, generator=g)
    mask = torch.tensor([[True] * 5, [False, True, True, True, False]])
    index = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 1, 2, 3]])  # row 0 continues a sequence 3 tokens in
    st = reference_states([Recorded({0: LayerReading(pre, mid)}, mask, index)], bases, s)[0]
    t = dict(zip(TGT_FIELDS, st["tgt"][0].tolist()))
    a = lambda x, V: float(torch.linalg.vector_norm(x.double() @ V) / x.double().norm())  # noqa: E731
    cons = n_up = n_sub = 0.0
    null_pre, ns2 = torch.zeros(K, dtype=torch.float64), 0.0
    for r in range(2):
        X = pre[r][mask[r]].double()
        C = (X / X.norm(dim=1, keepdim=True)) @ (X / X.norm(dim=1, keepdim=True)).T
        n = X.shape[0]
        cons += float((C.sum() - C.diagonal().sum()) / (n * (n - 1)))
        seq_sub = 0
        for p in range(5):
            if not mask[r, p]:
                continue
            n_up += a(mid[r, p], U) - a(pre[r, p], U) > M.GROWTH_EPS
            if index[r, p] % s == 0:
                seq_sub += 1
                null_pre += torch.tensor([a(pre[r, p], haar[j]) for j in range(K)], dtype=torch.float64)
        n_sub += seq_sub
        ns2 += seq_sub**2
    assert t["n"] == int(mask.sum()) and t["n_seq"] == 2 and t["n_clu"] == 2
    assert t["n_up"] == n_up and t["n_sub"] == n_sub == 4 and t["clu_ns2"] == ns2
    torch.testing.assert_close(t["cons_sum_pre"], cons, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st["null_pre"][0], null_pre, rtol=1e-12, atol=1e-12)

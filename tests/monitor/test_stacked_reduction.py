"""The stacked reduction (reduce.reduce_many) equals each layer reduced alone, whatever is stacked."""

import copy

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import measures
from eigenhooks.monitor.reduce import LayerBases, pad_to_stack, project, reduce_many, reduce_one

from .summaries import assert_same_summary, padded_gpt2_summary


@pytest.fixture(scope="module")
def reducers():
    model, _ = eh.zoo.load("gpt2-tiny")
    mon = eh.monitor(model, targets=[("ov", "modulus"), ("ov", "residual")], null_stride=3)
    mon._prepare()
    return [lp.bases for _, lp in sorted(mon._plan.layers.items())]


def points(red, b, n, seed, bad=True):
    """Random readings (b, n, d) with a padded row start and, if bad, one non-finite token."""
    g = torch.Generator().manual_seed(seed)
    P = {p: torch.randn(b, n, red.d, generator=g) for p in ("pre", "mid", "post")}
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :3] = False
    if bad:
        P["mid"][1, 2, 5] = float("nan")
        P["pre"][-1, -1, 0] = float("inf")
    return P, mask


def same(a, b):
    sa, ra = a
    sb, rb = b
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k].nan_to_num(-7.0), sb[k].nan_to_num(-7.0)), k
        assert torch.equal(torch.isnan(sa[k]), torch.isnan(sb[k])), k
    assert torch.equal(ra, rb)


def test_stacked_equals_each_layer_alone(reducers):
    items = [(r, project(r, *points(r, 3, 20, seed=i))) for i, r in enumerate(reducers)]
    together = reduce_many(items)
    for (r, pr), res in zip(items, together):
        same(reduce_many([(r, pr)])[0], res)
    # and the layers really differ (a stacking bug that mixed them would not pass the above)
    assert not torch.equal(together[0][0]["null_up"], together[1][0]["null_up"])


def test_mixed_shapes_and_points_come_back_in_order(reducers):
    r0, r1 = reducers[0], reducers[1]
    a, ma = points(r0, 3, 20, seed=1)
    b, mb = points(r1, 2, 7, seed=2)
    c, mc = points(r1, 3, 20, seed=3, bad=False)
    c["post"] = None
    items = [(r0, project(r0, a, ma)), (r1, project(r1, b, mb)), (r1, project(r1, c, mc, consensus=False))]
    got = reduce_many(items)
    for item, res in zip(items, got):
        same(reduce_many([item])[0], res)
    assert got[1][1].shape[0] == 2 and got[0][1].shape[0] == 3


def test_padding_the_eigen_columns_changes_nothing(reducers):
    r = reducers[2]
    wide = copy.deepcopy(r)
    widths = [g.stop - g.start for g in r.g_slices]  # its group's layout, with 5 more eigen-columns
    wide.pad_group(widths, r.frame_width, r.eig_width + 5, r.group_ks)
    assert wide.Bn64.shape[1] == r.Bn64.shape[1] + 5
    P, mask = points(r, 3, 20, seed=4)
    same(reduce_one(r, P, mask), reduce_one(wide, P, mask))


def close(a, b):
    """Equal up-counts and rows; float32 sums equal to their rounding (a padded projection is a matmul
    of another shape, whose float32 products may round differently in the last bit: a sum of ~60
    alignments in [-1, 1] then moves by a few 1e-7, more relative to it where they cancel)."""
    (sa, ra), (sb, rb) = a, b
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        assert torch.equal(torch.isnan(sa[k]), torch.isnan(sb[k])), k
        torch.testing.assert_close(sa[k].nan_to_num(-7.0), sb[k].nan_to_num(-7.0), rtol=1e-6, atol=2e-6, msg=k)
    sums = [measures.ROW.index(f) for f in ("s_pre", "s_mid", "s_post")]  # a row's alignment sums: float32
    kept = [i for i in range(len(measures.ROW)) if i not in sums]  # its counters: exact
    assert torch.equal(ra[:, kept], rb[:, kept])
    torch.testing.assert_close(ra[:, sums], rb[:, sums], rtol=1e-6, atol=2e-6)
    counts = [measures.TGT_FIELDS.index(f) for f in ("n", "n_up", "n_sub", "n_up_sub", "n_seq", "n_nonfinite")]
    assert torch.equal(sa["tgt"][:, counts], sb["tgt"][:, counts])
    for k in ("null_up", "eig_up", "fnull_up"):
        assert torch.equal(sa[k].nan_to_num(-7.0), sb[k].nan_to_num(-7.0)), k


@pytest.mark.parametrize("widen_frames", [True, False], ids=["frames widened (CUDA)", "frames kept (CPU)"])
def test_layers_of_other_target_widths_stack_and_each_reads_its_own(reducers, widen_frames):
    """gpt2-tiny's layers have 1- and 2-dimensional targets (real and complex top eigenvectors): padded
    into one group (zero columns, the group's ks; on CUDA the frames too, to the widest k), the stacked
    reduction gives each layer what it gives alone, unpadded: its own k's nulls, F-null k, cosines and rows."""

    def unpadded(r):  # the monitor padded the fixture's reducers: their own frames are the first k_max columns
        k = r.k_max
        first = lambda f: {key: first(v) for key, v in f.items()} if isinstance(f, dict) else f[..., :k]  # noqa: E731
        return LayerBases(r.targets, {name: first(f) for name, f in r.frames.items()}, r.null_stride, r.eig_slots)

    alone = [unpadded(r) for r in reducers]
    assert {r.Bt64.shape[1] for r in alone} != {r.Bt64.shape[1] for r in reducers}  # really unpadded
    assert len({tuple(t.k for t in r.targets) for r in alone}) > 1  # the case this test is about
    rs = [copy.deepcopy(r) for r in alone]
    pad_to_stack(rs, widen_frames=widen_frames)
    groups = {id(r.arena): r.arena for r in rs}.values()
    assert all(len({r.layout for r in g.bases}) == 1 for g in groups)
    if widen_frames:
        assert len(groups) == 1
    else:  # one group per frame width, and a group that mixes target widths: the case padded here
        assert len(groups) == len({r.k_max for r in rs})
        assert any(len({tuple(t.k for t in r.targets) for r in g.bases}) > 1 for g in groups)
    data = [points(r, 3, 20, seed=20 + i) for i, r in enumerate(rs)]
    together = reduce_many([(r, project(r, *d)) for r, d in zip(rs, data)])
    for a, d, got in zip(alone, data, together):
        close(reduce_one(a, *d), got)
        assert got[0]["null_up"].shape[0] == len(a.ks)


def test_pad_to_stack_gives_one_layout_per_kind(reducers):
    rs = [copy.deepcopy(r) for r in reducers]
    pad_to_stack(rs)
    for arena in {id(r.arena): r.arena for r in rs}.values():
        assert len({r.layout for r in arena.bases}) == 1
        assert len({(r.kind, r.k_max) for r in arena.bases}) == 1  # on the CPU, one frame width per group


def test_non_finite_tokens_are_counted_and_left_out(reducers):
    r = reducers[0]
    P, mask = points(r, 3, 20, seed=5)
    st, rows = reduce_one(r, P, mask)
    tg = dict(zip(measures.TGT_FIELDS, st["tgt"][0].tolist()))
    assert tg["n_nonfinite"] == 2 and tg["n"] == mask.sum() - 2
    for k in ("null_pre", "null_mid", "null_up", "fnull_up"):
        assert torch.isfinite(st[k]).all(), k
    assert torch.isfinite(st["tgt"]).all()


def test_a_sequence_with_a_non_finite_token_is_left_out_of_consensus_at_every_point(reducers):
    """Row 1 has one valid token that is NaN at mid only: rows 0 and 2 make the consensus at
    pre, mid and post (mean pairwise cosine of valid tokens, computed here in float64)."""
    r = reducers[0]
    P, mask = points(r, 3, 20, seed=11, bad=False)
    P["mid"][1, 4, 7] = float("nan")
    st, _ = reduce_one(r, P, mask)
    tg = dict(zip(measures.TGT_FIELDS, st["tgt"][0].tolist()))
    assert tg["n_seq"] == 2
    for p in ("pre", "mid", "post"):
        want = 0.0
        for row in (0, 2):
            X = P[p][row][mask[row]].double()
            U = X / X.norm(dim=-1, keepdim=True)
            n = U.shape[0]
            want += float((U.sum(0).square().sum() - n) / (n * (n - 1)))
        assert abs(tg[f"cons_sum_{p}"] - want) < 1e-5, p


def test_a_layer_projected_twice_before_reducing_keeps_both(reducers):
    """The second projection into a taken arena row gets tensors of its own, not the row."""
    r = copy.deepcopy(reducers[0])
    alone = copy.deepcopy(r)
    alone.arena = None
    a, b = points(r, 3, 20, seed=6), points(r, 3, 20, seed=7)
    pa, pb = project(r, *a), project(r, *b)
    assert pa.slot is not None and pb.slot is None
    got = reduce_many([(r, pa), (r, pb)])
    same(got[0], reduce_one(alone, *a))
    same(got[1], reduce_one(alone, *b))
    assert not r.arena.taken  # reduce_many gave the row back


def test_arena_keeps_only_the_latest_shapes(reducers):
    """Forwards of changing shapes do not pile up buffers: memory follows the latest forward."""
    rs = [copy.deepcopy(r) for r in reducers]
    pad_to_stack(rs)
    for n in (20, 9, 31, 9):
        reduce_many([(r, project(r, *points(r, 2, n, seed=n))) for r in rs])
    for arena in {id(r.arena): r.arena for r in rs}.values():
        assert len(arena.bufs) == 1 and not arena.taken


def test_a_forward_that_raises_gives_its_rows_back():
    """Rows a forward took before it raised are free for the next one (else every later forward copies)."""
    model, _ = eh.zoo.load("gpt2-tiny")
    ids = torch.randint(5, 200, (2, 12))
    mon = eh.monitor(model)

    def boom(module, args):
        raise RuntimeError("boom")

    with mon, torch.no_grad():
        h = model.transformer.h[-1].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError):
            model(input_ids=ids)
        h.remove()
        arenas = {id(i.bases.arena): i.bases.arena for i in mon._plan.layers.values()}.values()
        assert not any(a.taken for a in arenas)  # layers 0..L-2 had projected before the raise
        model(input_ids=ids)
        assert not any(a.taken for a in arenas)
    assert mon.n_forwards == 1


def test_closing_rows_of_many_layers_at_once_equals_each_alone():
    g = torch.Generator().manual_seed(8)
    F = len(measures.TGT_FIELDS)
    rows = torch.randint(0, 9, (3, 4, len(measures.ROW), 2), generator=g).double()
    rows[1, 2, measures.ROW.index("n")] = 0  # a row with no valid token: not a cluster
    tgt = torch.rand(3, 2, F, generator=g, dtype=torch.float64)
    together = measures.close_rows(tgt, rows)
    for i in range(3):
        assert torch.equal(together[i], measures.close_rows(tgt[i], rows[i]))
    assert not torch.equal(together, tgt)


def test_a_layer_with_fewer_eigen_subspaces_stacks_with_the_others(reducers):
    """A complex pair cut at the m-th eigenvalue leaves a layer m - 1 subspaces: with the monitor's m
    its last slot is NaN, and it is of the same kind as its neighbours (reduced with them)."""
    import dataclasses

    r = copy.deepcopy(reducers[0])
    short = [dataclasses.replace(t, eig=t.eig[:-1]) for t in r.targets]
    r2 = LayerBases(short, r.frames, r.null_stride, eig_slots=r.eig_slots)
    assert r2.kind == r.kind
    pad_to_stack([r, r2])
    P, mask = points(r, 3, 20, seed=9)
    got = reduce_many([(r, project(r, P, mask)), (r2, project(r2, P, mask))])
    alone = copy.deepcopy(r2)
    alone.arena = None
    same(got[1], reduce_one(alone, P, mask))
    eig = got[1][0]["eig_up"]
    assert torch.isnan(eig[:, -1]).all() and torch.isfinite(eig[:, :-1]).all()
    assert torch.equal(eig[:, :-1], got[0][0]["eig_up"][:, :-1])


def test_the_half_precision_split_path_gives_the_float32_statistics(monkeypatch):
    """On CUDA, half-precision activations are projected on [B_hi | B_lo] (bf16 halves of each float32
    basis, products accumulated in float32) and the halves are added in the stacked reduction. The CPU
    has no float32-output half matmul, so here the same layout runs through its float32 fallback: the
    split bases, the doubled buffers, the hi/lo consensus weights and the folding are all exercised,
    and the statistics must equal the plain float32 path's to the split's precision (~2^-16)."""
    from eigenhooks.monitor import reduce

    model, tok = eh.zoo.load("gpt2-tiny", dtype=torch.bfloat16)
    tok.pad_token = tok.eos_token
    texts = ["def f(x):\n    return x + 1", "class A:\n    pass", "import os"]
    batch = tok([t * 6 for t in texts], return_tensors="pt", padding=True)  # enough null tokens for a p_null

    def run(split: bool):
        monkeypatch.setitem(reduce.kernels._OUT_DTYPE, ("cpu", torch.bfloat16), split)
        with eh.monitor(model, null_stride=1) as mon, torch.no_grad():
            model(**batch)
        red = mon._plan.layers[0].bases
        assert any(B.dtype == (torch.bfloat16 if split else torch.float32) for B, _ in red._dev.values())
        return mon.summary()

    plain, split = run(False), run(True)
    for col in ("gamma_pre", "gamma_mid", "gamma_post", "consensus_pre", "consensus_mid"):
        assert (plain[col] - split[col]).abs().max() < 2e-5, col
    for col in ("n_tokens", "rho", "null_rho_lo", "null_rho_hi", "p_null", "eig_rank"):
        assert (plain[col] - split[col]).abs().max() <= 1.5 / plain["n_tokens"].min(), col  # a token may flip
    assert plain["p_null"].notna().all()


def test_the_cuda_layout_gives_the_cpu_layouts_summary(monkeypatch):
    """On CUDA the monitor widens the frames so that every layer stacks in one group; forced here on
    the CPU, a padded batch's summary is the default's: every count equal, float columns to rounding."""
    from eigenhooks.monitor import plan, reduce

    run = padded_gpt2_summary()
    plain, want = run()
    monkeypatch.setattr(plan, "pad_to_stack", lambda rs, widen_frames=False: reduce.pad_to_stack(rs, widen_frames=True))
    wide, got = run()
    groups = lambda m: len({id(i.bases.arena) for i in m._plan.layers.values()})  # noqa: E731
    assert groups(wide) == 1 < groups(plain)  # the two layouts really differ
    assert_same_summary(got, want, 1e-6)


def test_a_reading_shared_by_two_layers_is_reduced_once_and_only_for_its_own_tokens():
    """layer t's post is layer t+1's pre (one tensor): its norms and consensus sum come from the memo,
    but only for that very tensor (checked by a weak reference, not by its id alone) on the same grid."""
    from eigenhooks.monitor.reduce import Grid, Memo

    X, Y = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    g, other = Grid(torch.ones(2, 5, dtype=torch.bool)), Grid(torch.ones(2, 5, dtype=torch.bool))
    store: dict = {}
    value = torch.ones(3)
    Memo(store, g).put(X, "norms", value)
    assert Memo(store, g).get(X, "norms") is value
    assert Memo(store, other).get(X, "norms") is None  # other tokens counted
    assert Memo(store, g).get(Y, "norms") is None and Memo(store, g).get(X, "sv") is None
    assert Memo(None, g).get(X, "norms") is None
    ref = store[(id(X), "norms")][0]
    del X
    assert ref() is None  # the memo kept no activation alive: a new tensor with that id cannot hit

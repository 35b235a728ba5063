"""The verdict's kept tokens and its null, on synthetic data where the truth is known (docs/concepts.md, "The verdict").

- the kept set is the R smallest keys of everything seen, whatever the order and grouping the tokens came in,
  and an undone add leaves the sample as it was, bit for bit;
- the acid test: on an anisotropic stream whose tokens cluster by sequence, targets drawn by the null's own rule
  from disjoint sequences are called at about the nominal rate, while against an isotropic (Haar) null the same
  targets are called most of the time (the failure the covariance null exists to avoid).
"""

from __future__ import annotations

import torch

from eigenhooks.monitor.verdict import covariance, per_sequence, rank_p
from eigenhooks.monitor.verdict.sample import Candidates, Sample, token_keys


def _cands(keys, seq, pos, X: dict) -> Candidates:
    c = Candidates(torch.arange(len(keys)), keys, seq, pos)
    c.X = {i: (x[:, 0], x[:, 1]) for i, x in X.items()}  # (baseline, mid) readings, as ``take`` keeps them
    return c


def test_streamed_merges_keep_the_smallest_keys_and_undo_restores():
    g = torch.Generator().manual_seed(0)
    R, d, n = 16, 4, 90
    seq = torch.randint(0, 30, (n,), generator=g)
    pos = torch.arange(n)
    keys = token_keys(3, seq, pos)
    X = torch.randn(n, 2, d, generator=g)
    want = torch.sort(keys).values[:R]
    for order, size in ((torch.arange(n), 7), (torch.randperm(n, generator=g), 7), (torch.randperm(n, generator=g), 2)):
        s = Sample(R)
        for chunk in order.split(size):  # forwards of 7 (or 2: two wait before they merge) tokens, two layers each
            s.add([_cands(keys[chunk], seq[chunk], pos[chunk], {0: X[chunk], 5: X[chunk]})], undoable=False)
        for layer in (0, 5):
            h = s.host(layer)
            assert torch.equal(h["keys"], want)
            at = torch.searchsorted(torch.sort(keys).values, h["keys"])
            idx = torch.argsort(keys)[at]
            assert torch.equal(h["seq"], seq[idx]) and torch.equal(h["pos"], pos[idx])
            torch.testing.assert_close(h["X"], X[idx] / X[idx].norm(dim=-1, keepdim=True))
    before = s.host(0)
    u = s.add([_cands(torch.zeros(3, dtype=torch.float64), seq[:3], pos[:3], {0: X[:3], 5: X[:3]})], undoable=True)
    assert (s.host(0)["keys"] == 0).sum() == 3  # the smallest keys went in
    s.undo(u)
    for k, v in s.host(0).items():
        assert torch.equal(v, before[k]), k


def test_merging_two_samples_is_the_union_smallest():
    g = torch.Generator().manual_seed(1)
    R, d = 10, 3
    a, b = Sample(R), Sample(R)
    ka, kb = torch.rand(25, generator=g, dtype=torch.float64), torch.rand(25, generator=g, dtype=torch.float64)
    for s, k, off in ((a, ka, 0), (b, kb, 100)):
        s.add([_cands(k, torch.arange(25) + off, torch.zeros(25, dtype=torch.int64), {2: torch.randn(25, 2, d)})])
    a.merge(b)
    assert torch.equal(a.host(2)["keys"], torch.sort(torch.cat([ka, kb])).values[:R])


def _stream(n_seq: int, per: int, d: int, g: torch.Generator):
    """Unit readings of an anisotropic stream, tokens clustered by sequence; mid = pre plus unstructured noise."""
    scales = torch.logspace(0, -1.5, d, dtype=torch.float64)  # a few directions carry most of the variance
    means = torch.randn(n_seq, d, generator=g, dtype=torch.float64) * scales
    pre = means.repeat_interleave(per, 0) + 0.5 * torch.randn(n_seq * per, d, generator=g, dtype=torch.float64) * scales
    mid = pre + 0.3 * torch.randn(n_seq * per, d, generator=g, dtype=torch.float64) * scales
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    return unit(pre), unit(mid), torch.arange(n_seq).repeat_interleave(per)


def test_targets_drawn_from_disjoint_text_are_called_at_the_nominal_rate():
    g = torch.Generator().manual_seed(0)
    d, per, K, trials, targets = 24, 8, 199, 40, 25
    called = haar_called = total = 0
    for t in range(trials):
        gen = torch.Generator().manual_seed(100 + t)
        Xe, _, se = _stream(20, per, d, g)  # the estimation half
        Xs, Ms, ss = _stream(20, per, d, g)  # the scoring half
        Xc, _, sc = _stream(20, per, d, g)  # other text, where the targets come from
        null = covariance.draws(covariance.fit(Xe, se, 20), K, 1, gen)
        targ = covariance.draws(covariance.fit(Xc, sc, 20), targets, 1, gen)
        haar = torch.randn(K, d, 1, generator=gen, dtype=torch.float64)
        haar = haar / haar.norm(dim=1, keepdim=True)
        tilt = {}
        for name, U in (("null", null), ("targets", targ), ("haar", haar)):
            sp, sm = per_sequence(U, Xs, Ms, ss, 20)
            tilt[name] = sp.sum(1) / len(ss)  # static alignment: the question where anisotropy shows most
        called += int((rank_p(tilt["targets"], tilt["null"], 0.5) < 0.05).sum())
        haar_called += int((rank_p(tilt["targets"], tilt["haar"], 0.5) < 0.05).sum())
        total += targets
    rate, haar_rate = called / total, haar_called / total
    assert 0.02 <= rate <= 0.08, rate  # 1000 targets: the binomial 99.9% band around 0.05 is about 0.03-0.075
    assert haar_rate > 0.5, haar_rate  # an isotropic null calls directions the stream favours


def test_a_sample_filled_in_inference_mode_merges_outside_it():
    """A forward under ``torch.inference_mode`` fills the buffers; merging a loaded state afterwards (outside it)
    updates them in place: they must be normal tensors (an inference tensor refuses in-place updates there)."""
    g = torch.Generator().manual_seed(2)
    R, d = 8, 3
    ka, kb = torch.rand(12, generator=g, dtype=torch.float64), torch.rand(12, generator=g, dtype=torch.float64)
    a, b = Sample(R), Sample(R)
    with torch.inference_mode():
        for s, k, off in ((a, ka, 0), (b, kb, 100)):
            for chunk in torch.arange(12).split(3):  # a merge of waiting candidates inside, too
                x = torch.randn(len(chunk), 2, d, generator=g)
                s.add([_cands(k[chunk], chunk + off, torch.zeros(len(chunk), dtype=torch.int64), {4: x})])
    a.merge(b)
    assert torch.equal(a.host(4)["keys"], torch.sort(torch.cat([ka, kb])).values[:R])

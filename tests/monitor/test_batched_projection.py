"""A flush projects every layer's buffered steps at once (``reduce.batched.project_steps``, a block's layers by
``project_layers``): on the CPU bit for bit what ``project`` gives layer by layer (a parallel block's mid, pre + attn, summed once); with a point's matmuls as one bmm over the layers
(the CUDA path, forced here on the CPU) the same to float32 rounding, in fewer ops."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eigenhooks as eh
from eigenhooks.monitor import accumulate
from eigenhooks.monitor.reduce import Grid, batched, project


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _llama(n_layers: int = 6):
    """A seeded float32 Llama deep enough that layers share layouts (a bmm over several)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _model(tiny, family):
    return _llama() if family == "llama6" else tiny(family)


def _flushes(model, monkeypatch, **kw) -> list:
    """The (bases, steps) of every flush of a generate past the 256-token buffer (its steps as they came,
    unless ``lean_layout`` is patched)."""
    got = []
    project_steps = accumulate.project_steps

    def spy(steps, bases, stacks):
        got.append((bases, steps))
        return project_steps(steps, bases, stacks)

    ids = torch.randint(3, 60, (12, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    monkeypatch.setattr(accumulate, "project_steps", spy)
    with eh.monitor(model, **kw), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    monkeypatch.setattr(accumulate, "project_steps", project_steps)
    assert got, "no flush took the batched path"
    return got


def _flush_inputs(tiny, family, monkeypatch, **kw):
    """The (layers, X, grid) of a real flush of steps kept as they came (one grid, one order)."""
    bases, steps = _flushes(_model(tiny, family), monkeypatch, **kw)[0]
    order, grid = steps[0].order, Grid.cat([s.grids[0] for s in steps])
    assert all([s.order is order and len(s.grids) == 1 for s in steps]), "the steps were not kept as they came"
    used = sorted({j for sl in order for j in (sl.pre, *(sl.mid if isinstance(sl.mid, tuple) else (sl.mid,)), sl.post)
                   if j is not None})  # fmt: skip
    at = {j: k for k, j in enumerate(used)}
    X = torch.stack([torch.cat([s.xs[j] for s in steps], 1) for j in used])  # built apart from the code
    mids = [None if sl.mid is None else tuple(at[j] for j in sl.mid) if isinstance(sl.mid, tuple) else at[sl.mid]
            for sl in order]  # fmt: skip
    layers = [(bases[sl.layer], {"pre": at[sl.pre], "mid": m, "post": at.get(sl.post)}) for sl, m in zip(order, mids)]
    return layers, X, grid


def _point(X, k):
    """A slot's readings, or a parallel block's mid: the sum of its two slots, made here apart."""
    return None if k is None else torch.add(X[k[0]], X[k[1]]) if isinstance(k, tuple) else X[k]


def _per_layer(layers, X, grid):
    return [
        project(bases, {p: _point(X, k) for p, k in slots.items()}, grid, None, consensus=False)
        for bases, slots in layers
    ]


KW = [
    dict(targets=[("ov", "modulus"), ("ov", "residual")], null_draws=8, fnull_draws=4, eig_top=3, null_stride=3),
    dict(null_stride=1),  # every token in the null: no gather
    dict(targets=[("ov", "modulus")], null_draws=4),  # one target column a layer: the mm path even with bmm
]


@pytest.mark.parametrize("family", ["llama6", "llama", "gpt2", "gptj"])
@pytest.mark.parametrize("kw", KW, ids=["two-targets", "stride-1", "one-column"])
def test_the_cpu_path_is_project_layer_by_layer_bit_for_bit(tiny, family, kw, monkeypatch):
    layers, X, grid = _flush_inputs(tiny, family, monkeypatch, **kw)
    assert all([isinstance(sl["mid"], tuple) == (family == "gptj") for _, sl in layers])  # gptj: a parallel block
    got = batched.project_layers(layers, X, grid, batched.Stacks())
    want = _per_layer(layers, X, grid)
    for g, w in zip(got, want):
        assert g.names == w.names and g.shape == w.shape
        for f in ("norms", "Pt", "Pn"):
            assert torch.equal(getattr(g, f), getattr(w, f)), f


@pytest.mark.parametrize("family", ["llama6", "gpt2", "gptj"])
@pytest.mark.parametrize("kw", KW[:2], ids=["two-targets", "stride-1"])
def test_the_bmm_path_agrees_to_rounding_in_a_few_matmuls(tiny, family, kw, monkeypatch):
    layers, X, grid = _flush_inputs(tiny, family, monkeypatch, **kw)
    want = _per_layer(layers, X, grid)
    monkeypatch.setattr(batched, "BMM_DEVICES", {"cpu"})
    stacks = batched.Stacks()
    with _Ops() as ops:
        got = batched.project_layers(layers, X, grid, stacks)
    layouts = len({b.layout for b, _ in layers})
    assert ops.n["mm"] == 0 and ops.n["bmm"] == 5 * layouts, ops.n  # a layout: 3 points, 2 null points
    if family == "llama6":
        assert layouts < len(layers), "no two layers share a layout: the bmm over layers is not tested"
    for g, w in zip(got, want):
        for f in ("norms", "Pt", "Pn"):
            torch.testing.assert_close(getattr(g, f), getattr(w, f), rtol=1e-5, atol=1e-5, msg=f)
    # the layers' own bases are now views of the stacks: held once, the same values
    for bases, _ in layers:
        Bt, Bn = bases.on(X.device, X.dtype)
        assert any([Bt.data_ptr() == s[0].data_ptr() + s[0][0].numel() * 4 * k for s in stacks._made.values()
                    for k in range(len(s[2]))])  # fmt: skip


def test_flushes_sum_alike_on_both_paths(tiny, monkeypatch):
    """The state after a generate: the bmm path's equals the CPU path's to float32 rounding, counts exact."""
    model = _llama()
    ids = torch.randint(3, 60, (12, 6), generator=torch.Generator().manual_seed(3))

    def state():
        with eh.monitor(model, null_draws=8, fnull_draws=4) as mon, torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=25, min_new_tokens=25, do_sample=False, pad_token_id=0)
        return mon.summary()

    cpu = state()
    monkeypatch.setattr(batched, "BMM_DEVICES", {"cpu"})
    both = state()
    assert cpu["n_tokens"].tolist() == both["n_tokens"].tolist()
    for col in ("rho", "gamma_pre", "gamma_mid", "delta_mean", "null_rho_mean", "cos_mid"):
        torch.testing.assert_close(torch.tensor(both[col].to_numpy(float)), torch.tensor(cpu[col].to_numpy(float)),
                                   rtol=1e-4, atol=1e-6, equal_nan=True, msg=col)  # fmt: skip


def _layer_by_layer(bases: dict, steps: list) -> dict:
    """Each layer's ``project`` of its steps' readings concatenated, made here apart: a parallel block's mid
    summed a step, post-norm's base passed as base, a layer missing in a step left out of its steps."""
    out = {}
    for i in dict.fromkeys([sl.layer for s in steps for sl in s.order]):
        have = [(s, sl) for s in steps for sl in s.order if sl.layer == i]

        def cat(p):
            if any([getattr(sl, p) is None for _, sl in have]):
                return None
            get = lambda s, j: torch.add(s.xs[j[0]], s.xs[j[1]]) if isinstance(j, tuple) else s.xs[j]  # noqa: E731
            return torch.cat([get(s, getattr(sl, p)) for s, sl in have], 1)

        grid = Grid.cat([s.grids[sl.grid] for s, sl in have])
        points = {"pre": cat("pre"), "mid": cat("mid"), "post": cat("post")}
        out[i] = project(bases[i], points, grid, cat("base"), consensus=False)
    return out


def _same(got: list, want: dict) -> None:
    assert [i for i, _ in got] == list(want)
    for i, g in got:
        w = want[i]
        assert g.names == w.names and g.shape == w.shape, (i, g.names, w.names)
        for f in ("norms", "Pt", "Pn"):
            assert torch.equal(getattr(g, f), getattr(w, f)), (i, f)


@pytest.mark.parametrize("family,lean", [("llama", True), ("gptj", True), ("llama", False), ("gptj", False),
                                         ("opt_postnorm", False)])  # fmt: skip
def test_project_steps_is_project_layer_by_layer_bit_for_bit(tiny, family, lean, monkeypatch):
    """Steps kept as they came or layer by layer (a post-norm layer's base among its readings): every layer's
    projections are ``project``'s of its readings concatenated, bit for bit, each flush."""
    from eigenhooks.monitor import record

    if not lean:
        monkeypatch.setattr(record, "lean_layout", lambda *a: False)
    flushes = _flushes(tiny(family), monkeypatch, **KW[0])
    assert len(flushes) >= 2
    for bases, steps in flushes:
        assert all([s.order is steps[0].order for s in steps]) == lean
        if family == "opt_postnorm":
            assert all([sl.base is not None for sl in steps[0].order])
        _same(batched.project_steps(steps, bases, batched.Stacks()), _layer_by_layer(bases, steps))


def test_a_layer_missing_in_some_steps_counts_the_steps_that_have_it(tiny, monkeypatch):
    """Steps whose layers differ (a layer not read in some): each layer projects the steps that have it."""
    from eigenhooks.monitor import record

    monkeypatch.setattr(record, "lean_layout", lambda *a: False)
    bases, steps = _flushes(tiny("llama"), monkeypatch, **KW[0])[0]
    steps = [s._replace(order=s.order[1:]) if k % 3 == 1 else s for k, s in enumerate(steps)]  # layer 0 gone
    got = batched.project_steps(steps, bases, batched.Stacks())
    want = _layer_by_layer(bases, steps)
    assert got[0][1].shape[1] == len(steps) - len(steps[1::3]) and got[1][1].shape[1] == len(steps)
    _same(got, want)

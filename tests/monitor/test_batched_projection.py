"""A flush projects every layer's buffered steps at once (``reduce.batched.project_layers``): on the CPU
bit for bit what ``project`` gives layer by layer (a parallel block's mid, pre + attn, summed once); with a point's matmuls as one bmm over the layers
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


def _flush_inputs(tiny, family, monkeypatch, **kw):
    """The (layers, X, grid) of a real flush: a generate past the 256-token buffer."""
    model = _model(tiny, family)
    got = []
    lean_items = accumulate.Accumulator._lean_items

    def spy(self, buffered):
        out = lean_items(self, buffered)
        if out is not None:
            got.append((self.plan, buffered))
        return out

    ids = torch.randint(3, 60, (12, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    monkeypatch.setattr(accumulate.Accumulator, "_lean_items", spy)
    with eh.monitor(model, **kw), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    assert got, "no flush took the batched path"
    plan, buffered = got[0]
    order, grid = buffered[0].order, Grid.cat([b.grid for b in buffered])
    used = sorted({j for _, pre, mid, post in order for j in (pre, mid and mid[1], post) if j is not None})
    at = {j: k for k, j in enumerate(used)}
    X = torch.stack([torch.cat([b.xs[j] for b in buffered], 1) for j in used])  # built apart from the code
    mids = [None if mid is None else (at[pre], at[mid[1]]) if mid[0] else at[mid[1]] for _, pre, mid, _ in order]
    layers = [
        (plan.layers[i].bases, {"pre": at[pre], "mid": m, "post": at.get(post)})
        for (i, pre, _, post), m in zip(order, mids)
    ]
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

"""The monitor: equal to a plain recomputation, padding-exact, generate-exact, hook-clean."""

import json

import pandas as pd
import pytest
import torch
from harness import build

import eigenhooks as eh
from eigenhooks.monitor.stats import alignment

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass", "for i in range(10): print(i)"]


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _manual(model, ad, batch, specs):
    """gamma_pre/mid/post and rho per layer, from output_hidden_states and captured attention outputs."""
    attn_out, mids = {}, {}
    hs = []
    for ly in ad.layers:
        # independent of the monitor's reading points: the attention output (pre-norm) or the
        # post-attention norm's output (post-norm), captured by our own hooks
        tap = ly.attn_out if ad.norm_position == "pre" else ly.norm
        hs.append(
            tap.register_forward_hook(
                lambda m, a, o, i=ly.index: attn_out.__setitem__(i, o[0] if isinstance(o, tuple) else o)
            )
        )
    try:
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True)
    finally:
        for h in hs:
            h.remove()
    mask = batch["attention_mask"].bool()
    res = {}
    for s in specs:
        i = s.layer
        pre = out.hidden_states[i]
        mid = pre + attn_out[i] if ad.norm_position == "pre" else attn_out[i]
        U = s.basis.float()
        a_pre, a_mid = alignment(pre, U)[mask], alignment(mid, U)[mask]
        # post-norm: compare at equal normalisation, a(LN_t(pre + attn)) vs a(LN_t(pre))
        ln = ad.layers[i].norm
        ref = (
            alignment(torch.nn.functional.layer_norm(pre, ln.normalized_shape, ln.weight, ln.bias, ln.eps), U)[mask]
            if ad.norm_position == "post"
            else a_pre
        )
        res[i] = (float(a_pre.mean()), float(a_mid.mean()), float(((a_mid - ref) > 1e-6).float().mean()))
        mids[i] = mid
    return res


def _check_against_manual(model, tok):
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    ad = eh.get_adapter(model)
    specs = eh.spectra(model)
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon:
        with torch.no_grad():
            model(**batch)
    df = mon.summary().set_index("layer")
    ref = _manual(model, ad, batch, specs)
    assert int(df["n_tokens"].iloc[0]) == int(batch["attention_mask"].sum())
    for i, (g_pre, g_mid, rho) in ref.items():
        assert abs(df.loc[i, "gamma_pre"] - g_pre) < 1e-6
        assert abs(df.loc[i, "gamma_mid"] - g_mid) < 1e-6
        assert abs(df.loc[i, "rho"] - rho) < 1e-6
    # post of layer i is pre of layer i+1
    for i in range(ad.n_layers - 1):
        assert abs(df.loc[i, "gamma_post"] - df.loc[i + 1, "gamma_pre"]) > -1  # defined
    return df


def test_monitor_equals_recomputation_gpt2(gpt2):
    model, tok = gpt2
    _check_against_manual(model, tok)


def test_monitor_equals_recomputation_bert():
    model = build("bert", dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(5, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0

    class Tok:
        def __call__(self, texts, **kw):
            return {"input_ids": ids, "attention_mask": mask}

    _check_against_manual(model, Tok())


def _stats(model, batch, **kw):
    with eh.monitor(model, **kw) as mon, torch.no_grad():
        model(**batch)
    return mon


def test_padding_left_and_right_equal_separate_runs(gpt2):
    model, tok = gpt2
    alone = None
    for t in TEXTS:
        mon = _stats(model, tok([t], return_tensors="pt"))
        st = mon.stats
        alone = st if alone is None else {k: {f: alone[k][f] + v[f] for f in v} for k, v in st.items()}
    for side in ("right", "left"):
        tok.padding_side = side
        batch = tok(TEXTS, return_tensors="pt", padding=True)
        if side == "left":
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
        mon = _stats(model, batch)
        for k, s in mon.stats.items():
            a = alone[k]
            assert s["n"] == a["n"] and s["n_up"] == a["n_up"], (side, k)
            for f in ("sum_pre", "sum_mid", "sum_post", "cons_sum_pre", "cons_sum_post"):
                assert abs(s[f] - a[f]) < 1e-4, (side, k, f)
    tok.padding_side = "right"


def test_generate_counts_each_position_once(gpt2):
    model, tok = gpt2
    batch = tok(["def f(x):"], return_tensors="pt")
    # nulls on every token: the default stride samples each forward's grid, and one forward
    # of the whole sequence has another grid than the prompt plus buffered single steps
    with eh.monitor(model, null_stride=1) as mon, torch.no_grad():
        seq = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # the last generated token is never fed back, so the forwards saw seq[:, :-1]
    full = seq[:, :-1]
    ref = _stats(model, {"input_ids": full, "attention_mask": torch.ones_like(full)}, null_stride=1)
    for k, s in mon.stats.items():
        r = ref.stats[k]
        assert s["n"] == r["n"] == full.shape[1] and s["n_up"] == r["n_up"]
        for f in ("sum_pre", "sum_mid", "sum_post"):
            assert abs(s[f] - r[f]) < 1e-4, (k, f)
        # one sequence, one cluster, although it spans six forwards
        assert s["n_clu"] == r["n_clu"] == 1 and s["clu_u2"] == r["clu_u2"]
    assert mon.n_forwards == 6
    a, b = mon.summary(), ref.summary()
    for col in ("rho", "null_rho_lo", "null_rho_hi", "p_null", "eig_rank", "fnull_percentile"):
        assert a[col].equals(b[col]), col


def test_hooks_removed_after_exception_and_user_hooks_survive(gpt2):
    model, tok = gpt2
    fired = []
    h = model.transformer.h[1].register_forward_hook(lambda m, a, o: fired.append(1))
    before = _hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with eh.monitor(model):
            model(**tok(["x = 1"], return_tensors="pt"))
            raise RuntimeError("boom")
    assert _hook_count(model) == before and fired == [1]
    with eh.monitor(model) as outer, eh.monitor(model, targets=[("ov", "residual")]) as inner:
        model(**tok(["x = 1"], return_tensors="pt"))
    assert fired == [1, 1] and _hook_count(model) == before
    a, b = outer.stats[(0, "ov/residual")], inner.stats[(0, "ov/residual")]
    # counts agree exactly; float32 sums agree to rounding (the two projections differ in width)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9) for k in a)
    assert all(a[k] == b[k] for k in a if k.startswith("n"))
    h.remove()


def test_failed_registration_removes_partial_hooks(gpt2, monkeypatch):
    model, _ = gpt2
    before = _hook_count(model)
    from eigenhooks.models.hooks import HookAttachment as Taps

    orig = Taps._hook
    calls = []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("registration failed")
        return orig(self, *a, **k)

    monkeypatch.setattr(Taps, "_hook", flaky)
    with pytest.raises(RuntimeError, match="registration failed"):
        with eh.monitor(model):
            pass
    assert _hook_count(model) == before


def test_stats_merge_and_state_dict(gpt2):
    model, tok = gpt2
    # nulls on every token: a padded batch of two has another token grid than each alone
    a = _stats(model, tok([TEXTS[0]], return_tensors="pt"), null_stride=1)
    b = _stats(model, tok([TEXTS[1]], return_tensors="pt"), null_stride=1)
    both = _stats(model, tok(TEXTS[:2], return_tensors="pt", padding=True), null_stride=1)
    merged = eh.Monitor(model, null_stride=1)
    merged.load_state_dict(a.state_dict())
    merged.merge_state_dict(b.state_dict())
    for k, s in both.stats.items():
        m = merged.stats[k]
        assert m["n"] == s["n"] and m["n_up"] == s["n_up"] and m["n_clu"] == s["n_clu"] == 2
        assert abs(m["sum_mid"] - s["sum_mid"]) < 1e-4
    pd.testing.assert_frame_equal(merged.summary(), both.summary(), check_exact=False, atol=1e-5, rtol=0)
    restored = eh.Monitor(model, null_stride=1)
    restored.load_state_dict(json.loads(json.dumps(a.state_dict())))
    pd.testing.assert_frame_equal(restored.summary(), a.summary())
    with pytest.raises(ValueError, match="layout"):
        eh.Monitor(model, null_stride=1, null_draws=7).load_state_dict(a.state_dict())


def test_sink_and_save(gpt2, tmp_path):
    model, tok = gpt2
    sink = tmp_path / "log.jsonl"
    with eh.monitor(model, sink=sink) as mon, torch.no_grad():
        for t in TEXTS:
            model(**tok([t], return_tensors="pt"))
    lines = [json.loads(x) for x in sink.read_text().splitlines()]
    assert len(lines) == 3
    n0 = sum(s["n"] for line in lines for s in line["stats"] if s["layer"] == 0 and s["target"] == "ov/modulus")
    assert n0 == mon.stats[(0, "ov/modulus")]["n"]
    for suffix in (".csv", ".json", ".parquet"):
        try:
            mon.save(tmp_path / f"s{suffix}")
        except ImportError:
            assert suffix == ".parquet"


def test_bad_inputs(gpt2):
    model, tok = gpt2
    ids = tok(["x = 1"], return_tensors="pt")["input_ids"]
    # all padding: nothing counted, summary is NaN not a crash
    mon = _stats(model, {"input_ids": ids, "attention_mask": torch.zeros_like(ids)})
    assert mon.stats[(0, "ov/modulus")]["n"] == 0
    assert mon.summary()["gamma_pre"].isna().all() and mon.summary()["rho"].isna().all()
    # non-finite activations: counted, never averaged in. Poison one token of layer 1's
    # output (its 'post'); later layers see NaN everywhere, since SDPA spreads it.
    last = torch.tensor([ids.shape[1] - 1])

    def poison(m, a, out):
        if isinstance(out, tuple):
            return (out[0].index_fill(1, last, float("nan")), *out[1:])
        return out.index_fill(1, last, float("nan"))

    h = model.transformer.h[1].register_forward_hook(poison)
    try:
        mon = _stats(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    finally:
        h.remove()
    s = mon.stats[(1, "ov/modulus")]
    assert s["n_nonfinite"] == 1 and s["n"] == ids.shape[1] - 1
    import math

    assert math.isfinite(mon.summary().set_index(["layer", "rank"]).loc[(1, "modulus"), "rho"])
    with pytest.raises(ValueError, match="reading_points"):
        eh.monitor(model, reading_points=("mid",))
    with pytest.raises(eh.UnsupportedModelError):
        eh.monitor(torch.nn.Linear(3, 3))


def test_albert_shared_layer_calls_are_counted():
    model, tok = eh.zoo.load("albert-tiny")
    mon = _stats(model, tok(TEXTS[:1], return_tensors="pt"), targets=[("ov", "modulus")])
    df = mon.summary()
    n = int(tok(TEXTS[:1], return_tensors="pt")["attention_mask"].sum())
    assert list(df["n_tokens"]) == [n] * 4
    assert abs(df.loc[0, "gamma_post"] - df.loc[1, "gamma_pre"]) < 1e-6  # layer 1 reads layer 0's output


lens = pytest.importorskip("transformer_lens", reason="TransformerLens not installed")


def test_hf_and_lens_give_the_same_statistics(gpt2):
    model, tok = gpt2
    bridge = lens.TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=tok, dtype=torch.float32)
    ids = tok(TEXTS[:1], return_tensors="pt")["input_ids"]
    hf = _stats(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with eh.monitor(bridge) as mon, torch.no_grad():
        bridge(ids)
    for k, s in hf.stats.items():
        t = mon.stats[k]
        assert s["n"] == t["n"] and s["n_up"] == t["n_up"]
        assert abs(s["sum_pre"] - t["sum_pre"]) < 1e-4 and abs(s["sum_mid"] - t["sum_mid"]) < 1e-4

    # run_with_hooks composition: an ablation of layer 2's attention changes layer 2's mid
    plain = eh.monitor(bridge, attach=False)
    bridge.run_with_hooks(ids, fwd_hooks=plain.fwd_hooks())
    ablated = eh.monitor(bridge, attach=False)
    zero = ("blocks.2.hook_attn_out", lambda act, hook: torch.zeros_like(act))
    bridge.run_with_hooks(ids, fwd_hooks=[zero, *ablated.fwd_hooks()])
    k2 = (2, "ov/modulus")
    p, a = plain.stats[k2], ablated.stats[k2]
    assert p["sum_pre"] == pytest.approx(a["sum_pre"], abs=1e-5)
    assert abs(p["sum_mid"] - a["sum_mid"]) > 1e-4
    assert a["sum_mid"] == pytest.approx(a["sum_pre"], abs=1e-4)  # mid == pre
    assert a["n_up"] == 0 and p["n_up"] > 0


def _frames_in_package(tb) -> list[str]:
    """The traceback's frames in eigenhooks' own source files, wherever the clone lives (a clone at
    /tmp/x/eigenhooks has 'eigenhooks' in every path, the model's frames included)."""
    import traceback
    from pathlib import Path

    package = Path(eh.__file__).resolve().parent
    return [
        f"{f.filename}:{f.lineno}"
        for f in traceback.extract_tb(tb)
        if Path(f.filename).resolve().is_relative_to(package)
    ]


def test_frames_in_package_reads_paths_not_names(tmp_path):
    """The check behind test_empty_batch_and_low_precision: a frame of the package counts, a frame of a
    file elsewhere whose path says 'eigenhooks' does not."""
    elsewhere = tmp_path / "eigenhooks" / "model.py"
    elsewhere.parent.mkdir()
    elsewhere.write_text("def boom():\n    raise RuntimeError('the model refuses')\n")
    code = compile(elsewhere.read_text(), str(elsewhere), "exec")
    space: dict = {}
    exec(code, space)
    with pytest.raises(RuntimeError) as info:
        space["boom"]()
    assert _frames_in_package(info.value.__traceback__) == []
    with pytest.raises(ValueError) as ours:
        eh.monitor(torch.nn.Linear(2, 2), targets="not a target list")
    assert _frames_in_package(ours.value.__traceback__) != []


def test_empty_batch_and_low_precision(gpt2):
    model, tok = gpt2
    ids = torch.zeros((0, 5), dtype=torch.long)
    try:
        with eh.monitor(model) as mon, torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception as e:  # the model itself may refuse an empty batch; never a crash in our hooks
        assert _frames_in_package(e.__traceback__) == []
    else:
        assert mon.stats[(0, "ov/modulus")]["n"] == 0
    # bf16 activations are upcast to float32 for the statistics
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    ref = _stats(model, batch).summary()
    low = _stats(model.to(torch.bfloat16), batch).summary()
    model.to(torch.float32)
    assert (ref["n_tokens"] == low["n_tokens"]).all()
    assert (ref["gamma_pre"] - low["gamma_pre"]).abs().max() < 0.02


def test_a_reduced_layer_does_not_hold_its_activations(gpt2):
    """Once a layer is reduced, the monitor keeps which points it saw, not the tensors: peak memory
    within a forward is a layer's readings, not every layer's."""
    model = gpt2[0]
    held = []

    def at_final_norm(module, args):
        held.append(
            {
                i: [p for p, v in cap.items() if v is not None]
                for i, cap in next(iter(mon._record._fwds.values())).captures.items()
            }
        )

    mon = eh.monitor(model)
    h = model.transformer.ln_f.register_forward_pre_hook(at_final_norm)
    try:
        with mon, torch.no_grad():
            model(input_ids=torch.randint(5, 200, (2, 9)))
    finally:
        h.remove()
    n = model.config.n_layer
    assert sorted(held[0]) == list(range(n))
    assert all(held[0][i] == [] for i in range(n - 1)), held[0]  # the last layer's post is the final norm's input
    assert mon.stats and all(v["n"] == 18 for v in mon.stats.values())

"""Forwards a careful user runs that once counted wrong: threads sharing one monitored model,
``generate`` without a KV cache, and ``generate`` with beams or several returned sequences."""

import threading
import warnings

import pytest
import torch

import eigenhooks as eh

TEXTS = ["def f(x):\n    return x + 1", "import os", "class A:\n    pass"]


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # really tiny
    tok.pad_token = tok.eos_token
    return model, tok


def _counts(mon):
    df = mon.summary()
    return df[["layer", "target", "n_tokens", "n_sequences", "null_tokens"]].reset_index(drop=True)


def test_threads_sharing_one_monitored_model_count_every_forward_exactly(gpt2):
    model, tok = gpt2
    batches = [tok([t], return_tensors="pt") for t in TEXTS]
    with eh.monitor(model) as alone, torch.no_grad():
        for _ in range(3):
            for b in batches:
                model(**b)
    start = threading.Barrier(3)
    errors = []

    def work(b):
        try:
            start.wait()
            for _ in range(3):
                with torch.no_grad():
                    model(**b)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)  # nothing may be blamed on skipped hooks
        with eh.monitor(model) as mon:
            threads = [threading.Thread(target=work, args=(b,)) for b in batches]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert not errors, errors
    assert mon.n_forwards == 9
    want, got = _counts(alone), _counts(mon)
    assert (want == got).all().all(), (want, got)
    a, b = alone.summary(), mon.summary()
    assert (a["rho"] - b["rho"]).abs().max() < 1e-6  # the same tokens, whatever the interleaving


def _generate(model, tok, texts, **kw):
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": tok.eos_token_id, **kw}
    with eh.monitor(model) as mon, torch.no_grad():
        model.generate(**batch, **kw)
    return mon


def test_generate_without_a_cache_counts_as_the_cached_run(gpt2):
    model, tok = gpt2
    cached = _generate(model, tok, TEXTS[:2])
    plain = _generate(model, tok, TEXTS[:2], use_cache=False)
    assert (_counts(cached) == _counts(plain)).all().all()
    assert int(cached.summary()["n_sequences"].iloc[0]) == 2
    a, b = cached.summary(), plain.summary()
    assert (a["gamma_pre"] - b["gamma_pre"]).abs().max() < 1e-4  # the same positions, recomputed


@pytest.mark.parametrize(
    "kw", [dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)], ids=["beams", "samples"]
)
def test_generate_with_copies_clusters_by_input_row_and_says_what_it_counted(gpt2, kw):
    model, tok = gpt2
    torch.manual_seed(0)
    texts = TEXTS[:2]
    prompt = int(tok(texts, return_tensors="pt", padding=True)["attention_mask"].sum())
    one = _generate(model, tok, texts)
    with pytest.warns(eh.MeasurementWarning, match=r"copies of each input row"):
        mon = _generate(model, tok, texts, **kw)
    r = kw.get("num_beams", kw.get("num_return_sequences"))
    df, ref = mon.summary(), one.summary()
    assert (df["n_sequences"] == 2).all()  # clusters are the input rows, not the copies
    # prompt positions once per input row; each copy's generated positions: r per step and row
    generated = int(ref["n_tokens"].iloc[0]) - prompt
    assert (df["n_tokens"] == prompt + r * generated).all(), (df["n_tokens"].tolist(), prompt, generated, r)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "gpt2", "gptj"])
def test_a_decoding_step_costs_two_hooks_a_layer_and_three(tiny, family):
    """Where mid has its own tap the attention is not tapped (a swap is found by walking the module
    paths, test_a_swapped_sublayer_warns_...); a parallel block (gptj) has no mid tap, its mid is pre +
    the attention's output, so there the attention keeps its tap."""
    model = tiny(family)
    ids = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    before, calls = _hooks(model), []
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=4) as mon, torch.no_grad():
        added = _hooks(model) - before
        for m in model.modules():  # count the monitor's hook calls in one decoding step
            for d in (m._forward_hooks, m._forward_pre_hooks):
                for k, f in list(d.items())[-1:] if d else []:
                    d[k] = lambda *a, _f=f, **kw: calls.append(1) or _f(*a, **kw)
        model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    L = model.config.num_hidden_layers
    assert added == 2 * L + 3, f"{added=} hooks on a {L}-layer {family}"
    assert len(calls) == 3 * added, "every hook fires once a forward"
    df = mon.summary()
    assert (df["n_tokens"] == 2 * 5 + 2 * 2).all() and df[["gamma_mid", "rho"]].notna().all().all()

"""A monitor's state merges only with a state that means the same thing: same weights, same
target vectors, same reading points and null settings. Anything else is refused with a message
that names the difference; a malformed or pre-fingerprint state too, never a raw KeyError."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import eigenhooks as eh

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass"]


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _run(model, tok, text=TEXTS[0], **kw):
    kw.setdefault("null_draws", 8)
    kw.setdefault("fnull_draws", 4)
    kw.setdefault("eig_top", 4)
    with eh.monitor(model, **kw) as mon, torch.no_grad():
        model(**tok([text], return_tensors="pt"))
    return mon


def _fresh(model, **kw):
    kw.setdefault("null_draws", 8)
    kw.setdefault("fnull_draws", 4)
    kw.setdefault("eig_top", 4)
    return eh.Monitor(model, **kw)


def _both_refuse(mon, state, match):
    before = mon.state_dict()["layers"]
    for op in (mon.load_state_dict, mon.merge_state_dict):
        with pytest.raises(ValueError, match=match):
            op(state)
    assert mon.state_dict()["layers"] == before  # a refused state changes nothing


def _unit(d, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g, dtype=torch.float64)
    return u / u.norm()


def test_a_matching_state_still_merges_and_round_trips_through_json(gpt2):
    model, tok = gpt2
    u = _unit(model.config.n_embd, 0)
    a = _run(model, tok, TEXTS[0], targets=[("ov", "modulus"), ("probe", u)])
    b = _run(model, tok, TEXTS[1], targets=[("ov", "modulus"), ("probe", u.clone())])
    merged = _fresh(model, targets=[("ov", "modulus"), ("probe", u)])
    merged.load_state_dict(json.loads(json.dumps(a.state_dict())))
    merged.merge_state_dict(b.state_dict())
    for key, s in merged.stats.items():
        assert s["n"] == a.stats[key]["n"] + b.stats[key]["n"]


def test_a_model_with_other_weights_is_refused_naming_the_layer(gpt2):
    model, tok = gpt2
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.transformer.h[2].attn.c_proj.weight.mul_(1.01)  # O of layer 2 only
    state = _run(other, tok).state_dict()
    _both_refuse(_fresh(model), state, r"layer 2, weights: [0-9a-f]{8} here vs [0-9a-f]{8} in the state")
    # ... and the other layers are not blamed
    with pytest.raises(ValueError) as e:
        _fresh(model).merge_state_dict(state)
    assert "layer 0" not in str(e.value) and "layer 1" not in str(e.value)


def test_a_model_in_another_dtype_is_refused_naming_the_dtype(gpt2):
    model, tok = gpt2
    state = _run(copy.deepcopy(model).double(), tok).state_dict()
    _both_refuse(_fresh(model), state, r"dtype: float32 here vs float64 in the state")


def test_another_architecture_is_refused_naming_layers_and_widths(gpt2, tiny):
    model, tok = gpt2
    small = tiny("gpt2", dtype=torch.float32)  # 2 layers of width 16
    ids = torch.tensor([[1, 2, 3, 4]])
    with eh.monitor(small, null_draws=8, fnull_draws=4, eig_top=4) as mon, torch.no_grad():
        small(input_ids=ids)
    _both_refuse(_fresh(model), mon.state_dict(), r"n_layers: 4 here vs 2 in the state")


def test_a_target_of_the_same_name_with_another_vector_is_refused(gpt2):
    model, tok = gpt2
    d = model.config.n_embd
    state = _run(model, tok, targets=[("probe", _unit(d, 1))]).state_dict()
    _both_refuse(
        _fresh(model, targets=[("probe", _unit(d, 2))]),
        state,
        r"layers 0, 1, 2, 3, target 'probe', vector: [0-9a-f]{8} here vs [0-9a-f]{8} in the state",
    )
    # per layer: only layer 3's vector differs, and the message says layer 3
    per = {i: _unit(d, 10 + i) for i in range(4)}
    state = _run(model, tok, targets=[("p", {**per, 3: _unit(d, 99)})]).state_dict()
    _both_refuse(_fresh(model, targets=[("p", per)]), state, r"layer 3, target 'p'")


def test_a_target_of_another_k_is_refused_naming_k(gpt2):
    model, tok = gpt2
    d = model.config.n_embd
    basis = torch.linalg.qr(torch.randn(d, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    state = _run(model, tok, targets=[("probe", basis)]).state_dict()
    _both_refuse(_fresh(model, targets=[("probe", basis[:, 0])]), state, r"target 'probe', k: 1 here vs 2 in the state")


def test_other_targets_or_order_are_refused(gpt2):
    model, tok = gpt2
    state = _run(model, tok, targets=[("ov", "modulus"), ("ov", "residual")]).state_dict()
    _both_refuse(_fresh(model, targets=[("ov", "residual"), ("ov", "modulus")]), state, r"targets")
    _both_refuse(_fresh(model, targets=[("ov", "modulus")]), state, r"targets")


def test_another_layer_set_is_refused(gpt2):
    model, tok = gpt2
    d = model.config.n_embd
    u = _unit(d, 3)
    state = _run(model, tok, targets=[("p", {0: u, 1: u})]).state_dict()
    _both_refuse(_fresh(model, targets=[("p", {0: u, 2: u})]), state, r"layers: \[0, 2\] .* vs \[0, 1\]")


def test_other_reading_points_are_refused(gpt2):
    model, tok = gpt2
    state = _run(model, tok, reading_points=("pre", "mid")).state_dict()
    _both_refuse(_fresh(model), state, r"reading_points: \['pre', 'mid', 'post'\] .* vs \['pre', 'mid'\]")


@pytest.mark.parametrize(
    "field, mine, theirs",
    [
        ("null_seed", 0, 1),
        ("null_draws", 8, 9),
        ("fnull_draws", 4, 0),
        ("eig_top", 4, 2),
        ("null_stride", 5, 1),
    ],
)
def test_every_null_setting_is_named(gpt2, field, mine, theirs):
    model, tok = gpt2
    state = _run(model, tok, **{field: theirs}).state_dict()
    _both_refuse(_fresh(model, **{field: mine}), state, rf"{field}: {mine} here vs {theirs} in the state")


def test_a_state_missing_a_layer_or_a_field_is_refused_not_a_key_error(gpt2):
    model, tok = gpt2
    good = _run(model, tok).state_dict()
    state = copy.deepcopy(good)
    del state["layers"]["1"]
    _both_refuse(_fresh(model), state, r"layer 1.*missing")
    state = copy.deepcopy(good)
    del state["layers"]["2"]["null_up"]
    _both_refuse(_fresh(model), state, r"layer 2.*'null_up'.*missing")
    state = copy.deepcopy(good)
    state["layers"]["7"] = state["layers"]["0"]
    _both_refuse(_fresh(model), state, r"layer 7.*not")
    state = copy.deepcopy(good)
    state.pop("layers")
    _both_refuse(_fresh(model), state, r"'layers'")
    for bad in (None, [], "state", 3):
        _both_refuse(_fresh(model), bad, r"state")


def test_a_state_of_a_wrong_shape_is_refused_naming_it(gpt2):
    model, tok = gpt2
    good = _run(model, tok).state_dict()
    state = copy.deepcopy(good)
    state["layers"]["0"]["null_up"] = [row[:-1] for row in state["layers"]["0"]["null_up"]]
    _both_refuse(_fresh(model), state, r"layer 0, 'null_up': shape \(\d+, 7\) .*expected \(\d+, 8\)")
    state = copy.deepcopy(good)
    state["layers"]["3"]["tgt"][0] = state["layers"]["3"]["tgt"][0][:5]  # ragged
    _both_refuse(_fresh(model), state, r"layer 3, 'tgt'")
    state = copy.deepcopy(good)
    state["layers"]["1"]["eig_up"] = "zeros"
    _both_refuse(_fresh(model), state, r"layer 1, 'eig_up'")


def test_a_state_saved_before_the_fingerprint_is_refused_saying_so(gpt2):
    model, tok = gpt2
    good = _run(model, tok).state_dict()
    old = {
        "layout": {
            "null_seed": 0,
            "null_draws": 8,
            "fnull_draws": 4,
            "eig_top": 4,
            "null_stride": 5,
            "targets": ["ov/modulus", "ov/residual"],
        },
        "layers": good["layers"],
    }
    _both_refuse(_fresh(model), old, r"predates")


def test_a_forged_fingerprint_with_another_format_is_refused(gpt2):
    model, tok = gpt2
    state = _run(model, tok).state_dict()
    state["fingerprint"]["format"] = 999
    _both_refuse(_fresh(model), state, r"format")


# ---- all_reduce across 2 gloo processes ----


CASES = ("same", "seed", "target", "weights")


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: every case in turn in one process group (a refusal leaves the group usable)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        base, tok = eh.zoo.load("gpt2-tiny")
        d = base.config.n_embd
        for case in CASES:
            model, kw, targets = copy.deepcopy(base), {}, [("ov", "modulus")]
            if case == "seed" and rank == 1:
                kw["null_seed"] = 1
            if case == "target":
                targets = [("probe", _unit(d, rank))]  # same name, another vector on each rank
            if case == "weights" and rank == 1:
                with torch.no_grad():
                    model.transformer.h[1].attn.c_attn.weight.mul_(1.01)
            mon = _run(model, tok, TEXTS[rank], targets=targets, **kw)
            try:
                mon.all_reduce()
                results[case] = {"ok": True, "stats": {f"{k[0]}/{k[1]}": v["n"] for k, v in mon.stats.items()}}
            except ValueError as e:
                results[case] = {"ok": False, "error": str(e)}
        with open(os.path.join(out, f"{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.barrier()  # both ranks done before either tears gloo down (a rank aborted at exit in CI)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> list[dict]:
    """all_reduce over 2 gloo processes on CPU, every case: each rank's {case: result}."""
    import socket

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    "case, match",
    [
        ("seed", r"rank 1 .*null_seed: 0 on rank 0 vs 1 on rank 1"),
        (
            "target",
            r"rank 1 .*layers 0, 1, 2, 3, target 'probe', vector: [0-9a-f]{8} on rank 0 vs [0-9a-f]{8} on rank 1",
        ),
        ("weights", r"rank 1 .*layer 1, weights: [0-9a-f]{8} on rank 0 vs [0-9a-f]{8} on rank 1"),
    ],
)
def test_all_reduce_refuses_on_every_rank_with_the_same_message(reduced, case, match):
    import re

    res = [r[case] for r in reduced]
    assert not res[0]["ok"] and not res[1]["ok"], res
    assert res[0]["error"] == res[1]["error"]
    assert re.search(match, res[0]["error"]), res[0]["error"]


def test_all_reduce_of_matching_ranks_sums(reduced, gpt2):
    model, tok = gpt2
    res = [r["same"] for r in reduced]
    assert res[0]["ok"] and res[1]["ok"], res
    alone = [_run(model, tok, t, targets=[("ov", "modulus")]).stats for t in TEXTS]
    for key in alone[0]:
        name = f"{key[0]}/{key[1]}"
        assert res[0]["stats"][name] == res[1]["stats"][name] == alone[0][key]["n"] + alone[1][key]["n"]


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_an_offloaded_copy_of_the_model_has_the_same_fingerprint(family, tiny):
    """The weights are hashed as stored, brought in layer by layer: offloading changes nothing."""
    accelerate = pytest.importorskip("accelerate")
    plain = tiny(family, dtype=torch.float32)
    off = tiny(family, dtype=torch.float32)
    accelerate.cpu_offload(off, execution_device="cpu")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with eh.monitor(off, null_draws=8, fnull_draws=4, eig_top=4) as mon, torch.no_grad():
        off(input_ids=ids)
    merged = _fresh(plain)
    merged.merge_state_dict(mon.state_dict())
    assert merged.stats == mon.stats
    other = tiny(family, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"layer 0, weights: \w{8} here vs \w{8} in the state; layer 1, weights"):
        _fresh(other).merge_state_dict(mon.state_dict())

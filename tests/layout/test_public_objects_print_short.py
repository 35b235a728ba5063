"""Every object of a class eigenhooks defines prints in at most 3 lines and 300 characters (issue 58).

A ``Trajectory`` printed 45,417 characters and ``eh.verify`` a line of full-precision floats. This test walks
``eh``'s public names and those of its wings (``eh.zoo``, ``eh.run``, ...): it calls every public function on the
tiny zoo models, collects every eigenhooks object in what comes back (list items, dict values, and the fields
of the eigenhooks objects themselves), and checks each one's repr; an object that holds rows also gives them as
a DataFrame (``to_frame()``). A public class none of the calls returned fails the test until a call here
returns one, and a public function must be called here or named with what it returns instead: a new class
cannot slip past.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import eigenhooks as eh

WINGS = ("eh", "eh.monitor", "eh.spectra", "eh.steer", "eh.zoo", "eh.direction", "eh.planted", "eh.run")
WINGS += ("eh.integrations",)
# Public functions not called here, and why no eigenhooks object can come out of them.
NOT_CALLED = {
    "eh.zoo.fetch": "downloads from the package index (no network in tests); returns a Path",
    "eh.zoo.to_bridge": "returns TransformerLens's TransformerBridge, not an eigenhooks class",
    "eh.zoo.load_gguf": "returns (transformers model, tokenizer), like eh.zoo.load",
    "eh.zoo.check_gguf": "returns None or raises",
    "eh.spectra.parallel_map": "returns the list of what its function returns",
    "eh.direction.from_npy": "returns a tensor",
    "eh.monitor.check_nulls": "returns None or raises",
    "eh.steer.check_strength": "returns a pair of floats",
}
PLAIN = (Exception, Warning)  # their repr is their message


def _module(name: str):
    if name == "eh":
        return eh
    wing = name.split(".", 1)[1]  # eh.run and eh.integrations are imported on use; eh.direction is eigenhooks.steer's
    return importlib.import_module(getattr(eh, wing).__name__ if wing in dir(eh) else "eigenhooks." + wing)


def _public(wing: str) -> dict:
    """The wing's public functions and classes by dotted name (``__all__``, else what the module defines)."""
    m = _module(wing)
    names = getattr(m, "__all__", None) or [
        n for n, v in vars(m).items() if not n.startswith("_") and getattr(v, "__module__", "") == m.__name__
    ]
    out = {}
    for n in names:
        v = getattr(m, n)
        if inspect.isclass(v) or inspect.isfunction(v) or type(v).__name__ == "CallableWing":
            out[f"{wing}.{n}"] = v
    return out


@pytest.fixture(scope="module")
def returned(tmp_path_factory):
    """What every public function called on the tiny zoo models returned, by its dotted name."""
    model, tok = eh.zoo.load("gpt2-tiny")
    albert, atok = eh.zoo.load("albert-tiny")
    batch = tok(["def f(x):\n    return x", "class A:\n    pass"], return_tensors="pt", padding=True)
    specs = eh.spectra(model, heads=True, progress=False)
    adapter = eh.get_adapter(model)
    u = eh.direction.token(model, tok, " return")
    with eh.monitor(model, sink=lambda step, scalars: None) as mon:
        model(**batch)
    with eh.steer(model, u, progress=False) as steering:
        model(**batch)
    traj = eh.iterate(albert, atok(["def f(x):"], return_tensors="pt"), layer=0, steps=20, mode="paper")
    F = eh.planted.planted_matrix([0.9, 0.5], d=16)
    out = tmp_path_factory.mktemp("run") / "r"
    calls = {
        "eh.layer_spectrum": lambda: eh.layer_spectrum(eh.spectra.layer_factors(adapter, 0)[0]),
        "eh.get_adapter": lambda: adapter,
        "eh.supported_families": eh.supported_families,
        "eh.load_model": lambda: eh.load_model("gpt2-tiny"),
        "eh.classify_limit": lambda: eh.classify_limit(traj),
        "eh.iterate": lambda: traj,
        "eh.predict_limit": lambda: eh.predict_limit(traj.spectrum),
        "eh.rank_directions": lambda: eh.rank_directions(specs, u[None].double(), null_draws=50),
        "eh.read_tokens": lambda: eh.read_tokens(model, tok, specs[0].basis[:, 0], k=5, null_draws=20),
        "eh.verify": lambda: eh.verify(model, progress=False),
        "eh.monitor.monitor": lambda: mon,
        "eh.spectra.clear_memo": eh.spectra.clear_memo,
        "eh.spectra.layer_factors": lambda: eh.spectra.layer_factors(adapter, 1),
        "eh.spectra.layer_stacked": lambda: eh.spectra.layer_stacked(adapter, 1),
        "eh.spectra.spectra": lambda: specs,
        "eh.spectra.weights_digest": lambda: eh.spectra.weights_digest(adapter, 1),
        "eh.steer.steer": lambda: (steering, steering.summary(target_token=eh.direction.token_id(tok, " return"))),
        "eh.zoo.card": lambda: eh.zoo.card("gpt2-tiny"),
        "eh.zoo.is_fetched": lambda: eh.zoo.is_fetched("smollm2-135m"),
        "eh.zoo.load": lambda: (model, tok),
        "eh.zoo.load_model": lambda: eh.zoo.load_model("albert-tiny"),
        "eh.zoo.path": lambda: eh.zoo.path("gpt2-tiny"),
        "eh.direction.token_id": lambda: eh.direction.token_id(tok, " return"),
        "eh.direction.probability_direction": lambda: eh.direction.probability_direction(
            model.lm_head.weight.detach().double(), 5, steps=5
        ),
        "eh.direction.token": lambda: u,
        "eh.direction.contrast": lambda: eh.direction.contrast(model, tok, ["def f"], ["class A"]),
        "eh.direction.lm_head_looks_random": lambda: eh.direction.lm_head_looks_random(model),
        "eh.planted.planted_matrix": lambda: F,
        "eh.planted.planted_albert": lambda: eh.planted.planted_albert(F),
        "eh.planted.planted_gpt2": lambda: eh.planted.planted_gpt2(F),
        "eh.run.load_texts": lambda: eh.run.load_texts(text="def f(x): return x"),
        "eh.run.make_batches": lambda: eh.run.make_batches(tok, ["def f(x): return x"], 16, 8, 2),
        "eh.run.run": lambda: eh.run.run("gpt2-tiny", text="def f(x):\n    return x\n" * 20, max_tokens=128, out=out),
        "eh.run.sample_text": eh.run.sample_text,
        "eh.integrations.AlignmentCallback": lambda: eh.integrations.AlignmentCallback(["def f(x):"]),
        "eh.zoo.REAL": lambda: eh.zoo.REAL,
        "eh.monitor.DEFAULTS": lambda: eh.monitor.DEFAULTS,
        "eigenhooks.run.texts.TokenBatches": lambda: importlib.import_module("eigenhooks.run.texts").TokenBatches(
            tok, ["def f(x): return x"], 16, 8, 2
        ),
        "eh.Measure": eh.Measure,
    }
    return {name: call() for name, call in calls.items()}


def _ours(x) -> bool:
    return type(x).__module__.startswith("eigenhooks") and not isinstance(x, (PLAIN, type))


def _collect(x, found: dict, depth: int = 0) -> None:
    """Every eigenhooks object in x, by id: x itself, list/tuple items, dict values, an object's public fields."""
    if depth > 4 or id(x) in found or isinstance(x, (str, bytes, torch.Tensor, torch.nn.Module)):
        return
    if _ours(x):
        found[id(x)] = x
        fields = vars(x).items() if hasattr(x, "__dict__") else ()
        for v in (v for k, v in fields if not k.startswith("_")):
            _collect(v, found, depth + 1)
    if isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, found, depth + 1)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, found, depth + 1)


@pytest.fixture(scope="module")
def objects(returned):
    found: dict = {}
    for value in returned.values():
        _collect(value, found)
    return list(found.values())


def test_every_public_function_is_called_or_says_why_not(returned):
    public = {n: v for w in WINGS for n, v in _public(w).items()}
    done = {id(public[n]) for n in set(returned) | set(NOT_CALLED) if n in public}  # a function under two names
    functions = {n for n, v in public.items() if not inspect.isclass(v) and id(v) not in done}
    missing = functions - {"eh.monitor", "eh.spectra", "eh.steer"}
    # the callable wings are the functions eh.monitor.monitor, eh.spectra.spectra and eh.steer.steer
    assert not missing, f"call these in `returned` (or say in NOT_CALLED why not): {sorted(missing)}"


def test_every_public_class_was_returned_and_checked(objects):
    public = {v for w in WINGS for v in _public(w).values() if inspect.isclass(v) and not issubclass(v, PLAIN)}
    seen = {type(o) for o in objects}
    missing = {c.__qualname__ for c in public if not any(issubclass(t, c) for t in seen)}
    assert not missing, f"no call in `returned` gave one of: {sorted(missing)}"
    assert len(seen) >= 15, sorted(t.__name__ for t in seen)  # the walk reaches the fields, not just the top


def test_every_object_prints_in_three_lines_of_at_most_300_characters(objects):
    long = {}
    for o in objects:
        text = repr(o)
        if len(text.splitlines()) > 3 or len(text) > 300:
            long[type(o).__qualname__] = f"{len(text.splitlines())} lines, {len(text)} chars: {text[:120]!r}"
    assert not long, long


def test_an_adapter_prints_its_layout_not_its_model(returned):
    """An Adapter printed its whole model (7,019 characters for gpt2-tiny): now the layout a reader checks."""
    adapter = returned["eh.get_adapter"]
    text = repr(adapter)
    assert len(text) <= 300 and len(text.splitlines()) <= 3, len(text)
    for part in (repr(adapter.family), type(adapter.model).__name__, f"{adapter.n_layers} layers", "d_model="):
        assert part in text, (part, text)


def test_what_holds_rows_gives_them_as_a_frame(returned, objects):
    import pandas as pd

    traj, ver, run = returned["eh.iterate"], returned["eh.verify"], returned["eh.run.run"]
    df = traj.to_frame()
    assert len(df) == len(traj.steps) == 21 and df["alignment"].tolist() == traj.alignment
    assert df["consensus"].tolist() == traj.consensus and df["step"].tolist() == traj.steps
    vf = ver.to_frame()
    assert vf["layer"].tolist() == [v.layer for v in ver] and vf["max_abs_diff"].tolist() == [
        v.max_abs_diff for v in ver
    ]
    assert vf["rel_diff"].max() == max(v.rel_diff for v in ver)
    assert run.to_frame() is run.summary and isinstance(run.summary, pd.DataFrame)
    # what holds rows: a list of eigenhooks objects, or per-step lists
    for o in objects:
        holds_rows = isinstance(o, list) or any(
            isinstance(v, list) and len(v) > 3 for v in getattr(o, "__dict__", {}).values()
        )
        if holds_rows and type(o).__name__ not in {"Monitor"}:  # a monitor's rows: summary()
            assert callable(getattr(o, "to_frame", None)), f"{type(o).__qualname__} holds rows: give it to_frame()"


def test_the_long_objects_say_what_a_reader_looks_for(returned):
    traj = returned["eh.iterate"]
    text = repr(traj)
    assert text.startswith("Trajectory(layer=0, paper mode, 21 records, steps 0..20") and "alignment" in text, text
    assert repr(traj.spectrum) in text and "tensor(" not in text
    ver = returned["eh.verify"]
    worst = max(ver, key=lambda v: v.rel_diff)
    assert f"worst relative |ΔF| {worst.rel_diff:.3g} at layer {worst.layer}" in repr(ver), repr(ver)
    assert repr(ver[0]).startswith("Verification(layer=0, F from the weights vs the probe: relative ")
    assert str(ver[0].max_abs_diff) not in repr(ver[0])  # 3 significant digits, not the full float
    limit = returned["eh.classify_limit"]
    assert repr(limit).startswith(f"Limit({limit.kind}") and "alignment=" in repr(limit)
    pretty = pytest.importorskip("IPython.lib.pretty")
    assert pretty.pretty(ver) == repr(ver)  # a notebook cell shows the line, not the list item by item


def test_an_adapter_gives_its_layers_as_a_frame(returned):
    adapter = returned["eh.get_adapter"]
    df = adapter.to_frame()
    assert df["layer"].tolist() == [layer.index for layer in adapter.layers]
    assert df["block"].tolist() == [type(layer.block).__name__ for layer in adapter.layers]
    assert df["F_from_weights"].all()  # gpt2's layers are read from their weights
    for layer in adapter.layers:
        assert len(repr(layer)) <= 300 and str(layer.index) in repr(layer) and "\n" not in repr(layer)

"""A researcher's own measure (docs/api.md, "Your own measure"), run as the docs give it.

The example is read out of docs/api.md and executed; its measure then runs in the monitor beside
the built-in ones. Checked: its summary columns; its state sums against its plain twin and against
up-counts computed here from readings that hooks of our own recorded (``readings.Recorder``);
that the built-in numbers do not move when it is added; that its state saves, loads and merges,
and that a state measured with other directions does not merge.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.models import get_adapter
from eigenhooks.monitor.reference import build_bases, reference_states

from .readings import Recorder

SETTINGS = dict(null_draws=8, fnull_draws=4, eig_top=2, null_stride=1, null_seed=3)
TEXTS = ["def f(x):\n    return x + 1", "The for statement iterates over a sequence.", "import os"]


def docs_example() -> dict:
    """The Python block of docs/api.md's "Your own measure", executed; its namespace."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = text.split("### Your own measure", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ns: dict = {"__name__": "docs_example"}
    exec(compile(code, "docs/api.md", "exec"), ns)  # noqa: S102  (our own documentation)
    return ns


@pytest.fixture(scope="module")
def ex():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return docs_example()


def test_the_docs_example_runs_and_adds_its_columns(ex):
    df = ex["mon"].summary()
    assert {"sae.rho_max", "sae.rho_mean"} <= set(df.columns)
    assert df.attrs["per_layer"] == ["sae.rho_max", "sae.rho_mean"]
    assert df["sae.rho_max"].between(0, 1).all() and (df["sae.rho_mean"] <= df["sae.rho_max"]).all()
    assert {"sae.up", "sae.tokens"} <= set(ex["mon"].state_dict()["layers"]["0"])


def run(ex, D, measures=True):
    model, tok = ex["model"], ex["tok"]
    tok.pad_token = tok.pad_token or tok.eos_token
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    own = [ex["Directions"]("sae", D)] if measures else []
    mon = eh.monitor(model, targets=[("ov", "modulus")], measures=own, **SETTINGS)
    with torch.no_grad(), mon, Recorder(model) as rec:
        model(**batch)
    return mon, rec, own


def test_the_fast_sums_are_the_plain_twins_and_the_raw_readings(ex):
    D = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    mon, rec, own = run(ex, D)
    fast = {int(i): torch.tensor(st["sae.up"]) for i, st in mon.state_dict()["layers"].items()}
    s = SETTINGS
    bases = build_bases(get_adapter(ex["model"]), [("ov", "modulus")], s["null_draws"], s["fnull_draws"],
                        s["eig_top"], s["null_seed"])  # fmt: skip
    plain = reference_states(rec.forwards, bases, s["null_stride"], measures=own)
    Du = (D.double() / D.double().norm(dim=1, keepdim=True)).numpy()
    for i, want in plain.items():
        assert torch.equal(fast[i], want["sae.up"]), f"layer {i}: fast {fast[i]} vs plain {want['sae.up']}"
        # from the recorded readings, with numpy: mid against pre (gpt2 is pre-norm), every valid token
        up = np.zeros(len(Du))
        for fw in rec.forwards:
            rd, m = fw.layers[i], fw.mask.bool().numpy()
            pre, mid = rd.pre.double().numpy()[m], rd.mid.double().numpy()[m]
            a = lambda X: np.abs(X @ Du.T) / np.linalg.norm(X, axis=1, keepdims=True)  # noqa: E731
            up += ((a(mid) - a(pre)) > 1e-6).sum(0)
        assert fast[i].tolist() == up.tolist(), f"layer {i}: {fast[i].tolist()} vs raw readings {up.tolist()}"
        assert up.sum() > 0


def test_adding_a_measure_moves_no_built_in_number(ex):
    D = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    with_it, _, _ = run(ex, D)
    without, _, _ = run(ex, D, measures=False)
    a, b = with_it.summary(), without.summary()
    assert list(b.columns) == [c for c in a.columns if not c.startswith("sae.")]
    for c in b.columns:
        assert a[c].equals(b[c]), c
    sa, sb = with_it.state_dict()["layers"], without.state_dict()["layers"]
    for i in sb:
        assert sorted(sa[i]) == sorted([*sb[i], "sae.up", "sae.tokens"])
        for k, v in sb[i].items():  # bit for bit (NaN where F has no j-th eigen-subspace)
            assert torch.equal(torch.tensor(sa[i][k]).nan_to_num(-1.0), torch.tensor(v).nan_to_num(-1.0)), (i, k)


def test_its_state_saves_loads_and_merges_and_other_directions_do_not_merge(ex):
    D = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    mon, _, own = run(ex, D)
    twice = eh.monitor(ex["model"], targets=[("ov", "modulus")], measures=own, **SETTINGS)
    twice.load_state_dict(mon.state_dict())
    twice.merge_state_dict(mon.state_dict())
    for i, st in twice.state_dict()["layers"].items():
        assert st["sae.up"] == [2 * v for v in mon.state_dict()["layers"][i]["sae.up"]]
    other = eh.monitor(ex["model"], targets=[("ov", "modulus")], measures=[ex["Directions"]("sae", D.flip(1))],
                       **SETTINGS)  # fmt: skip
    with pytest.raises(ValueError, match="sae"):
        other.merge_state_dict(mon.state_dict())


def test_its_running_values_reach_the_sinks_under_its_own_tags(ex):
    """A ``logged`` measure's columns are logged beside the built-in metrics at every log point, once a layer
    (its value is the layer's, not a target's: no target in its tag, however many targets); the last equals
    its summary column (both read the same state)."""
    D = torch.randn(6, 128, generator=torch.Generator().manual_seed(5))
    model, tok = ex["model"], ex["tok"]
    tok.pad_token = tok.pad_token or tok.eos_token
    logged: list[tuple[int, dict]] = []
    sae = ex["Directions"]("sae", D)
    sae.logged = True
    mon = eh.monitor(model, targets=[("ov", "modulus"), ("ov", "residual")], measures=[sae],
                     sink=lambda step, values: logged.append((step, dict(values))), log_every=1, **SETTINGS)  # fmt: skip
    with torch.no_grad(), mon:
        for text in TEXTS:
            model(**tok([text], return_tensors="pt"))
    assert len(logged) == len(TEXTS)
    layers = sorted(mon.state_dict()["layers"], key=int)
    df = mon.summary().set_index("layer")
    for i in layers:
        t = f"eigenhooks/sae.rho_max/L{int(i):02d}"
        assert all(t in values for _, values in logged), t
        assert [k for k in logged[-1][1] if k.startswith(t)] == [t]  # once, not once a target
        assert f"eigenhooks/rho/L{int(i):02d}/ov-modulus" in logged[-1][1]
        assert f"eigenhooks/rho/L{int(i):02d}/ov-residual" in logged[-1][1]
        assert logged[-1][1][t] == pytest.approx(float(df.loc[int(i), "sae.rho_max"].iloc[0]), abs=1e-12)
    first = [v for k, v in logged[0][1].items() if k.startswith("eigenhooks/sae.rho_max/")]
    last = [v for k, v in logged[-1][1].items() if k.startswith("eigenhooks/sae.rho_max/")]
    assert first != last  # running values, not the final ones repeated
    assert mon.scalars() == logged[-1][1]


def test_a_measure_not_logged_copies_nothing_to_the_host_and_zero_knows_its_layer():
    """Only ``logged`` measures have their fields read at a log point; ``zero`` gets the layer and its width."""
    from eigenhooks.monitor.logs import Labels

    seen: list = []

    class PerLayer(eh.Measure):
        name = "per_layer"

        def zero(self, layer, d):
            seen.append((layer, d))
            return {"n": torch.zeros(layer + 1, dtype=torch.float64)}

        def sums(self, r):
            return {"n": r.valid.sum(dtype=torch.float64).expand(r.layer + 1)}

    model, tok = eh.zoo.load("gpt2-tiny")
    mon = eh.monitor(model, targets=[("ov", "modulus")], measures=[PerLayer()], **SETTINGS)
    with torch.no_grad(), mon:
        model(**tok(TEXTS[:1], return_tensors="pt"))
    st = mon.state_dict()["layers"]
    n = len(tok(TEXTS[:1])["input_ids"][0])
    assert {int(i): v["per_layer.n"] for i, v in st.items()} == {int(i): [n] * (int(i) + 1) for i in st}
    assert set(seen) >= {(int(i), 128) for i in st}
    labels = Labels(mon._plan, mon.reading_points, mon.adapter.n_layers)
    tensors = labels.tensors(mon._acc)
    assert len(tensors) == len(st) and all(v == [] for v in labels.shapes.values())


def test_in_generate_its_sums_are_its_plain_twins_and_the_built_in_ones_do_not_move(ex):
    """Decoding steps with a KV cache, left-padded: its sums are taken per step (the steps kept layer by layer,
    not whole), equal to its plain twin on the recorded forwards, and no built-in number moves."""
    model, tok = ex["model"], ex["tok"]
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    try:
        batch = tok(TEXTS[:2], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "right"
    D = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))
    own = [ex["Directions"]("sae", D)]
    s = SETTINGS

    def gen(measures):
        mon = eh.monitor(model, targets=[("ov", "modulus")], measures=measures, **s)
        with torch.no_grad(), mon, Recorder(model) as rec:
            model.generate(
                **batch, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
            )
        return mon, rec

    mon, rec = gen(own)
    assert len(rec.forwards) == 12 and all(f.continues for f in rec.forwards[1:])
    bases = build_bases(get_adapter(model), [("ov", "modulus")], s["null_draws"], s["fnull_draws"], s["eig_top"],
                        s["null_seed"])  # fmt: skip
    plain = reference_states(rec.forwards, bases, s["null_stride"], measures=own)
    for i, st in mon.state_dict()["layers"].items():
        for k in ("sae.up", "sae.tokens"):
            assert torch.equal(torch.tensor(st[k]), plain[int(i)][k]), (i, k, st[k], plain[int(i)][k].tolist())
    assert sum(st["sae.tokens"] for st in mon.state_dict()["layers"].values()) > 0
    without, _ = gen([])
    a, b = mon.summary(), without.summary()
    for c in b.columns:
        assert a[c].equals(b[c]), c

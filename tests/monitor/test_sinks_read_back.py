"""Sinks: what each library wrote, read back with that library's own reader, against ``mon.summary()``.

TensorBoard through ``EventAccumulator``, MLflow through ``MlflowClient`` on a file store, wandb
from its offline run file (``wandb_offline``: wandb's own protobuf records), the callable as
called. The expected values come from ``mon.summary()`` after each forward, with the tags
spelled out here, not by the code under test.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import SinkError

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass", "for i in range(10): print(i)", "import os\nos.sep"]
METRICS = ("gamma_pre", "gamma_mid", "gamma_post", "rho", "n_tokens")
FAST = {"null_draws": 8, "fnull_draws": 4, "eig_top": 2}  # the nulls play no part in the logged values


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _batches(tok, texts=TEXTS):
    return [tok([t], return_tensors="pt") for t in texts]


def _expected(mon) -> dict[str, float]:
    """{tag: value} from the summary, tags spelled as docs/api.md says: eigenhooks/<metric>/L<layer>/<target>."""
    df = mon.summary()
    return {
        f"eigenhooks/{m}/L{int(r.layer):02d}/{r.target.replace('/', '-')}": float(getattr(r, m))
        for r in df.itertuples()
        for m in METRICS
    }


def _run(model, tok, sink, log_every=1, steps=None, texts=TEXTS, **kw):
    """Forward each text in turn; returns the monitor and {step: expected values} at every forward."""
    expected = {}
    with eh.monitor(model, sink=sink, log_every=log_every, **FAST, **kw) as mon, torch.no_grad():
        for i, batch in enumerate(_batches(tok, texts)):
            if steps is not None:
                mon.step = steps[i]
            model(**batch)
            expected[mon.step if steps is not None else i + 1] = _expected(mon)
    return mon, expected


def _close(a: float, b: float, rel: float) -> bool:
    """Equal to ``rel``, NaN equal to NaN (a sink writes a NaN the table has: p_null on too few tokens)."""
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def _assert_values(got: dict, want: dict, rel: float = 1e-12) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    bad = [(k, got[k], want[k]) for k in want if not _close(got[k], want[k], rel)]
    assert not bad, bad[:5]


# ---- the callable ----


def test_callable_gets_the_running_values_at_every_log_point(gpt2):
    model, tok = gpt2
    calls = []
    mon, expected = _run(model, tok, lambda step, scalars: calls.append((step, scalars)))
    assert [s for s, _ in calls] == [1, 2, 3, 4]
    for step, values in calls:
        _assert_values(values, expected[step])
    assert len(calls[0][1]) == model.config.n_layer * 2 * len(METRICS)


def test_log_every_and_the_last_values_on_exit(gpt2):
    model, tok = gpt2
    calls = []
    texts = TEXTS + TEXTS[:1]  # 5 forwards: log points at 2 and 4, and the end (5) on exit
    mon, expected = _run(model, tok, lambda s, v: calls.append((s, v)), log_every=2, texts=texts)
    assert [s for s, _ in calls] == [2, 4, 5]
    for step, values in calls:
        _assert_values(values, expected[step])


def test_the_callers_own_step(gpt2):
    model, tok = gpt2
    calls = []
    mon, expected = _run(model, tok, lambda s, v: calls.append((s, v)), steps=[100, 200, 300, 400])
    assert [s for s, _ in calls] == [100, 200, 300, 400]
    for step, values in calls:
        _assert_values(values, expected[step])


def test_log_now_and_log_every_zero(gpt2):
    model, tok = gpt2
    calls = []
    with eh.monitor(model, sink=lambda s, v: calls.append((s, v)), log_every=0, **FAST) as mon, torch.no_grad():
        for batch in _batches(tok)[:2]:
            model(**batch)
        assert calls == []  # no log point with log_every=0
        got = mon.log(step=7)
        assert calls == [(7, got)]
        _assert_values(got, _expected(mon))
        model(**_batches(tok)[2])
        want = _expected(mon)
    assert [s for s, _ in calls] == [7, 3]  # exit logs the values the sinks have not seen
    _assert_values(calls[1][1], want)


# ---- TensorBoard ----


def _tb_reader(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _parse_markdown(text: str) -> list[dict]:
    lines = [ln.strip().strip("|").split("|") for ln in text.strip().splitlines()]
    head = [c.strip() for c in lines[0]]
    return [dict(zip(head, (c.strip() for c in ln))) for ln in lines[2:]]


@pytest.mark.parametrize("how", ["string", "writer"])
def test_tensorboard_read_back_with_event_accumulator(gpt2, tmp_path, how):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    model, tok = gpt2
    folder = tmp_path / "tb"
    writer = SummaryWriter(log_dir=str(folder)) if how == "writer" else None
    sink = writer if how == "writer" else f"tensorboard:{folder}"
    mon, expected = _run(model, tok, sink)
    if writer is not None:
        writer.close()
    ea = _tb_reader(folder)
    tags = set(ea.Tags()["scalars"])
    assert tags == set(expected[1]), sorted(tags ^ set(expected[1]))[:5]
    for tag in tags:
        events = ea.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4], tag
        for e in events:
            assert _close(e.value, expected[e.step][tag], 1e-6), (tag, e.step, e.value, expected[e.step][tag])
    (text,) = ea.Tensors("eigenhooks/summary/text_summary")
    assert text.step == 4
    rows = _parse_markdown(text.tensor_proto.string_val[0].decode())
    df = mon.summary()
    assert len(rows) == len(df)
    for row, ref in zip(rows, df.itertuples()):
        assert int(row["layer"]) == ref.layer and row["target"] == ref.target and row["verdict"] == ref.verdict
        for col in ("gamma_pre", "gamma_mid", "rho", "p_null", "rho_ci_lo"):
            assert _close(float(row[col]), getattr(ref, col), 1e-5), (col, row[col], getattr(ref, col))


def test_log_summary_is_not_repeated_on_exit(gpt2, tmp_path):
    pytest.importorskip("tensorboard")
    model, tok = gpt2
    with eh.monitor(model, sink=f"tensorboard:{tmp_path}", **FAST) as mon, torch.no_grad():
        model(**_batches(tok)[0])
        mon.log_summary(step=42)
    events = _tb_reader(tmp_path).Tensors("eigenhooks/summary/text_summary")
    assert [e.step for e in events] == [42]


# ---- MLflow ----


def test_mlflow_read_back_with_mlflow_client(gpt2, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    import pandas as pd

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind a flag
    mlflow.set_tracking_uri("file:" + str(tmp_path / "mlruns"))
    model, tok = gpt2
    try:
        with mlflow.start_run() as run:
            mon, expected = _run(model, tok, "mlflow", log_every=2)
    finally:
        mlflow.set_tracking_uri("")
    client = mlflow.MlflowClient(tracking_uri="file:" + str(tmp_path / "mlruns"))
    rid = run.info.run_id
    assert set(client.get_run(rid).data.metrics) == set(expected[2])
    for tag in expected[2]:
        hist = sorted(client.get_metric_history(rid, tag), key=lambda m: m.step)
        assert [m.step for m in hist] == [2, 4], tag
        for m in hist:
            assert _close(m.value, expected[m.step][tag], 1e-12), (tag, m.step)
    csv = client.download_artifacts(rid, "eigenhooks/summary.csv", str(tmp_path / "dl"))
    got, want = pd.read_csv(csv), mon.summary()
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for col in ("layer", "n_tokens", "gamma_pre", "gamma_post", "rho", "p_null", "q_null", "null_rho_hi"):
        pd.testing.assert_series_equal(got[col], want[col], check_dtype=False, rtol=1e-12, check_names=False)
    assert list(got["verdict"]) == list(want["verdict"])


# ---- wandb ----


def test_wandb_offline_run_read_back_from_its_file(gpt2, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from .wandb_offline import history, metric_definitions

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    model, tok = gpt2
    run = wandb.init(project="eigenhooks-test", dir=str(tmp_path))
    try:
        mon, expected = _run(model, tok, "wandb", steps=[10, 20, 30, 40])
    finally:
        run.finish()
        wandb.teardown()  # waits for wandb's service to write the run's file out (finish alone may not)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    scalar_rows = [r for r in rows if "eigenhooks/summary/_type" not in r]
    assert [r["eigenhooks/step"] for r in scalar_rows] == [10, 20, 30, 40]
    for r in scalar_rows:
        _assert_values(
            {k: v for k, v in r.items() if k.startswith("eigenhooks/") and k != "eigenhooks/step"},
            expected[r["eigenhooks/step"]],
        )
    (table_row,) = [r for r in rows if "eigenhooks/summary/_type" in r]
    assert table_row["eigenhooks/summary/_type"] == "table-file" and table_row["eigenhooks/step"] == 40
    table = json.loads((run_dir / "files" / table_row["eigenhooks/summary/path"]).read_text())
    df = mon.summary()
    assert table["columns"] == list(df.columns) and len(table["data"]) == len(df)
    for got, ref in zip(table["data"], df.to_dict("records")):
        for col in ("layer", "target", "verdict", "n_tokens", "gamma_mid", "rho", "p_null", "rho_ci_hi"):
            g, w = got[table["columns"].index(col)], ref[col]
            assert (g == w) if isinstance(w, str) else _close(float(g), float(w), 1e-12), (col, g, w)
    defs = {m.glob_name or m.name: m.step_metric for m in metric_definitions(run_dir)}
    assert defs.get("eigenhooks/*") == "eigenhooks/step", defs


# ---- errors ----


@pytest.mark.parametrize(
    "sink, module, extra",
    [
        ("tensorboard:{tmp}", "torch.utils.tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
    ],
)
def test_a_missing_library_names_its_extra(gpt2, tmp_path, monkeypatch, sink, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(
        ImportError, match=rf"needs {extra}, which is not installed: pip install 'eigenhooks\[{extra}\]'$"
    ):
        eh.monitor(gpt2[0], sink=sink.format(tmp=tmp_path))


def test_bad_sink_specs(gpt2, monkeypatch):
    model = gpt2[0]
    with pytest.raises(ValueError, match="needs a folder after the colon"):
        eh.monitor(model, sink="tensorboard:")
    with pytest.raises(ValueError, match="unknown sink 3"):
        eh.monitor(model, sink=3)
    with pytest.raises(ValueError, match="log_every must be a non-negative int"):
        eh.monitor(model, sink=print, log_every=-1)
    if "wandb" in sys.modules or _importable("wandb"):
        import wandb

        monkeypatch.setattr(wandb, "run", None)
        with pytest.raises(ValueError, match=r"no active wandb run|there is none: call wandb.init\(\)"):
            eh.monitor(model, sink="wandb")
    if _importable("mlflow"):
        import mlflow

        monkeypatch.setattr(mlflow, "active_run", lambda: None)
        with pytest.raises(ValueError, match=r"call mlflow.start_run\(\) first"):
            eh.monitor(model, sink="mlflow")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---- on a GPU: no host sync in a forward ----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_logging_adds_no_host_sync_to_a_forward_on_cuda(tmp_path):
    import warnings

    model, tok = eh.zoo.load("gpt2-tiny")
    model = model.cuda()
    batches = [{k: v.cuda() for k, v in b.items()} for b in _batches(tok)]

    def syncs(sink):
        calls, expected = [], {}
        with eh.monitor(model, sink=sink(calls), log_every=1, **FAST) as mon, torch.no_grad():
            model(**batches[0])  # warm-up: first-use allocations
            n = 0
            for i, b in enumerate(batches[1:], start=2):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        model(**b)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                n += sum("synchroniz" in str(w.message) for w in caught)
                expected[i] = _expected(mon)
        return n, calls, expected

    base, _, _ = syncs(lambda calls: None)
    with_sink, calls, expected = syncs(lambda calls: [lambda s, v: calls.append((s, v)), f"tensorboard:{tmp_path}"])
    assert with_sink == base, f"the sinks added {with_sink - base} host syncs over {len(batches) - 1} forwards"
    assert [s for s, _ in calls] == [1, 2, 3, 4]
    for step, values in calls[1:]:
        _assert_values(values, expected[step], rel=1e-12)


# ---- issue 29, item 5: a forward whose sink write fails is not counted ----


class _Flaky:
    """A sink failure that can be switched off, for each kind of sink."""

    def __init__(self, kind: str, tmp_path):
        self.kind, self.tmp, self.on = kind, tmp_path, True
        self.calls = []
        self.jsonl = None
        if kind == "missing-folder":
            self.jsonl = tmp_path / "gone" / "stats.jsonl"
        elif kind == "read-only-file":
            self.jsonl = tmp_path / "stats.jsonl"
            self.jsonl.write_text("")
            self.jsonl.chmod(0o444)
            try:
                with open(self.jsonl, "a"):
                    pytest.skip("a read-only mode does not stop this user (root) from writing")
            except PermissionError:
                pass
        elif kind == "folder-in-the-way":
            self.jsonl = tmp_path / "stats.jsonl"
            self.jsonl.mkdir()

    def sink(self):
        if self.jsonl is not None:
            return self.jsonl
        if self.kind == "callable":

            def fn(step, values):
                if self.on:
                    raise OSError("the callable's disk is full")
                self.calls.append((step, values))

            return fn
        from torch.utils.tensorboard import SummaryWriter

        flaky = self

        class Writer(SummaryWriter):
            def add_scalar(self, *a, **k):
                if flaky.on:
                    raise OSError("the event file's disk is full")
                return super().add_scalar(*a, **k)

        return Writer(log_dir=str(self.tmp / "tb"))

    def fix(self):
        self.on = False
        if self.kind == "missing-folder":
            self.jsonl.parent.mkdir()
        elif self.kind == "read-only-file":
            self.jsonl.chmod(0o644)
        elif self.kind == "folder-in-the-way":
            self.jsonl.rmdir()


KINDS = ["missing-folder", "read-only-file", "folder-in-the-way", "callable", "tensorboard-writer"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_whose_sink_fails_is_not_counted(gpt2, tmp_path, kind):
    if kind == "tensorboard-writer":
        pytest.importorskip("tensorboard")
    model, tok = gpt2
    b = _batches(tok)
    flaky = _Flaky(kind, tmp_path)
    failed_at, error = None, None
    with eh.monitor(model, sink=flaky.sink(), **FAST) as mon, torch.no_grad():
        for i, batch in enumerate(b[:3]):
            try:
                model(**batch)
            except Exception as e:  # noqa: BLE001  (which type comes is checked below, after the counts)
                failed_at, error = i, e
                break
        assert failed_at is not None, "the sink never failed"
        kept = b[:failed_at]  # the forwards that counted
        assert mon.n_forwards == len(kept)
        after_failure = mon.stats  # compared once the block is left (a reference run inside it would be monitored)
        flaky.fix()
        model(**b[3])
    assert after_failure == _reference(model, kept).stats, "the failed forward's sums were kept"
    assert isinstance(error, SinkError) and "This forward was not counted" in str(error), repr(error)
    kept = kept + [b[3]]
    ref = _reference(model, kept)
    assert mon.n_forwards == len(kept)
    _assert_same_stats(mon, ref)
    if flaky.jsonl is not None:
        lines = [json.loads(x) for x in flaky.jsonl.read_text().splitlines()]
        assert [ln["forward"] for ln in lines] == list(range(1, len(kept) + 1))
        assert sum(s["n"] for ln in lines for s in ln["stats"] if s["layer"] == 0) == sum(
            mon.stats[(0, t)]["n"] for t in ("ov/modulus", "ov/residual")
        )
    if kind == "callable":  # every log point that counted reached it, in order, once
        assert [s for s, _ in flaky.calls] == list(range(1, len(kept) + 1))
        _assert_values(flaky.calls[-1][1], _expected(ref))


def test_a_later_sink_failing_takes_back_the_jsonl_line_of_its_forward(gpt2, tmp_path):
    model, tok = gpt2
    b = _batches(tok)
    state = {"fail": False}

    def fn(step, values):
        if state["fail"]:
            raise RuntimeError("boom")

    path = tmp_path / "s.jsonl"
    with eh.monitor(model, sink=[path, fn], **FAST) as mon, torch.no_grad():
        model(**b[0])
        state["fail"] = True
        with pytest.raises(SinkError, match="boom"):
            model(**b[1])  # its log point sends forward 1's values to fn, which fails
        assert len(path.read_text().splitlines()) == 1
        state["fail"] = False
        model(**b[2])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [ln["forward"] for ln in lines] == [1, 2]
    _assert_same_stats(mon, _reference(model, [b[0], b[2]]))
    for key, st in mon.stats.items():
        got = sum(s["n_up"] for ln in lines for s in ln["stats"] if (s["layer"], s["target"]) == key)
        assert got == st["n_up"], key


def test_a_sink_failing_on_exit_raises_unless_the_block_raised(gpt2, tmp_path):
    model, tok = gpt2
    batch = _batches(tok)[0]

    def fn(step, values):
        raise RuntimeError("sink down")

    with pytest.raises(SinkError, match="sink down"), eh.monitor(model, sink=fn, **FAST), torch.no_grad():
        model(**batch)  # the first log point only starts the copy: the write comes on exit
    with pytest.warns(RuntimeWarning, match="sink down"), pytest.raises(KeyError, match="the block's own"):
        with eh.monitor(model, sink=fn, **FAST), torch.no_grad():
            model(**batch)
            raise KeyError("the block's own")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_does_not_count_the_forward(gpt2):
    model, tok = gpt2
    with eh.monitor(model, sink="/dev/full", **FAST) as mon, torch.no_grad():
        with pytest.raises(SinkError, match="No space left"):
            model(**_batches(tok)[0])
        assert mon.n_forwards == 0 and all(s["n"] == 0 for s in mon.stats.values())


def _reference(model, batches):
    if not batches:
        ref = eh.Monitor(model, **FAST)
        ref.state_dict()  # prepares its (empty) state
        return ref
    with eh.monitor(model, **FAST) as ref, torch.no_grad():
        for batch in batches:
            model(**batch)
    return ref


def _assert_same_stats(mon, ref) -> None:
    got, want = mon.stats, ref.stats
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], (key, {k: (got[key][k], v) for k, v in want[key].items() if got[key][k] != v})


def test_a_forward_not_counted_leaves_no_token_records(gpt2):
    model, tok = gpt2
    b = _batches(tok)
    state = {"fail": False}

    def fn(step, values):
        if state["fail"]:
            raise RuntimeError("boom")

    with eh.monitor(model, sink=fn, tokens=True, **FAST) as mon, torch.no_grad():
        model(**b[0])
        state["fail"] = True
        with pytest.raises(SinkError):
            model(**b[1])
        assert {r["forward"] for r in mon.token_records} == {0}
        first = mon.token_records[0]["target"]  # one record a (layer, target): count one target's
        n = sum(int(r["mask"].sum()) for r in mon.token_records if r["layer"] == 0 and r["target"] == first)
        assert n == b[0]["input_ids"].numel()
        state["fail"] = False

"""The taps' op as a CUDA graph replays it: device writes only; the host works out the rest after the forward.

Under CUDA graphs a decoding step is a replay: the kernels the capture recorded run again on the same
addresses, and none of the op's Python does. Here a capture is an aten-level recording of what
``TapStore.write`` dispatches (``Recorder``) with static input tensors, and a replay runs those ops again,
the new step's readings copied into the static inputs first (as vLLM copies a step's inputs into its graph's
buffers), padded to the captured size. Which tokens are whose, and how many, comes from the host's batch
metadata (``TokenMap``); whether the taps wrote a forward, from the device count (``TapStore.check``). The
table must equal the HF monitor's on the whole sequences, and a forward whose replay did not run must
count none of its tokens, found with nothing read back from the device.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eigenhooks.engines.requests import TokenMap
from eigenhooks.engines.vllm.capture import TapStore
from eigenhooks.engines.vllm.worker import drain
from tests.engines.test_requests import _table, assert_tables_equal, engine_record, hf_table, llama, readings_of

__all__ = ["llama"]  # the fixture, used here

L, FIXED = 2, 8  # the model's layers; the tokens of the captured graph (the slab's rows)
READBACK = {"aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select"}


class Recorder(TorchDispatchMode):
    """Every aten op dispatched inside it, with its arguments (a capture: replayed by ``replay``)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def replay(ops) -> None:
    """The captured ops again, on the tensors they were captured with (no Python of the store runs)."""
    for func, args, kwargs in ops:
        func(*args, **kwargs)


class Engine:
    """A fake engine's forwards through the taps' store: slot 2i the pre of layer i (written as a
    (hidden, residual) pair), 2i+1 its attention output (written as 0.5 x scaled by 2), 2L the last post."""

    def __init__(self, model, seqs):
        self.reads = {k: readings_of(model, s) for k, s in seqs.items()}
        self.store = TapStore()
        self.store.n_slots, self.store.capacity, self.store.fixed = 2 * L + 1, 64, FIXED
        d = self.reads[next(iter(seqs))]["pre"][0].shape[-1]
        self.store.reserve(d, torch.float32, "cpu")  # up front, as place_taps does
        self.static = [(torch.zeros(FIXED, d), torch.zeros(FIXED, d)) for _ in range(2 * L + 1)]
        self.graph = None

    def slots(self, chunks) -> list[torch.Tensor]:
        """Each slot's reading of this forward's tokens, (tokens, d)."""
        cat = lambda p, i: torch.cat([self.reads[k][p][i][a:b] for k, a, b in chunks])  # noqa: E731
        out = []
        for i in range(L):
            out += [cat("pre", i), cat("attn", i)]
        return out + [cat("post", L - 1)]

    def write(self, slot: int, x: torch.Tensor, r: torch.Tensor) -> None:
        """The tap of one slot, as the hooks call it: a pair, a scaled output, or a plain output (the
        readings: x + r, 2 x, x)."""
        if slot == 2 * L:
            self.store.write(slot, x)
        elif slot % 2:
            self.store.write(slot, x, None, 2.0)
        else:
            self.store.write(slot, x, r)

    def inputs(self, slot: int, got: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """What the tap of ``slot`` is handed for the reading ``got`` (with ``r`` the residual of a pair)."""
        return got * 0.5 if slot % 2 and slot != 2 * L else got if slot == 2 * L else got - r

    def capture(self) -> None:
        """The graph of a FIXED-token forward (before any monitor, as vLLM captures at start-up)."""
        self.store.active = True
        with Recorder() as rec:
            for slot, (x, r) in enumerate(self.static):
                self.write(slot, x, r)
        self.store.active = False
        self.graph = rec.ops
        assert not any("zeros" in f._schema.name or "empty" in f._schema.name for f, _, _ in rec.ops)

    def eager(self, chunks) -> None:
        """A forward the store's Python runs (a prefill wider than any graph)."""
        for slot, got in enumerate(self.slots(chunks)):
            r = torch.randn_like(got)
            self.write(slot, self.inputs(slot, got, r), r)

    def replayed(self, chunks, run: bool = True) -> None:
        """A forward replayed from the graph: its tokens copied into the static inputs (the rest padding),
        then the captured ops (run=False: the replay did not write, e.g. a graph captured without taps)."""
        for slot, ((x, r), got) in enumerate(zip(self.static, self.slots(chunks))):
            n = got.shape[0]
            assert n <= FIXED
            r.normal_()
            x.copy_(torch.randn(FIXED, x.shape[1]) * 50)  # padding rows: anything
            x[:n].copy_(self.inputs(slot, got, r[:n]))
        if run:
            replay(self.graph)


def tokens(chunks) -> TokenMap:
    return TokenMap([k for k, _, _ in chunks], [b - a for _, a, b in chunks], [a for _, a, _ in chunks])


class Session:
    """What the worker keeps per entered monitor (``session.Session``'s fields that ``drain`` uses)."""

    def __init__(self, engine):
        self.engine, self.n_layers, self.dropped = engine, L, 0
        self.lock = contextlib.nullcontext()


SEQS = {"A": 14, "B": 11, "C": 9}


def schedule():
    """Prefills (10 tokens: wider than the graph, eager) and steps (replayed), C's prompt beside A's steps."""
    out = [("eager", [("A", 0, 6), ("B", 0, 4)])]
    out += [("graph", [("A", t, t + 1), ("B", t - 2, t - 1)]) for t in range(6, 13)]  # B's last at 10
    out += [("graph", [("A", 13, 14), ("C", 0, 5)])]  # 6 tokens: a chunk replayed in the 8-token graph
    out += [("graph", [("C", t, t + 1)]) for t in range(5, 9)]
    return out


def run(model, seqs, skip=(), tell_skipped=True, trap=None):
    eng = Engine(model, seqs)
    eng.capture()
    record = engine_record(model)
    s = Session(record)
    eng.store.attach()
    for j, (how, chunks) in enumerate(schedule()):
        if how == "eager":
            eng.eager(chunks)
        else:
            eng.replayed(chunks, run=j not in skip)
        if j in skip and not tell_skipped:
            eng.store.check()
            continue
        n = sum(b - a for _, a, b in chunks)
        with trap if trap is not None and how == "graph" else contextlib.nullcontext():
            drain([s], n, lambda chunks=chunks: tokens(chunks), eng.store)
        if chunks[-1] == ("B", 10, 11):
            record.end(["B"])
    record.end(["A", "C"])
    return record, eng.store, s


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(11)
    return {k: torch.randint(0, 64, (n,), generator=g).tolist() for k, n in SEQS.items()}


def test_replayed_forwards_give_the_hf_monitors_table(llama, seqs):
    """Steps replayed from a graph (only the op's device writes run) count as the HF monitor on the whole
    sequences counts them, rows and table; nothing is read back from the device after a step."""
    trap = Recorder()
    record, store, s = run(llama, seqs, trap=trap)
    read = sorted({f._schema.name for f, _, _ in trap.ops} & READBACK)
    assert read == [], f"a step read back from the device: {read}"
    assert store.n_missed() == 0 and s.dropped == 0
    assert store.wide and store.slab.abs().sum() > 0  # the prefill went wide, the steps to the slab
    table = _table(llama, record)
    assert_tables_equal(hf_table(llama, list(seqs.values())), table)
    n = {r["request_id"]: r["n_tokens"] for r in record.rows() if r["layer"] == 0 and r["target"] == "ov/modulus"}
    assert n == SEQS


def test_a_forward_the_taps_did_not_write_counts_none_of_its_tokens(llama, seqs):
    """A replay that did not run leaves the last forward's readings in the slab: the device count says so
    (``missed``), and none of its tokens count: the table is the one without that forward."""
    skipped = 8  # ("A", 13, 14), ("C", 0, 5): 6 stale rows in the slab
    record, store, _ = run(llama, seqs, skip={skipped})
    assert store.n_missed() == 1
    without, _, _ = run(llama, seqs, skip={skipped}, tell_skipped=False)
    got, want = _table(llama, record), _table(llama, without)
    assert int(got["n_tokens"].iloc[0]) == sum(SEQS.values()) - 6
    assert_tables_equal(want, got)


def test_a_slab_that_moved_is_not_what_the_graph_writes(llama, seqs):
    """The graph writes where the slab was at its capture: a slab reallocated after it would be read stale
    (the replayed steps' readings then are not theirs), which is why the slab never moves."""
    eng = Engine(llama, seqs)
    eng.capture()
    eng.store.attach()
    old = eng.store.slab
    eng.store.slab = torch.zeros_like(old)  # what growing it would do
    chunks = [("A", 0, 3)]
    eng.replayed(chunks)
    torch.testing.assert_close(old[0, :3], eng.slots(chunks)[0])  # written where the capture wrote
    assert eng.store.slab.abs().sum() == 0


def test_a_narrow_forward_is_read_from_the_slab_whatever_its_dtype():
    """``readings`` reads a forward of up to ``fixed`` tokens from the slab: a reading in another dtype than
    the slab's is written there too (cast), and counted; a reading of another width is refused."""
    store = TapStore()
    store.n_slots, store.capacity, store.fixed = 2 * L + 1, 64, FIXED
    store.reserve(16, torch.float32, "cpu")
    store.attach()
    xs = [torch.randn(5, 16, dtype=torch.bfloat16) for _ in range(2 * L + 1)]
    for slot, x in enumerate(xs):
        store.write(slot, x, x if slot % 2 == 0 else None)
    assert bool(store.check())
    got = store.readings(L, 5)
    torch.testing.assert_close(got["pre"][1], (xs[2] + xs[2]).float())
    torch.testing.assert_close(got["attn"][0], xs[1].float())
    with pytest.raises(RuntimeError, match=r"does not fit the taps' slab"):
        store.write(0, torch.randn(3, 8))


def test_the_wide_buffers_go_when_the_last_monitor_leaves():
    """A forward wider than the slab is written into buffers grown to it (a prefill's: 144 MB on SmolLM2);
    they are kept while any monitor is entered (nested ones share the taps) and freed when the last leaves,
    so an idle engine holds the slab alone. The next wide forward grows them again, read as before."""
    store = TapStore()
    store.n_slots, store.capacity, store.fixed = 2 * L + 1, 64, FIXED
    store.reserve(16, torch.float32, "cpu")
    wide = FIXED + 5
    xs = [torch.randn(wide, 16) for _ in range(2 * L + 1)]

    def forward():
        for slot, x in enumerate(xs):
            store.write(slot, x)
        assert bool(store.check())
        return store.readings(L, wide)

    store.attach()
    store.attach()  # a monitor nested in the first
    forward()
    assert len(store.wide) == 2 * L + 1
    store.detach()
    assert len(store.wide) == 2 * L + 1  # the outer one is still entered
    store.detach()
    assert store.wide == {} and store.slab is not None  # the slab stays: a graph holds its address
    store.attach()
    got = forward()
    torch.testing.assert_close(got["attn"][1], xs[3])
    torch.testing.assert_close(got["post"][L - 1], xs[2 * L])

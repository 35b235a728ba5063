"""The running sums: what every counted forward added, the open sequences, the decoding-step buffer.

``Accumulator.add`` takes one forward's ``ForwardSums`` and returns an ``Undo`` that takes it back
whole (a sink that fails after it, docs/api.md "A forward's life"). One-token decoding steps are
buffered and reduced together, every layer in one stacked flush once every layer's step is in. A
sequence stays one cluster across the forwards of a KV cache: its per-row counters stay open
until it ends (``end_sequences``). Every state is a dict of float64-able sums in
``measures.zero_state``'s layout, so states merge by addition and all_reduce sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import stats
from .forward import ForwardSums, LayerSums, Step, fold_copies
from .measures import Sizes, fold_rows, running_fields, zero_state
from .plan import Plan
from .reduce import reduce_many
from .reduce.batched import Stacks, project_steps
from .verdict.sample import Sample, content_ids

BUFFER_TOKENS = 256  # one-token steps reduced together; bounds the buffer's memory


@dataclass
class Undo:
    """Everything ``add`` may change, as it was before (the state's tensors are replaced, never written)."""

    n_forwards: int
    state: dict[int, dict[str, torch.Tensor]]
    zero: set[int]
    rows: dict[int, torch.Tensor]
    buf: list
    seen: dict
    n_token_records: int
    keyed: dict
    krows: dict
    free: list
    sample: dict | None = None  # the candidates ``Sample.add`` kept (taken back by ``Sample.undo``)
    ids: tuple = ()  # (open rows' sequence ids, open requests' ids)


class Accumulator:
    """The running state of every measured layer of a ``Plan``."""

    def __init__(self, plan: Plan, config=None):
        self.plan = plan
        R = config.verdict_tokens if config is not None and "mid" in config.reading_points else 0
        self.sample = Sample(R) if R else None  # the verdict's kept tokens (``verdict.sample``)
        self.sample_seed = config.sample_seed if config is not None else 0
        self.open_ids: torch.Tensor | None = None  # the open rows' sequence ids (device, int64)
        self.request_ids: dict = {}  # a flat batch's open request key -> its sequence id (a device scalar)
        self.verdict_cache: tuple = (None, None)  # (sample version and settings, {(layer, blocks): columns})
        self.sample_version = 0
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        for i, lp in plan.layers.items():
            b = lp.bases
            self.state[i] = zero_state(layer_sizes(i, b), b.measures)
        self.zero = set(plan.layers)  # layers whose state is still zeros: replaced, not added to, at first
        self.rows: dict[int, torch.Tensor] = {}  # open sequences' per-row counters (b, len(measures.ROW), T)
        self.buf: list[Step] = []  # buffered one-token steps, one a forward
        self.buf_shapes: tuple = ()  # the buffered steps' grid shapes
        self.buf_rows = 0  # rows of a buffered step
        self.seen: dict = {}  # stack -> (b, 1) valid tokens the open sequences have counted
        self.n_forwards = 0
        self.token_records: list[dict] = []
        self.stacks = Stacks()  # each layout's bases stacked over its layers, for the flush (``project_steps``)
        self.keyed: dict = {}  # a flat batch's open request key -> its slot in ``krows``
        self.krows: dict[int, torch.Tensor] = {}  # layer -> (slots, len(measures.ROW), T) open requests' counters
        self.free: list[int] = []  # slots of ended requests, to reuse

    # ---- a forward ----
    def add(self, fs: ForwardSums, undoable: bool = True) -> Undo | None:
        """Count one forward whole; returns what undoes it (``undoable``: something after it may fail, a
        sink; else None, and no copy is made: a decoding step pays nothing for it). A forward that starts
        new sequences ends the open ones first (here, when it counts, not when it starts: forwards of
        other threads may have counted in between, and their sequences are not its own)."""
        undo = None
        if undoable:
            undo = Undo(
                self.n_forwards, {i: dict(st) for i, st in self.state.items()}, set(self.zero), dict(self.rows),
                list(self.buf), dict(self.seen), len(self.token_records), dict(self.keyed), dict(self.krows),
                list(self.free), None, (self.open_ids, dict(self.request_ids)),
            )  # fmt: skip
        if fs.fresh:
            self.end_sequences()
        if fs.sequences is not None:
            fs.sequences.counted(self)
        if self.sample is not None and fs.cands is not None:
            u = self.sample.add(fs.cands, undoable)  # kept as they came, merged once R/4 wait
            if undo is not None:
                undo.sample = u
            self.sample_version += 1
        if fs.layers:
            self._add_layers(list(fs.layers.items()), fs.keys)
        if fs.own:  # a researcher's measures' sums, taken in the forward (a decoding step's too)
            self._add_layers([(i, LayerSums(s, None)) for i, s in fs.own.items()])
        self._buffer(fs.step, fs.shapes)
        self.seen.update(fs.seen)
        if fs.token_records:
            self.token_records.extend(fs.token_records)
        self.n_forwards += 1
        return undo

    def undo(self, u: Undo) -> None:
        self.n_forwards, self.state, self.zero, self.rows = u.n_forwards, u.state, u.zero, u.rows
        self.buf, self.seen = u.buf, u.seen
        self.keyed, self.krows, self.free = u.keyed, u.krows, u.free
        del self.token_records[u.n_token_records :]
        if self.sample is not None and u.sample:
            self.sample.undo(u.sample)
            self.sample_version += 1
        if u.ids:
            self.open_ids, self.request_ids = u.ids

    def _buffer(self, step: Step | None, shapes: tuple) -> None:
        """Keep a forward's one-token step as it is (one append; no work per layer), and flush every layer
        at once when the buffer is full or the steps' shapes change (a flush taken before every layer's
        step is in would split the stack in two). ``shapes``: the step's grid shapes."""
        if step is None:
            return
        if self.buf and shapes != self.buf_shapes:
            self.flush()
        if not self.buf:
            self.buf_shapes, self.buf_rows = shapes, step.grids[0].mask.shape[0]
        self.buf.append(step)
        if len(self.buf) * self.buf_rows >= BUFFER_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Reduce the buffered one-token steps of every layer, stacked (``reduce.batched.project_steps``)."""
        if not self.buf:
            return
        buffered, self.buf = self.buf, []
        bases = {i: lp.bases for i, lp in self.plan.layers.items()}
        prs = project_steps(buffered, bases, self.stacks)
        done = reduce_many([(bases[i], pr) for i, pr in prs])
        c = buffered[0].copies
        self._add_layers([(i, LayerSums(d[0], fold_copies(d[1], c))) for (i, _), d in zip(prs, done)])

    def _add_layers(self, results: list[tuple[int, LayerSums]], keys: tuple | None = None) -> None:
        """Add layers' sums into the running state: every (layer, field) sum in one ``torch._foreach_add``
        per device and dtype, not one add each (one launch for the lot on CUDA). keys: a flat batch's
        request keys, one a row: its counters go to those requests' slots (``end_requests``)."""
        olds, news, where = [], [], []
        for layer, (sums, _) in results:
            st = self.state[layer]
            if layer in self.zero:  # nothing counted yet: the first sums are the state
                self.zero.discard(layer)
                self.state[layer] = {**st, **sums}
                continue
            for k, v in sums.items():
                olds.append(st[k].to(v.device))
                news.append(v)
                where.append((layer, k))
        for (layer, k), t in zip(where, foreach_sum(olds, news)):
            self.state[layer] = {**self.state[layer], k: t}
        if keys is not None:
            self._add_keyed(results, keys)
            return
        olds, news, where = [], [], []
        for layer, (_, rows) in results:
            if rows is None:
                continue
            open_rows = self.rows.get(layer)
            if open_rows is not None and open_rows.shape[0] != rows.shape[0]:
                self._fold_open(layer)
                open_rows = None
            if open_rows is None:
                self.rows[layer] = rows
            else:
                olds.append(open_rows)
                news.append(rows)
                where.append(layer)
        for layer, t in zip(where, foreach_sum(olds, news)):
            self.rows[layer] = t

    def _add_keyed(self, results: list[tuple[int, LayerSums]], keys: tuple) -> None:
        """A flat batch's per-row counters added to its requests' slots (a new request takes a free one)."""
        keyed, slots = self.keyed, []
        for key in keys:
            slot = keyed.get(key)
            if slot is None:
                slot = keyed[key] = self.free.pop() if self.free else len(keyed)
            slots.append(slot)
        need, idx = max(slots) + 1, {}
        for layer, (_, rows) in results:
            if rows is None:
                continue
            kr = self.krows.get(layer)
            if kr is None or kr.shape[0] < need:
                grown = rows.new_zeros(max(need, 2 * (0 if kr is None else kr.shape[0])), *rows.shape[1:])
                kr = grown if kr is None else grown.index_copy(0, torch.arange(kr.shape[0], device=kr.device), kr)
            if rows.device not in idx:  # the slots go to the device once a forward (the keys are the host's)
                idx[rows.device] = torch.tensor(slots, device=rows.device)
            self.krows[layer] = kr.index_add(0, idx[rows.device], rows)

    # ---- sequences ----
    def sequences(self, fresh: bool, flat=None, copies: int = 1) -> Sequences | None:
        """What a forward's rows are, as the forward starts (None: no verdict sample is kept): new sequences (a fresh
        forward's rows, a flat batch's new requests), whose ids the forward makes from their content, or open ones,
        whose ids were kept when they started (``Sequences.counted``)."""
        if self.sample is None:
            return None
        known = [self.request_ids.get(k) for k in flat.keys] if flat is not None else None
        return Sequences(self.sample.R, self.sample_seed, fresh, copies, None if fresh else self.open_ids, known,
                         flat.keys if flat is not None else None)  # fmt: skip

    def end_requests(self, keys) -> None:
        """A flat batch's requests ended (the engine's scheduler says so): their counters fold into the
        cluster sums, as ``end_sequences`` folds a padded batch's rows, and their slots are freed."""
        for k in keys:
            self.request_ids.pop(k, None)
        ended = [(k, self.keyed.pop(k)) for k in keys if k in self.keyed]
        if not ended:
            return
        slots = [s for _, s in ended]
        picked, idx = self._pick(slots)
        groups: dict[tuple, list[int]] = {}
        for layer, kr in self.krows.items():
            groups.setdefault((kr.shape, kr.device), []).append(layer)
        for (_, device), layers in groups.items():
            rows = torch.stack([picked[i] for i in layers])
            for i, st in zip(layers, fold_rows([self.state[i] for i in layers], rows)):
                self.state[i] = st
                self.krows[i] = self.krows[i].index_fill(0, idx[device], 0)
        self.free.extend(slots)

    def open_requests(self, keys=None) -> dict[str, torch.Tensor]:
        """Each open request's own counters so far (``request_counters``), by key: those of ``keys`` that
        are open (None: every open one)."""
        keys = list(self.keyed) if keys is None else [k for k in dict.fromkeys(keys) if k in self.keyed]
        if not keys:
            return {}
        picked, _ = self._pick([self.keyed[k] for k in keys])
        return dict(zip(keys, self.request_counters(picked, len(keys))))

    def _pick(self, slots: list[int]) -> tuple[dict[int, torch.Tensor], dict]:
        """Each layer's counters of the requests at ``slots`` (slots, len(measures.ROW), T), and the slots as
        an index on each device (made once a device)."""
        idx: dict = {}
        picked = {}
        for i, kr in self.krows.items():
            if kr.device not in idx:
                idx[kr.device] = torch.tensor(slots, device=kr.device)
            picked[i] = kr.index_select(0, idx[kr.device])
        return picked, idx

    def request_counters(self, picked: dict[int, torch.Tensor], n: int) -> torch.Tensor:
        """``n`` requests' counters picked from each layer (``_pick``) as one (requests, layers,
        len(measures.ROW), T) tensor, float64 on the host, the plan's layers in order (zeros at a layer that
        counted none of their tokens)."""
        per = [picked.get(i) for i in sorted(self.plan.layers)]
        shape = next((p.shape for p in per if p is not None), None)
        if shape is None:
            return torch.zeros(n, len(per), 0, 0, dtype=torch.float64)
        zero = torch.zeros(shape, dtype=torch.float64)
        return torch.stack([zero if p is None else p.to("cpu", torch.float64) for p in per], 1)

    def _fold_open(self, layer: int) -> None:
        rows = self.rows.pop(layer, None)
        if rows is not None:
            self.state[layer] = fold_rows([self.state[layer]], rows[None])[0]

    def end_sequences(self) -> None:
        """The open sequences ended: fold their per-row counters into the cluster sums.

        Layers whose counters have one shape and device are folded together, in one op each."""
        self.flush()
        self.seen = {}
        groups: dict[tuple, list[int]] = {}
        for layer, rows in self.rows.items():
            groups.setdefault((rows.shape, rows.device), []).append(layer)
        for layers in groups.values():
            rows = torch.stack([self.rows.pop(i) for i in layers])
            for i, st in zip(layers, fold_rows([self.state[i] for i in layers], rows)):
                self.state[i] = st

    # ---- reading the state ----
    def current(self, layer: int) -> dict[str, torch.Tensor]:
        """This layer's state with the still-open sequences folded in, float64 on the CPU; buffered steps
        are reduced first (``flush``), so a reader and a forward's end reach the state by one door."""
        self.flush()
        st = self.state[layer]
        rows = self.rows.get(layer)
        if rows is not None:
            st = fold_rows([st], rows[None])[0]
        kr = self.krows.get(layer)
        if kr is not None and self.keyed:  # open requests of a flat batch
            idx = torch.tensor(list(self.keyed.values()), device=kr.device)
            st = fold_rows([st], kr.index_select(0, idx)[None])[0]
        return {k: v.detach().to("cpu", torch.float64) for k, v in st.items()}

    def verdict(self, config, blocks: dict[int, int] | None = None) -> dict[int, list[dict]]:
        """Each layer's targets' verdict columns (``verdict.layer_columns``), on ``blocks[layer]`` blocks of draws
        (1 where not given), each computed once per state of the sample and settings. A sample held in another
        process (``RemoteSample``) has them computed there."""
        key = (self.sample_version, id(self.sample), config.verdict_draws, config.sample_seed, config.null_seed)
        if self.verdict_cache[0] != key:
            self.verdict_cache = (key, {})
        cache = self.verdict_cache[1]
        if isinstance(self.sample, RemoteSample):
            want = {i: (blocks or {}).get(i, 1) for i in self.plan.layers}
            if any((i, b) not in cache for i, b in want.items()):
                for i, cols in self.sample.columns(blocks or {}).items():
                    cache[(i, want[i])] = cols
            return {i: cache[(i, b)] for i, b in want.items()}
        targets = {i: lp.targets for i, lp in self.plan.layers.items()}
        return layer_verdicts(self.sample, targets, config, blocks, cache)

    def kept(self, config) -> KeptVerdict:
        """What the verdict's columns are computed from (the sample and each layer's targets), to keep once the
        sums are no longer needed (an engine's stopped session, whose monitor may still ask for its table)."""
        return KeptVerdict(self.sample, {i: lp.targets for i, lp in self.plan.layers.items()}, config)

    def running(self) -> list[list[torch.Tensor]]:
        """Each layer's fields that the sinks' running values read (``measures.running_fields``), in layer
        order, on their devices (buffered steps reduced first, as ``current``)."""
        self.flush()
        return [[self.state[i][k].detach() for k in running_fields()] for i in sorted(self.plan.layers)]

    def replace(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """The state becomes ``states`` (a loaded one); nothing open or buffered is kept."""
        self.zero.clear()
        self.rows, self.buf = {}, []
        self.keyed, self.krows, self.free = {}, {}, []
        self.state = dict(states)

    def merge(self, states: dict[int, dict[str, torch.Tensor]], sample: Sample | None = None) -> None:
        """Add a state of the same layout (``stats.merge_states``), and take its verdict sample's tokens."""
        self.zero.clear()
        self.state = {i: stats.merge_states(self.state[i], states[i]) for i in self.state}
        if self.sample is not None and sample is not None:
            self.local_sample().merge(sample)
            self.sample_version += 1

    def local_sample(self) -> Sample:
        """The sample, brought into this process if another one holds it (a merge needs its tokens here)."""
        if isinstance(self.sample, RemoteSample):
            self.sample = Sample.from_dict(self.sample.fetch(), self.sample.R)
            self.sample_version += 1
        return self.sample

    def replace_sample(self, sample: Sample | RemoteSample | None) -> None:
        """The verdict sample becomes ``sample`` (a loaded state's, or one held in another process)."""
        if self.sample is not None:
            self.sample = sample if sample is not None else Sample(self.sample.R)
            self.sample_version += 1

    def all_reduce(self, dist, group) -> None:
        """Sum the whole state across the ranks of ``group`` (open sequences and requests end first)."""
        self.end_sequences()
        self.end_requests(list(self.keyed))
        backend = dist.get_backend(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        parts = [(i, k, v) for i in sorted(self.state) for k, v in sorted(self.state[i].items())]
        flat = torch.cat([v.detach().reshape(-1).to(dev, torch.float64) for _, _, v in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if self.sample is not None:
            self.local_sample().all_gather(dist, group, dev)
            self.sample_version += 1
        at = 0
        for i, k, v in parts:
            n = v.numel()
            self.state[i] = {**self.state[i], k: flat[at : at + n].reshape(v.shape).to(v.device)}
            at += n


def layer_verdicts(sample: Sample | None, targets: dict[int, list], config, blocks, cache: dict) -> dict[int, list]:
    """``Accumulator.verdict``'s columns from a sample and each layer's targets; ``cache``: {(layer, blocks): columns}
    of this sample and settings, and {("first", layer): its first block's null scores}, filled here."""
    from .plan import seed
    from .verdict import layer_columns

    host = sample.host if sample is not None else (lambda i: None)
    out = {}
    for i, tg in targets.items():
        b = (blocks or {}).get(i, 1)
        if (i, b) not in cache:
            first = cache.setdefault(("first", i), {})  # the first block's scores: an extension adds blocks to them
            cache[(i, b)] = layer_columns(host(i), tg, config, seed(config, i, 2000), blocks=b, first=first)
        out[i] = cache[(i, b)]
    return out


@dataclass
class KeptVerdict:
    """A stopped record's verdict: its sample and each layer's targets, without the sums or the plan's frames
    (``Accumulator.kept``)."""

    sample: Sample | None
    targets: dict[int, list]
    config: object
    cache: dict = field(default_factory=dict)

    def verdict(self, blocks: dict[int, int] | None = None) -> dict[int, list[dict]]:
        return layer_verdicts(self.sample, self.targets, self.config, blocks, self.cache)


@dataclass
class RemoteSample:
    """The verdict's kept tokens held in another process (an engine's worker), which computes their columns there,
    so they never cross whole to read a table: ``columns(blocks)`` gives ``Accumulator.verdict``'s result for
    ``blocks`` computed there; ``fetch()`` the sample itself as raw bytes (``Sample.to_dict(raw=True)``), asked
    for only when the whole state is (``Monitor.state_dict``) or the tokens are needed here (``local_sample``)."""

    R: int
    columns: Callable[[dict[int, int]], dict[int, list[dict]]]
    fetch: Callable[[], dict]

    def to_dict(self) -> dict:
        """``Sample.to_dict``'s JSON-able form of the tokens held there."""
        from .verdict.sample import as_text

        return as_text(self.fetch())


@dataclass
class Sequences:
    """The sequence ids of one forward's rows (``verdict.sample``): new rows get their content's id (``ids``), open
    ones the id they started with. R and seed: the verdict sample's size and seed.

    fresh: the forward starts new sequences (copies of one input row share the first copy's id). open_ids: the open
    rows' ids (a continuing forward). known: a flat batch's rows' stored ids (None: a new request). keys: its
    request keys."""

    R: int
    seed: int
    fresh: bool
    copies: int = 1
    open_ids: torch.Tensor | None = None
    known: list | None = None
    keys: tuple | None = None
    made: torch.Tensor | None = None  # the ids the forward used (``ids``)

    def ids(self, x: torch.Tensor, grid) -> torch.Tensor:
        """(b,) int64 on x's device: each row's id, made once a forward (at its first measured layer's pre x)."""
        if self.made is not None and self.made.shape[0] == x.shape[0]:
            return self.made
        b = x.shape[0]
        if self.known is not None:  # a flat batch: new requests by content, the others as they started
            new = content_ids(x, grid.mask, grid.vi) if any(t is None for t in self.known) else None
            ids = torch.stack([new[r] if t is None else t.to(x.device) for r, t in enumerate(self.known)])
        elif self.fresh or self.open_ids is None or self.open_ids.shape[0] != b:
            ids = content_ids(x, grid.mask, grid.vi)
            if self.copies > 1:  # the first copy's id for every copy (the others' prompt is masked out)
                ids = ids.view(-1, self.copies)[:, :1].expand(-1, self.copies).reshape(-1)
        else:
            ids = self.open_ids.to(x.device)
        self.made = ids
        return ids

    def counted(self, acc: Accumulator) -> None:
        """The forward counts: a fresh one's rows are the open sequences now; a flat batch's new requests keep theirs."""
        if self.made is None:
            return
        if self.known is not None:
            for row, (key, t) in enumerate(zip(self.keys, self.known)):
                if t is None:
                    acc.request_ids[key] = self.made[row]
        elif self.fresh:
            acc.open_ids = self.made


def foreach_sum(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """[a[i] + b[i]], in order, with one ``torch._foreach_add`` per (device, dtype) of b (a foreach op
    takes one of each), not one add per pair."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(b):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list = [None] * len(b)
    for idx in groups.values():
        for i, t in zip(idx, torch._foreach_add([a[i] for i in idx], [b[i] for i in idx])):
            out[i] = t
    return out


def layer_sizes(i: int, b) -> Sizes:
    """Layer i's state sizes from its ``LayerBases``."""
    draws = {m.name: m.draws(b.frames[m.name]) for m in b.measures if m.name in b.frames}
    return Sizes(i, b.T, len(b.ks), max(b.eig_slots, 0), b.d, draws)

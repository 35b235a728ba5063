"""One forward's scratch: its readings, its grids, its projections, and at its end its sums.

A ``Forward`` is made when the model's forward starts and dropped when it ends. The taps hand it
each reading (``read``); once a layer's readings are all in it is projected (``reduce.project``)
while its activations are hot, or, for a one-token decoding step, kept for the accumulator's
batched flush. ``finish`` reduces every layer at once (``reduce.reduce_many``) and returns a
``ForwardSums``. A forward that raised is dropped whole (``drop``): nothing of it counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

import torch

from ..models.attach import FlatRows
from ..models.base import as_tokens
from . import stats
from .config import POINTS
from .measures.own import of_plan, own_sums, readings
from .plan import LayerPlan, Plan
from .reduce import Grid, Projection, project, reduce_many
from .reduce.grid import Count, as_tensor
from .verdict.sample import ForwardCandidates

_shape = attrgetter("shape")


class LayerSums(NamedTuple):
    """One layer's sums of one forward (``measures.zero_state``'s layout) and its per-row counters (b, len(measures.ROW), T)."""

    sums: dict[str, torch.Tensor]
    rows: torch.Tensor | None


class Slots(NamedTuple):
    """Where one layer's readings sit in its ``Step``: indices into its ``xs``, its grid's into its ``grids``.

    mid: an index, or (pre, attn) for a parallel block whose mid is their sum (made once at the flush,
    elementwise: the same bits), or None; post and base (LN_t(pre) of a post-norm layer): an index or None.
    """

    layer: int
    pre: int
    mid: int | tuple | None
    post: int | None
    base: int | None
    grid: int


class Step(NamedTuple):
    """A one-token decoding step's readings, kept for the accumulator's batched flush
    (``reduce.batched.project_steps``): nothing is projected per layer in the step.

    order: each layer's ``Slots``, in the order the layers completed; the steps whose readings came
    whole and alike share one order object (``lean_order``). xs: the readings, each once (post(t) is
    pre(t+1)). grids: the grids its layers use. copies: rows that are copies of one input row (beams):
    their counters are summed.
    """

    order: tuple
    xs: list
    grids: tuple
    copies: int = 1


LEAN_POINTS = ("pre", "attn", "mid", "post")  # what ``lean_order`` lays out


def lean_layout(plan: Plan, once: dict, n_slots: int, untapped: frozenset) -> bool:
    """Whether a one-token step may keep its readings as they come (``Forward.lean_start``): every tapped
    module is called once a forward (``once``: their role lists, of ``n_slots`` tapped modules), every
    layer is read alike (pre-norm, masked, one stack), and a step whose taps all fired has each layer's
    pre, last point, mid if needed and attention (tapped, or ``untapped`` and found in place)."""
    if len(once) != n_slots or len({lp.stack for lp in plan.layers.values()}) > 1:
        return False
    read = {role for roles in once.values() for role in roles}
    if any(point not in LEAN_POINTS for _, point in read):  # a reading the flush would not lay out
        return False
    return all(
        lp.post_norm is None and lp.masked and (i, "pre") in read and (i, lp.last_point) in read
        and (not lp.need_mid or (i, "mid") in read) and ((i, "attn") in read or i in untapped)
        for i, lp in plan.layers.items()
    )  # fmt: skip


def lean_order(plan: Plan, roles: list, read_mid: bool, ran: frozenset) -> tuple | None:
    """Per layer, in the order the layers complete, its ``Slots`` among a step's readings as they came (one
    grid), taking each layer's points as ``Forward.read`` would at its last point; None if a layer would be
    missing or partial there."""
    idx, out = {}, []
    for j, rs in enumerate(roles):
        for layer, point in rs:
            if (layer, point) in idx:
                return None
            idx[layer, point] = j
            lp = plan.layers[layer]
            if point != lp.last_point:
                continue
            if (layer, "pre") not in idx or ((layer, "attn") not in idx and layer not in ran):
                return None
            mid = None
            if read_mid:
                key = (layer, "attn") if lp.mid_is_sum else (layer, "mid")
                if key not in idx:
                    return None
                mid = (idx[layer, "pre"], idx[key]) if lp.mid_is_sum else idx[key]
            out.append(Slots(layer, idx[layer, "pre"], mid, idx.get((layer, "post")), None, 0))
    return tuple(out) if len(out) == len(plan.layers) else None


class Call(NamedTuple):
    """What a forward is, as the monitor knows at its start.

    fresh: it starts new sequences (else it continues the open ones: a KV-cache step, or a step of
    ``generate`` that recomputes the whole sequence). start: positions already counted, left out
    (that recomputation). copies: consecutive rows that are copies of one input row (``generate``
    with beams or several returned sequences): one cluster. first_copy_only: only the first copy's
    tokens count (the prompt, identical in every copy).
    """

    fresh: bool = True
    start: int = 0
    copies: int = 1
    first_copy_only: bool = False


@dataclass
class ForwardSums:
    """What one forward adds: each projected layer's sums, its one-token layers' readings (a ``Step``), and
    the open sequences' valid-token counts once it is counted (per stack)."""

    layers: dict[int, LayerSums] = field(default_factory=dict)
    step: Step | None = None  # its one-token layers' readings, for the accumulator's batched flush
    fresh: bool = True  # it starts new sequences: the open ones end before it counts
    seen: dict = field(default_factory=dict)  # stack -> (b, 1) valid tokens of each open sequence so far
    token_records: list[dict] = field(default_factory=list)  # per-token records (``tokens=True``)
    shapes: tuple = ()  # (stack, (b, n), device) of each Grid it made: its steps' shapes
    keys: tuple | None = None  # a flat batch's request keys, one a row: its rows stay open by key
    own: dict = field(default_factory=dict)  # layer -> the researcher's measures' sums (``measures.own``)
    cands: object = None  # the verdict's candidates (``verdict.Candidates``, or a list: one a grid), or None
    sequences: object = None  # its rows' sequence ids (``Accumulator.sequences``)


@dataclass
class Generation:
    """A ``generate`` call of a decoder, running in one thread: what each of its forwards is.

    Its first forward starts the sequences; the others continue them, with a KV cache (new positions
    only) or without one (the whole sequence again: only its new positions count). Beams and returned
    sequences are copies of the input rows: one cluster per input row, the prompt counted once.
    """

    rows: int | None  # the input rows it was given
    steps: int = 0  # forwards so far
    copies: int = 1  # rows per input row in its forwards
    positions: int = 0  # positions its sequences have so far

    def next_call(self, b: int, n: int, fresh: bool) -> Call:
        """The ``Call`` of its next forward, of b rows and n positions (``fresh``: no KV cache continued)."""
        self.steps += 1
        if self.steps == 1:
            self.copies = b // self.rows if self.rows and b > self.rows and b % self.rows == 0 else 1
            self.positions = n
            return Call(True, 0, self.copies, True)
        start = self.positions if fresh else 0
        self.positions = n if fresh else self.positions + n
        return Call(False, start, self.copies, False)


class Forward:
    """One forward's captures, grids and projections.

    Args:
        plan: what is measured. points: the reading points.
        mask: the forward's (b, n) attention mask, or None (every token counts).
        seen: stack -> (b, 1) valid tokens the open sequences had before this forward (a KV cache).
        buffer_steps: keep one-token layers' readings for a batched flush (no per-forward sink, no tokens).
        tokens: record per-token alignments (``MonitorConfig.tokens``). index: this forward's number (for token records).
        all_valid: the monitor's one all-True (b, n) mask of the latest shape, reused across forwards
            (never written), so a decoding step with no mask makes none.
        call: what this forward is (``Call``).
        attn_ran: layers whose attention has no tap (``Attachment.untapped``) and was found in place:
            they count as if its tap had fired.
        flat: a flat batch's layout (``FlatRows``): its readings (tokens, d) are laid out as a padded
            batch, a row a request, each token at its rank among its request's tokens in this forward,
            indexed by the position the engine gave (``flat_grid``).
    """

    def __init__(
        self,
        plan: Plan,
        points,
        mask,
        seen: dict,
        buffer_steps: bool,
        tokens: bool,
        index: int,
        all_valid: list,
        call: Call = Call(),
        attn_ran: frozenset = frozenset(),
        flat: FlatRows | None = None,
        sequences=None,
    ):
        self.attn_ran = attn_ran
        self.sequences = sequences  # its rows' sequence ids (``Accumulator.sequences``), or None: no verdict sample
        self.kept_tokens = ForwardCandidates(sequences) if sequences is not None else None
        self.flat = flat
        self._padded: dict[int, tuple] = {}  # id(flat reading) -> (it, padded): post(t) is pre(t+1)
        self.flat_place, self.flat_grid = flat_grid(flat) if flat is not None else (None, None)
        self.plan, self.read_mid, self.all_valid, self.call = plan, "mid" in points, all_valid, call
        self.mask, self.seen = mask, seen
        self.buffer_steps, self.tokens, self.index = buffer_steps, tokens, index
        self.stack_masks: dict[str, torch.Tensor | None] = {}  # the mask passed to each stack that ran
        self.ran: set[str] = set()  # stacks (Adapter.stacks) whose root ran in this forward
        self.captures: dict[int, dict[str, torch.Tensor | None]] = {}  # layer -> point -> reading
        self.grids: dict[tuple, Grid] = {}  # the valid tokens of this forward, per stack and shape
        self.memo: dict = {}  # norms and consensus sums of this forward's readings (reduce.Memo)
        self.projections: dict[int, Projection] = {}
        self.kept: list[Slots] = []  # one-token layers kept for the flush (``_keep``), their readings and grids:
        self.kept_xs, self.kept_grids, self._kept_at = [], [], {}  # each once (id -> index in its list)
        self.token_records: list[dict] = []
        self.lean: tuple | None = None  # a one-token step's ([roles], [readings]) as they come (``lean_start``)
        self.lean_step: Step | None = None  # a one-token step kept as its readings came (``_settle``)
        self.own = of_plan(plan)  # a researcher's measures: their sums taken per layer, from the readings
        self.own_sums: dict[int, dict[str, torch.Tensor]] = {}

    def lean_start(self, untapped: int, once_ids: frozenset, known: list) -> None:
        """This forward computes one token a row (the taps saw its input), every tapped module is called
        once a forward, and layer by layer nothing is computed at the step: its readings are kept as they
        come, checked and laid out once at its end (``_settle``). untapped: attentions without a tap (all
        must have been found in place). once_ids: the taps' role lists. known: [roles, order] last seen."""
        if self.buffer_steps and not self.tokens and not self.call.fresh and not self.call.start and not self.own:
            if len(self.attn_ran) == untapped:
                self.lean, self._lean_of = ([], []), (once_ids, known)

    def _settle(self) -> None:
        """The step's readings whole and once each, in a known order: one ``Step`` as they came; else each read
        again, in the order they came, as if read one by one (the general path)."""
        roles, xs = self.lean
        self.lean = None
        once_ids, known = self._lean_of
        if known[0] is not None and roles == known[0]:
            order = known[1]
        else:
            order = None
            if len(roles) == len(once_ids) and {id(r) for r in roles} == once_ids:
                order = lean_order(self.plan, roles, self.read_mid, self.attn_ran)
            if order is not None:
                known[:] = [roles, order]
        if order is not None and xs:
            s = xs[0].shape
            if len(s) == 3 and s[1] == 1 and len(set(map(_shape, xs))) == 1:  # no Python frame a reading
                grid = self._grid(xs[0], self.plan.layers[order[0].layer].stack)
                self.lean_step = Step(order, xs, (grid,), self.call.copies)
                if self.kept_tokens is not None and self.read_mid:
                    self.kept_tokens.take_step(self.lean_step, self.plan)
                return
        for rs, x in zip(roles, xs):
            for layer, point in rs:
                self.read(layer, point, x)

    def stack_started(self, name: str, mask: torch.Tensor | None) -> None:
        self.ran.add(name)
        self.stack_masks[name] = mask

    def read(self, layer: int, point: str, x: torch.Tensor) -> None:
        """A reading of (layer, point). The first one counts; the layer is projected at its last point."""
        if self.flat is not None:
            x = self._unflat(x)
        if self.lean is not None:  # a one-token step: kept as it came (``_settle``)
            self.lean[0].append(((layer, point),))
            self.lean[1].append(x)
            return
        if self.call.start and x.dim() == 3:  # a step that recomputed the whole sequence: its new positions
            x = x[:, self.call.start :]
        cap = self.captures.get(layer)
        if cap is None:
            cap = self.captures[layer] = {}
        elif point in cap:
            return
        cap[point] = x
        if point == self.plan.layers[layer].last_point:
            self._project(self.plan.layers[layer], cap)
            for p in cap:  # projected: keep which points were seen, not their activations, so the
                cap[p] = None  # allocator reuses them (memory flat in layers, no fresh pages per layer)

    def _project(self, lp: LayerPlan, cap: dict) -> None:
        """The layer's readings are all in: project them (or, for a one-token step, keep them)."""
        pre = cap.get("pre")
        if pre is None or pre.dim() != 3 or pre.shape[1] == 0:
            return
        shape = pre.shape
        mid = None
        if self.read_mid and ("attn" in cap or lp.index in self.attn_ran):  # no attention step ran: no delta
            mid = pre + cap["attn"] if lp.mid_is_sum else cap.get("mid")
        post = cap.get("post")
        points = {
            "pre": pre,
            "mid": mid if mid is None or mid.shape == shape else as_tokens(mid, pre),
            "post": post if post is None or post.shape == shape else as_tokens(post, pre),
        }
        base = None
        if lp.post_norm is not None and mid is not None:
            with torch.no_grad():
                base = lp.post_norm.forward(pre)  # LN_t(pre), without running anyone's hooks
        if lp.masked:
            grid = self._grid(pre, lp.stack)
        else:  # a tower the forward's attention_mask does not describe: all its tokens count
            grid = Grid(torch.ones(shape[:2], dtype=torch.bool, device=pre.device))
        if self.own:  # a researcher's measures: the plain readings, while they are hot
            r = readings(lp.index, points, base, grid.mask, grid.vi, lp.bases.null_stride)
            self.own_sums[lp.index] = own_sums(self.own, r)
        if self.kept_tokens is not None and points["mid"] is not None:  # the verdict's candidates, while hot
            self.kept_tokens.take(grid, lp, pre, pre if base is None else base, points["mid"])
        if shape[1] == 1 and self.buffer_steps:
            self._keep(lp.index, points, base, grid)  # reduced in batches by the accumulator
            return
        # post(t) and pre(t+1) are one tensor: its norms and sums are taken once (the memo)
        whole = self.flat is None or self.flat.steps == 1  # one forward's sequences: their consensus counts
        self.projections[lp.index] = project(lp.bases, points, grid, base, consensus=whole, memo=self.memo)
        if self.tokens:
            self.token_records.extend(self._token_records(lp, points, base, grid.mask))

    def _keep(self, layer: int, points: dict, base, grid: Grid) -> None:
        """A one-token layer's readings kept for the flush: its ``Slots`` into the step's readings, each
        reading and grid held once (post(t) is pre(t+1), the layers of a stack share a grid)."""
        idx = []
        for x, into in ((points["pre"], self.kept_xs), (points["mid"], self.kept_xs), (points["post"], self.kept_xs),
                        (base, self.kept_xs), (grid, self.kept_grids)):  # fmt: skip
            if x is None:
                idx.append(None)
                continue
            j = self._kept_at.get(id(x))
            if j is None:
                j = self._kept_at[id(x)] = len(into)
                into.append(x)
            idx.append(j)
        self.kept.append(Slots(layer, *idx))

    def _unflat(self, x: torch.Tensor) -> torch.Tensor:
        """A flat reading (tokens, d) as the padded batch (rows, n, d) of ``flat_grid`` (zeros where no token)."""
        got = self._padded.get(id(x))
        if got is None:
            R, n = self.flat_grid.mask.shape
            d, layout = x.shape[-1], self.flat.layout
            if layout == "rows":  # already row-major and full: the padded batch is a view
                padded = x.view(R, n, d)
            elif layout == "steps":  # step-major and full: a transposed view
                padded = x.view(n, R, d).transpose(0, 1)
            else:
                padded = x.new_zeros(R * n, d).index_copy_(0, self.flat_place, x).view(R, n, d)
            got = self._padded[id(x)] = (x, padded)
        return got[1]

    def _grid(self, x: torch.Tensor, stack) -> Grid:
        """x's valid tokens and their indices in their sequences: made once per stack and shape in a
        forward and shared by its layers, with its null subsample."""
        if self.flat_grid is not None:
            return self.flat_grid
        key = (stack, x.shape[:2], x.device)
        if key not in self.grids:
            valid = self._valid(x, stack)
            if self.call.first_copy_only and self.call.copies > 1:
                valid = self._first_copies(valid)
            self.grids[key] = self._indexed(stack, valid)
        return self.grids[key]

    def _call_mask(self, stack):
        return self.stack_masks[stack] if stack in self.stack_masks else self.mask

    def _indexed(self, stack, mask: torch.Tensor) -> Grid:
        """``mask``'s Grid: each token's index among its sequence's valid tokens, counting the ones
        each sequence had before this forward (a KV cache's earlier positions). From the call's own
        mask where it covers them (one cumsum over it: 2 ops a decoding step), else from what the
        accumulator counted over the open sequences' forwards (no op a step where all are valid: a ``Count``).
        Device ops only."""
        b, n = mask.shape
        full = self._call_mask(stack)
        if full is not None and full.shape[0] == b and full.shape[1] > n:
            upto = full.to(mask.device).cumsum(1, dtype=torch.int64)  # valid tokens up to each position
            return Grid(mask, upto[:, -n:] - 1, after=upto[:, -1:])
        seen = self.seen.get(stack)
        if seen is None or seen.shape[0] != b or seen.device != mask.device:
            return Grid(mask)
        if n == 1 and self.all_valid and mask is self.all_valid[0]:  # a step with every row valid: its token
            c = Count.of(seen)  # is each sequence's seen-th: counted on the host (no op a step, not 4)
            return Grid(mask, c, after=Count(c.base, c.k + 1))
        return Grid(mask, as_tensor(seen) + mask.cumsum(1) - 1)

    def _valid(self, x: torch.Tensor, stack) -> torch.Tensor:
        b, n = x.shape[:2]
        m = self._call_mask(stack)
        if m is None:  # every token counts: one all-True mask per shape, shared by the layers and forwards
            old = self.all_valid[0] if self.all_valid else None
            if old is None or old.shape != (b, n) or old.device != x.device:
                self.all_valid[:] = [torch.ones(b, n, dtype=torch.bool, device=x.device)]
            return self.all_valid[0]
        if m.shape[0] != b or m.shape[1] < n:
            raise ValueError(
                f"attention mask of shape {tuple(m.shape)} does not fit activations of shape {tuple(x.shape)}"
            )
        return m[:, -n:].to(x.device).bool()  # with a KV cache only the newest positions are computed

    def _first_copies(self, valid: torch.Tensor) -> torch.Tensor:
        """``valid`` on the first copy of each input row only (the prompt of a generate with beams)."""
        c = self.call.copies
        first = torch.arange(valid.shape[0], device=valid.device).remainder_(c).eq_(0)
        return valid & first[:, None]

    def _token_records(self, lp: LayerPlan, points: dict, base, mask: torch.Tensor) -> list[dict]:
        """One record per target: each valid token's a(pre), a(mid), a(post) and, post-norm, a(LN_t(pre)),
        the baseline rho counts from (``notebook.token_frame``)."""
        mask, read = mask.cpu(), {**{p: points.get(p) for p in POINTS}, "base": base}
        out = []
        for t, meta in zip(lp.targets, lp.meta):
            U = t.U.to(points["pre"].device, torch.float32)
            rec = {"layer": lp.index, "target": meta.name, "forward": self.index, "mask": mask}
            for p, X in read.items():
                if X is not None:
                    rec[f"a_{p}"] = stats.alignment(X.float(), U).cpu()
            out.append(rec)
        return out

    # ---- the end ----
    def unmeasured(self, stacks: dict) -> tuple[list[int], list[int]]:
        """(missing, partial): layers expected in this forward that were not measured at all, and
        measured layers that lack their attention output or their mid reading."""
        if self.lean is not None:
            self._settle()
        if self.lean_step is not None:  # every layer's readings came, in a checked order
            return [], []
        plan, caps, ran, no = self.plan.layers, self.captures, self.attn_ran, {}
        expected = [i for i, lp in plan.items() if lp.stack not in stacks or lp.stack in self.ran]
        measured = self.projections.keys() | {s.layer for s in self.kept}
        missing = [i for i in expected if i not in measured]
        partial = [  # its attention output or its mid reading not seen (inline: this runs every step)
            i for i in expected if i in measured
            and (("attn" not in caps.get(i, no) and i not in ran) or (plan[i].need_mid and "mid" not in caps.get(i, no)))
        ]  # fmt: skip
        return missing, partial

    def finish(self) -> ForwardSums:
        """Every projected layer reduced at once (stacked by layout), with this forward's steps and counts."""
        if self.lean is not None:
            self._settle()
        sums = {}
        if self.projections:  # a decoding step has none: its steps are kept as they are
            layers = list(self.projections)
            done = reduce_many([(self.plan.layers[i].bases, self.projections[i]) for i in layers])
            sums = {i: LayerSums(d[0], fold_copies(d[1], self.call.copies)) for i, d in zip(layers, done)}
        seen = {stack: grid.after for (stack, _, _), grid in self.grids.items()}
        keys = self.flat.keys if self.flat is not None else None
        step = self.lean_step
        if self.kept:
            step = Step(tuple(self.kept), self.kept_xs, tuple(self.kept_grids), self.call.copies)
        shapes = tuple(self.grids)
        # one set of candidates a grid (an encoder-decoder's stacks have several): each layer merges its own grid's
        cands = self.kept_tokens.sets() if self.kept_tokens is not None else None
        return ForwardSums(
            sums, step, self.call.fresh, seen, self.token_records, shapes, keys, self.own_sums, cands, self.sequences
        )

    def drop(self) -> None:
        """The forward raised: give back the arena rows it took; nothing of it counts."""
        for pr in self.projections.values():
            if pr.slot is not None:
                pr.slot.give_back()


def flat_grid(flat: FlatRows) -> tuple[torch.Tensor, Grid]:
    """A flat batch laid out as a padded one: (place, grid). place: (tokens,) each token's flat index
    row * n + its rank among its row's tokens in this forward (n: the most tokens of a row); grid: the
    (rows, n) valid tokens, each indexed by its position in its request (the null subsample's index)."""
    row, R = flat.row.to(torch.int64), len(flat.keys)
    order = torch.sort(row, stable=True).indices  # the tokens grouped by row, each row's in its order
    counts = torch.bincount(row, minlength=R)  # (R,) tokens of each row
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(row).index_copy_(
        0, order, torch.arange(row.numel(), device=row.device) - starts[row[order]]
    )
    n = flat.width or int(counts.max())
    place = row * n + rank  # (tokens,)
    mask = torch.zeros(R * n, dtype=torch.bool, device=row.device)
    if flat.valid is None:
        mask.index_fill_(0, place, True)
    else:  # readings the taps did not write (said on the device): none of those tokens count
        mask.index_copy_(0, place, flat.valid.to(mask.device, torch.bool).expand(place.shape[0]))
    vi = torch.zeros(R * n, dtype=torch.int64, device=row.device).index_copy_(0, place, flat.position.to(torch.int64))
    return place, Grid(mask.view(R, n), vi.view(R, n))


def fold_copies(rows: torch.Tensor | None, copies: int) -> torch.Tensor | None:
    """Per-row counters (b, len(measures.ROW), T) of rows that are copies of one input row, summed per input row."""
    if rows is None or copies == 1:
        return rows
    return rows.view(rows.shape[0] // copies, copies, *rows.shape[1:]).sum(1)

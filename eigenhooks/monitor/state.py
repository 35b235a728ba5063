"""The monitor's accumulated state: bases and reducers per layer, the sums of every forward, results.

A mixin of ``Monitor`` (hooks.py attaches the hooks and captures the readings): spectra and
null frames per layer (``_prepare``), the reduction of a finished forward (all layers at once,
``reducer.reduce_many``), single-position forwards buffered and reduced together, the
per-sequence counters, and everything that reads or moves the state: ``summary``, ``stats``,
``save``, ``state_dict`` / ``load_state_dict`` / ``merge_state_dict`` and ``all_reduce``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.base import as_tokens
from ..spectra.compute import layer_stacked, parallel_map, spectra_by_rank
from . import fingerprint as FP
from . import stats as M
from .reduce import Grid, LayerReducer, pad_to_stack, reduce_many, warm

BUFFER_TOKENS = 256  # single-position forwards reduced together; bounds the buffer's memory


class MonitorState:
    """The statistics half of ``Monitor`` (see hooks.py for the attributes it sets)."""

    # ---- bases ----

    def _prepare(self) -> None:
        """Spectra (cached), bases, nulls and reducers for every layer."""
        if self._layers:
            return
        ad = self.adapter
        top = max(4, 2 * self.m)
        wanted: dict[str, list[str]] = {}  # variant -> ranking rules: one eigen-decomposition a layer for all
        for _name, variant, rank, _per in self.target_defs:
            ranks = wanted.setdefault(variant or "ov", [])
            if (rank or "modulus") not in ranks:
                ranks.append(rank or "modulus")
        specs = {
            (variant, rank): layer_specs
            for variant, ranks in wanted.items()
            for rank, layer_specs in spectra_by_rank(ad, variant, tuple(ranks), top=top).items()
        }
        # each layer's bases and null frames, layers side by side (torch releases the GIL); an offloaded
        # model's layers are brought in one at a time, in order
        offloaded = any(p.device.type == "meta" for p in ad.model.parameters())
        built = parallel_map(lambda i: self._build_layer(i, specs), range(ad.n_layers), serial=offloaded)
        for i, layer in enumerate(built):
            if layer is None:
                continue
            tgts, meta, red = layer
            self._layers[i] = {"targets": tgts, "meta": meta, "reducer": red, "rp": ad.reading_points(i)}
            self._state[i] = M.zero_state(len(tgts), len(red.ks), self.K, max(red.m, 0), red.Kf)
            self._zero.add(i)  # replaced, not added to, by the first forward: no zeros copied to the device
        where = {id(info["reducer"]): _where(ad, i) for i, info in self._layers.items()}
        on_cuda = bool(where) and all(w is not None and w[0].type == "cuda" for w in where.values())
        reducers = [info["reducer"] for info in self._layers.values()]
        self._arenas = pad_to_stack(reducers, widen_frames=on_cuda)  # one kind reduces together
        warm(self._arenas, {r: w for r, w in where.items() if w is not None})

    def _build_layer(self, i: int, specs: dict):
        """Layer i's targets, their metadata and its reducer (bases, Haar and F-null frames); None if no target."""
        ad = self.adapter
        tgts, meta = [], []
        for name, variant, rank, per in self.target_defs:
            if per is not None and i not in per:
                continue
            s = specs[(variant or "ov", rank or "modulus")][i]
            eig = M.eig_subspaces(s.eigenvalues, s.eigenvectors, self.m + (1 if per is None else 0))
            if per is None:
                U, eig = s.basis, eig[1:]  # the target is F's own top subspace: rank it among the others
            else:
                U = per[i]
            v1 = U[:, 0] if U.shape[1] == 1 else None
            fkey = variant or "ov"
            tgts.append(M.TargetSpec(name, U, v1, eig, fkey if self.Kf else None))
            meta.append({"target": name, "variant": variant, "rank": rank, "spec": s if per is None else None})
        if not tgts:
            return None
        k_max = max(t.k for t in tgts)
        haar = M.haar_frames(ad.width(i), k_max, self.K, self._seed(i, 0))
        fnull = {}
        for fkey in sorted({t.fnull for t in tgts if t.fnull}):
            O, V = layer_stacked(ad, i, fkey)
            fnull[fkey] = M.power_step_frames(
                lambda G, O=O, V=V: O @ (V @ G), ad.width(i), k_max, self.Kf, self._seed(i, 1 + len(fnull))
            )
        return tgts, meta, LayerReducer(tgts, haar, fnull, self.null_stride, m=self.m)

    def _seed(self, layer: int, which: int) -> int:
        return (self.null_seed * 1_000_003 + layer * 101 + which) % (2**63)

    # ---- reduction ----
    def _valid_mask(self, x: torch.Tensor, stack) -> Grid:
        """x's valid tokens and their indices in their sequences (a ``Grid``): made once per stack and shape
        in a forward and shared by its layers, with its null subsample."""
        key = (stack, x.shape[:2], x.device)
        if key not in self._masks:
            mask = self._make_mask(x, stack)
            self._masks[key] = self._indexed(stack, mask)
        return self._masks[key]

    def _indexed(self, stack, mask: torch.Tensor) -> Grid:
        """``mask``'s Grid: each token's index among its sequence's valid tokens, counting the ones
        each sequence had before this forward (a KV cache's earlier positions). From the call's own
        mask where it covers them (one cumsum over it: 2 ops a decoding step), else from what the
        monitor counted over the open sequences' forwards. Device ops only."""
        b, n = mask.shape
        full = self._stack_masks[stack] if stack in self._stack_masks else self._mask
        if full is not None and full.shape[0] == b and full.shape[1] > n:
            upto = full.to(mask.device).cumsum(1, dtype=torch.int64)  # valid tokens up to each position
            return Grid(mask, upto[:, -n:] - 1, after=upto[:, -1:])
        seen = self._seen.get(stack)
        if seen is None or seen.shape[0] != b or seen.device != mask.device:
            return Grid(mask)
        return Grid(mask, seen + mask.cumsum(1) - 1)

    def _make_mask(self, x: torch.Tensor, stack) -> torch.Tensor:
        b, n = x.shape[:2]
        m = self._stack_masks[stack] if stack in self._stack_masks else self._mask
        if m is None:  # every token counts: one all-True mask per shape, shared by the layers (never written)
            if self._all_valid is None or self._all_valid.shape != (b, n) or self._all_valid.device != x.device:
                self._all_valid = torch.ones(b, n, dtype=torch.bool, device=x.device)
            return self._all_valid
        if m.shape[0] != b or m.shape[1] < n:
            raise ValueError(
                f"attention mask of shape {tuple(m.shape)} does not fit activations of shape {tuple(x.shape)}"
            )
        return m[:, -n:].to(x.device).bool()  # with a KV cache only the newest positions are computed

    def _reduce(self, layer: int, cap: dict) -> None:
        """Layer ``layer``'s readings are all in: project them (or, for a one-token step, keep them for
        the batched flush). Runs in a hook, per layer and decoding step: lookups only, from the facts
        ``_index_slots`` gathered once when the hooks were registered."""
        pre = cap.get("pre")
        if pre is None or pre.dim() != 3:
            return
        shape = pre.shape
        if shape[1] == 0:
            return
        mid_is_sum, post_norm, masked, stack, _ = self._facts[layer]
        mid = None
        if self._read_mid and "attn" in cap:  # no attention step ran: no delta
            # a parallel block's mid is pre + attention output (not a model state)
            mid = pre + cap["attn"] if mid_is_sum else cap.get("mid")
        post = cap.get("post")
        points = {
            "pre": pre,
            "mid": mid if mid is None or mid.shape == shape else as_tokens(mid, pre),
            "post": post if post is None or post.shape == shape else as_tokens(post, pre),
        }
        base = None
        if post_norm is not None and mid is not None:
            with torch.no_grad():
                base = post_norm.forward(pre)  # LN_t(pre), without running anyone's hooks
        if masked:
            grid = self._valid_mask(pre, stack)
        else:  # a tower the forward's attention_mask does not describe: all its tokens count
            grid = Grid(torch.ones(shape[:2], dtype=torch.bool, device=pre.device))
        if shape[1] == 1 and self.sink_path is None and not self.keep_tokens:
            self._pending_raw[layer] = (points, grid, base)  # reduced in batches once the forward ends
            return
        info = self._layers[layer]
        # reduced when the forward ends; post(t) and pre(t+1) are one tensor: its norms and sums taken once
        self._pending[layer] = info["reducer"].project(points, grid, base, memo=self._reading_memo)
        if self.keep_tokens:
            self._record_tokens(layer, points, grid.mask)

    def _commit(self) -> None:
        """The forward ended: its layers are reduced together, and their sums count, all at once."""
        layers = list(self._pending)
        done = reduce_many([(self._layers[i]["reducer"], self._pending[i]) for i in layers])
        self._pending = dict(zip(layers, done))  # this forward's own sums, for the per-forward sinks (logs.py)
        self._add_all([(layer, sums, rows) for layer, (sums, rows) in self._pending.items()])
        for layer, item in self._pending_raw.items():
            buf = self._buf.setdefault(layer, [])
            if buf and buf[0][1].mask.shape[0] != item[1].mask.shape[0]:
                self._flush(layer)
                buf = self._buf.setdefault(layer, [])
            buf.append(item)
            if len(buf) * item[1].mask.shape[0] >= BUFFER_TOKENS:  # one batch size per buffer (see above)
                self._flush(layer)
        for (stack, _, _), grid in self._masks.items():  # the open sequences' valid tokens so far
            self._seen[stack] = grid.after
        self.n_forwards += 1  # the sinks are written after this (logs.py: _commit_logged)

    def _add_all(self, results: list[tuple[int, dict, torch.Tensor | None]]) -> None:
        """Add (layer, sums, rows) results into the running state: every (layer, field) sum in one
        ``torch._foreach_add`` per device and dtype, not one add each (one launch for the lot on CUDA,
        where a forward's 16 layers x 6 fields were a tenth of the monitor's ops)."""
        olds, news, where = [], [], []
        for layer, sums, _ in results:
            st = self._state[layer]
            if layer in self._zero:  # nothing counted yet: the first sums are the state
                self._zero.discard(layer)
                st.update(sums)
                continue
            for k, v in sums.items():
                olds.append(st[k].to(v.device))
                news.append(v)
                where.append((st, k))
        for (st, k), t in zip(where, _foreach_sum(olds, news)):
            st[k] = t
        olds, news, where = [], [], []
        for layer, _, rows in results:
            if rows is None:
                continue
            open_rows = self._rows.get(layer)
            if open_rows is not None and open_rows.shape[0] != rows.shape[0]:
                self._close_rows(layer)
                open_rows = None
            if open_rows is None:
                self._rows[layer] = rows
            else:
                olds.append(open_rows)
                news.append(rows)
                where.append(layer)
        for layer, t in zip(where, _foreach_sum(olds, news)):
            self._rows[layer] = t

    def _close_rows(self, layer: int) -> None:
        rows = self._rows.pop(layer, None)
        if rows is not None:
            st = self._state[layer]
            st["tgt"] = M.close_rows(st["tgt"].to(rows.device), rows)

    def _end_sequences(self) -> None:
        """The open sequences ended: fold their per-row counters into the cluster sums.

        Layers whose counters have one shape and device are folded together, in one op each."""
        self._flush()
        self._seen = {}
        groups: dict[tuple, list[int]] = {}
        for layer, rows in self._rows.items():
            groups.setdefault((rows.shape, rows.device), []).append(layer)
        for layers in groups.values():
            rows = torch.stack([self._rows.pop(i) for i in layers])
            tgt = torch.stack([self._state[i]["tgt"].to(rows.device) for i in layers])
            for i, t in zip(layers, M.close_rows(tgt, rows)):
                self._state[i]["tgt"] = t

    def _flush(self, layer: int | None = None) -> None:
        """Reduce buffered single-position forwards (all layers when layer is None)."""
        cat = lambda xs: None if any(x is None for x in xs) else torch.cat(xs, 1)  # noqa: E731 (rows stay rows)
        items = []
        grids: dict[tuple, Grid] = {}  # the layers of a step share its Grid: their concatenations are one object,
        for i in [layer] if layer is not None else list(self._buf):  # so the reduction subsamples once for all
            buf = self._buf.pop(i, [])
            if buf:
                points = {p: cat([b[0][p] for b in buf]) for p in buf[0][0]}
                red = self._layers[i]["reducer"]
                key = tuple(id(b[1]) for b in buf)
                if key not in grids:
                    grids[key] = Grid.cat([b[1] for b in buf])
                items.append((i, red, red.project(points, grids[key], cat([b[2] for b in buf]), False)))
        done = reduce_many([(r, pr) for _, r, pr in items])
        self._add_all([(i, sums, rows) for (i, _, _), (sums, rows) in zip(items, done)])

    def _record_tokens(self, layer: int, points: dict, mask: torch.Tensor) -> None:
        tgt, meta = self._layers[layer]["targets"][0], self._layers[layer]["meta"][0]
        U = tgt.U.to(points["pre"].device, torch.float32)
        rec = {"layer": layer, "target": meta["target"], "forward": self.n_forwards, "mask": mask.cpu()}
        for p in M.POINTS:
            if points.get(p) is not None:
                rec[f"a_{p}"] = M.alignment(points[p].float(), U).cpu()
        self.token_records.append(rec)

    # ---- results ----
    def _current_state(self, layer: int) -> dict:
        """This layer's state with the still-open sequences folded in (call ``_flush`` first)."""
        st = dict(self._state[layer])
        rows = self._rows.get(layer)
        if rows is not None:
            st["tgt"] = M.close_rows(st["tgt"].to(rows.device), rows)
        return {k: v.detach().to("cpu", torch.float64) for k, v in st.items()}

    @property
    def stats(self) -> dict[tuple[int, str], dict[str, float]]:
        """(layer, target) -> the raw per-target sums and counts (``metrics.TGT_FIELDS``)."""
        out = {}
        self._flush()
        for layer, info in sorted(self._layers.items()):
            tg = self._current_state(layer)["tgt"]
            for ti, meta in enumerate(info["meta"]):
                out[(layer, meta["target"])] = dict(zip(M.TGT_FIELDS, tg[ti].tolist()))
        return out

    def summary(self):
        """pandas DataFrame, one row per (layer, target); see docs/concepts.md, 'Statistics'."""
        import pandas as pd

        post_norm = self.adapter.norm_position == "post"
        rows = []
        self._flush()
        for layer, info in sorted(self._layers.items()):
            st = self._current_state(layer)
            red = info["reducer"]
            for ti, (t, meta) in enumerate(zip(info["targets"], info["meta"])):
                s = meta["spec"]
                row = {
                    "layer": layer,
                    "target": meta["target"],
                    "variant": meta["variant"],
                    "rank": meta["rank"],
                    "k": t.k,
                }
                row.update(
                    kind=s.kind if s else "custom",
                    lambda_1_re=s.lambda_1.real if s else float("nan"),
                    lambda_1_im=s.lambda_1.imag if s else float("nan"),
                    abs_lambda_1=abs(s.lambda_1) if s else float("nan"),
                    gap_ratio=s.gap_ratio if s else float("nan"),
                )
                row.update(
                    M.summarize(st, ti, red.k_index[ti], t.k, post_norm=post_norm, tie_seed=self._seed(layer, 1000))
                )
                row["null_seed"] = self.null_seed
                rows.append(row)
        df = pd.DataFrame(rows)
        if len(df):
            df["q_null"] = float("nan")
            for _, idx in df.groupby("target").groups.items():
                df.loc[idx, "q_null"] = M.bh(df.loc[idx, "p_null"].to_numpy())
            df["verdict"] = [M.verdict(q, lift) for q, lift in zip(df["q_null"], df["lift"])]
        return df

    def save(self, path) -> Path:
        """Write the summary as Parquet, CSV or JSON (by the file's suffix)."""
        path = Path(path)
        df = self.summary()
        if path.suffix == ".parquet":
            df.to_parquet(path)
        elif path.suffix == ".csv":
            df.to_csv(path, index=False)
        elif path.suffix == ".json":
            df.to_json(path, orient="records", indent=2)
        else:
            raise ValueError(f"unknown format {path.suffix!r}: use .parquet, .csv or .json")
        return path

    def _layout(self) -> dict:
        """The fingerprint of what the sums mean (fingerprint.py), computed once the monitor is prepared.

        Kept from its first call: the bases were fixed by ``_prepare``, so later edits of the
        weights (a steer block active at save time) do not change what the sums measured.
        """
        self._prepare()
        if self._fingerprint is None:
            self._fingerprint = FP.fingerprint(self, self._target_vectors)
        return self._fingerprint

    def state_dict(self) -> dict:
        """The whole streaming state (open sequences folded in) as plain lists: JSON-able, mergeable.

        Returns:
            {"fingerprint": what the sums mean (weights, targets, reading points, null settings),
            "layers": {"i": {name: nested lists}}}.
        """
        self._prepare()
        self._flush()
        layers = {str(i): {k: v.tolist() for k, v in self._current_state(i).items()} for i in self._layers}
        return {"fingerprint": self._layout(), "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Replace the statistics with a saved state (``state_dict`` of a monitor that means the same).

        Raises:
            ValueError: the state comes from other weights, targets, reading points or null
                settings, predates the fingerprint, or is malformed; the message names what differs.
        """
        self._prepare()
        other = self._check_layout(state)
        self._zero.clear()
        self._rows, self._buf = {}, {}
        for i in self._layers:
            self._state[i] = other[i]

    def merge_state_dict(self, state: dict) -> None:
        """Add a saved state (another batch, process or run of a monitor that means the same) to this one.

        Raises:
            ValueError: as ``load_state_dict``; a refused state adds nothing.
        """
        self._prepare()
        other = self._check_layout(state)
        self._zero.clear()
        for i in self._layers:
            self._state[i] = M.merge_states(self._state[i], other[i])

    def _check_layout(self, state) -> dict[int, dict[str, torch.Tensor]]:
        """The state's sums as float64 tensors, once its fingerprint, layers, keys and shapes all match."""
        if not isinstance(state, dict):
            raise ValueError(f"a monitor state is the dict state_dict() returns, got {type(state).__name__}")
        if "fingerprint" not in state:
            what = (
                "predates the fingerprint (saved by an older eigenhooks)" if "layout" in state else "has no fingerprint"
            )
            raise ValueError(
                f"this state {what}: it does not record the model's weights, the target vectors or the reading "
                "points, so it cannot be checked against this monitor; recompute it with this version"
            )
        diffs = FP.differences(self._layout(), state["fingerprint"], "here", "in the state")
        if diffs:
            raise ValueError(
                f"the state's layout differs from this monitor's: {FP.mismatch(diffs)}. Merge only states of the "
                "same model weights, targets, reading points and null settings"
            )
        return FP.parse_layers(state, self._state)

    def all_reduce(self, group=None) -> None:
        """Sum the whole state across the ranks of ``group`` with torch.distributed (gloo or NCCL).

        Every rank must call it with a monitor that means the same (same weights, targets,
        reading points and null settings, so the null draws agree): the ranks' fingerprints are
        compared first, and any difference raises on every rank with the same message. Open
        sequences end here. Afterwards every rank holds the total.

        Raises:
            RuntimeError: torch.distributed is not initialised.
            ValueError: the ranks' monitors differ; the message names the first rank that differs
                from rank 0 and how.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("all_reduce needs torch.distributed initialised (torchrun, or dist.init_process_group)")
        self._check_ranks(dist, group)
        self._end_sequences()
        backend = dist.get_backend(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        parts = [(i, k, v) for i in sorted(self._state) for k, v in sorted(self._state[i].items())]
        flat = torch.cat([v.detach().reshape(-1).to(dev, torch.float64) for _, _, v in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for i, k, v in parts:
            n = v.numel()
            self._state[i][k] = flat[at : at + n].reshape(v.shape).to(v.device)
            at += n

    def _check_ranks(self, dist, group) -> None:
        """Raise the same ValueError on every rank unless all ranks' fingerprints agree.

        Short digests go round first; only when they differ do the whole fingerprints, to name
        the difference. Every rank takes the same branch, so none waits on a collective alone.
        """
        fp = self._layout()
        world = dist.get_world_size(group)
        digests: list = [None] * world
        dist.all_gather_object(digests, FP.digest(fp), group=group)
        if len(set(digests)) == 1:
            return
        fps: list = [None] * world
        dist.all_gather_object(fps, fp, group=group)
        r = next(r for r in range(world) if digests[r] != digests[0])
        diffs = FP.differences(fps[0], fps[r], "on rank 0", f"on rank {r}")
        raise ValueError(
            f"all_reduce: rank {r} differs from rank 0, so their sums cannot be added: {FP.mismatch(diffs)}. "
            "Every rank needs the same model weights, targets, reading points and null settings"
        )


def _where(adapter, i: int) -> tuple[torch.device, torch.dtype] | None:
    """The device and floating dtype of layer i's attention weights: where its activations will be."""
    ly = adapter.layers[i]
    for m in (ly.o_proj, ly.attn_out, ly.block):
        p = next((p for p in m.parameters() if p.is_floating_point()), None) if isinstance(m, torch.nn.Module) else None
        if p is not None and p.device.type != "meta":
            return p.device, p.dtype
    return None


def continues(args, kwargs) -> bool:
    """True when this forward extends the previous one's sequences (a KV-cache step).

    Read without waiting for the device where possible: a mask wider than the positions computed,
    a cache whose length is a host int, a ``cache_position`` on the CPU. Only a cache that keeps its
    length on the device, with no such mask, costs one read.
    """
    past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 passes `cache`
    cp = kwargs.get("cache_position")
    if past is None and not isinstance(cp, torch.Tensor):
        return False
    mask = kwargs.get("attention_mask")
    x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(x, torch.Tensor) and x.dim() >= 2:
        return mask.shape[1] > x.shape[1]
    if isinstance(cp, torch.Tensor) and cp.numel() and cp.device.type == "cpu":
        return bool(cp.reshape(-1)[0] > 0)
    if past is not None:
        try:
            length = past.get_seq_length()
        except (AttributeError, TypeError):
            return bool(past)
        if isinstance(length, int):
            return length > 0
        if not isinstance(cp, torch.Tensor):
            return int(length) > 0
    return bool(cp.numel() and cp.reshape(-1)[0] > 0)


def _foreach_sum(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
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

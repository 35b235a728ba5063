"""Hooks at run time: attach, capture (pre, mid, post), reduce to statistics, detach.

``with eh.monitor(model) as mon: model(**batch)`` measures every forward pass inside the
block, including ``generate`` with a KV cache (only newly computed positions are seen, so
each position counts once). Activations of a layer are reduced as soon as its block ends,
so memory does not grow with the number of tokens. Only the monitor's own hooks are
removed on exit, also after an exception or a half-failed registration.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from .api import spectra
from .metrics import FIELDS, LayerReducer, LayerStats, null_basis
from .models import Adapter, get_adapter

log = logging.getLogger(__name__)
DEFAULT_TARGETS = (("ov", "modulus"), ("ov", "residual"))
BUFFER_TOKENS = 256  # single-position forwards reduced together; bounds the buffer's memory


def _first(x):
    return x[0] if isinstance(x, tuple | list) else x


class _Target:
    """One (layer, variant, rank): its spectrum and its seeded null subspace."""

    def __init__(self, spec, null_seed: int):
        self.spec = spec
        self.null64 = null_basis(spec.d_model, spec.k, null_seed * 100_003 + spec.layer)
        self.v1_64 = spec.basis[:, 0] if spec.k == 1 else None


class Monitor:
    """Streaming alignment statistics for every attention layer of a model.

    Use through ``eigenhooks.monitor(...)``. After (or during) the block: ``summary()``,
    ``save(path)``, ``stats`` (a dict (layer, variant, rank) -> LayerStats).
    """

    def __init__(
        self,
        model,
        targets=DEFAULT_TARGETS,
        reading_points=("pre", "mid", "post"),
        tokens=False,
        attention_mask=None,
        null_seed: int = 0,
        sink=None,
        attach: bool = True,
    ):
        bad = set(reading_points) - {"pre", "mid", "post"}
        if bad or "pre" not in reading_points:
            raise ValueError(f"reading_points must include 'pre' and be among pre/mid/post, got {reading_points}")
        self.adapter: Adapter = get_adapter(model)
        self.model = self.adapter.model
        self.targets = [tuple(t) for t in targets]
        self.points = tuple(reading_points)
        self.keep_tokens = tokens
        self.explicit_mask = attention_mask
        self.null_seed = null_seed
        self.sink_path = Path(sink) if sink is not None else None
        self.attach = attach
        self._acc: dict[int, torch.Tensor] = {}  # layer -> (targets, FIELDS) running sums, on device
        self._loaded: dict[tuple, LayerStats] = {}  # from load_state_dict
        self._reducers: dict[int, LayerReducer] = {}
        self._buf: dict[int, list] = {}  # layer -> buffered single-position forwards
        self.token_records: list[dict] = []
        self.n_forwards = 0
        self._targets: dict[int, list[tuple[tuple, _Target]]] = {}
        self._stack: ExitStack | None = None
        self._reset_forward()

    # ---- lifecycle ----
    def __enter__(self) -> Monitor:
        self._prepare()
        if self.attach:
            self._stack = ExitStack()
            try:
                self._register()
            except BaseException:
                self._stack.close()  # all-or-nothing: drop what was registered
                self._stack = None
                raise
        return self

    def _prepare(self) -> None:
        """Spectra (cached) and bases for every (layer, target)."""
        if self._targets:
            return
        for variant, rank in self.targets:
            for spec in spectra(self.adapter, variant=variant, rank=rank):
                key = (spec.layer, variant, rank)
                self._targets.setdefault(spec.layer, []).append((key, _Target(spec, self.null_seed)))
        for layer, tgts in self._targets.items():
            self._reducers[layer] = LayerReducer([(t.spec.basis, t.null64, t.v1_64) for _, t in tgts])

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._flush()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _hook(self, module, fn, kind: str, **kw):
        reg = {"pre": module.register_forward_pre_hook, "fwd": module.register_forward_hook}[kind]
        handle = reg(fn, **kw)
        self._stack.callback(handle.remove)

    def _register(self) -> None:
        ad = self.adapter
        self._hook(self.model, self._on_model_start, "pre", with_kwargs=True)
        self._hook(self.model, self._on_model_end, "fwd")
        if ad.backend == "lens":
            for i in range(ad.n_layers):
                rp = ad.reading_points(i)
                for point in self.points:
                    hp = self.model.hook_dict[getattr(rp, point).hook_name]
                    self._hook(hp, self._lens_fn(i, point), "fwd")
            return
        self._order: dict[int, list[int]] = {}
        for ly in ad.layers:
            self._order.setdefault(id(ly.block), []).append(ly.index)
        seen = set()
        for ly in ad.layers:
            if id(ly.block) in seen:
                continue  # shared module: one hook serves every use, calls are counted
            seen.add(id(ly.block))
            rp = ad.reading_points(ly.index)
            self._hook(ly.block, self._on_block_start, "pre", with_kwargs=True)
            self._hook(ly.block, self._on_block_end, "fwd")
            if "mid" in self.points:
                tap = rp.attn if rp.mid_is_sum else rp.mid
                if tap.where == "input":
                    self._hook(tap.module, lambda m, a, kw, fn=self._on_mid(False): fn(m, a, _first(kw.get("hidden_states", a))), "pre", with_kwargs=True)
                else:
                    self._hook(tap.module, self._on_mid(rp.mid_is_sum), "fwd")

    # ---- per forward ----
    def _reset_forward(self) -> None:
        self._calls: dict[int, int] = {}
        self._current: int | None = None
        self._cap: dict[str, torch.Tensor] = {}
        self._mask_full: torch.Tensor | None = None
        self._delta: dict[int, torch.Tensor] = {}  # this forward's sums, for the sink

    def _on_model_start(self, module, args, kwargs):
        self._reset_forward()
        mask = self.explicit_mask if self.explicit_mask is not None else kwargs.get("attention_mask")
        self._mask_full = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _on_model_end(self, module, args, output):
        self.n_forwards += 1
        if self.sink_path is not None and self._delta:
            line = {
                "forward": self.n_forwards,
                "stats": [
                    {"layer": k[0], "variant": k[1], "rank": k[2], **s.state_dict()}
                    for k, s in self._as_stats(self._delta).items()
                    if k[0] in self._delta
                ],
            }
            with open(self.sink_path, "a") as fh:
                fh.write(json.dumps(line) + "\n")
                fh.flush()
        self._delta = {}

    def _on_block_start(self, module, args, kwargs):
        order = self._order[id(module)]
        c = self._calls.get(id(module), 0)
        self._calls[id(module)] = c + 1
        self._current = order[c % len(order)]
        x = kwargs.get("hidden_states", args[0] if args else None)
        self._cap = {"pre": x.detach()}

    def _on_mid(self, is_sum: bool):
        def fn(module, args, output):
            if self._current is None or "pre" not in self._cap:
                return
            out = _first(output).detach()
            self._cap["mid"] = self._cap["pre"] + out if is_sum else out

        return fn

    def _on_block_end(self, module, args, output):
        if self._current is None:
            return
        self._cap["post"] = _first(output).detach()
        self._reduce(self._current, self._cap)
        self._cap, self._current = {}, None

    def _lens_fn(self, layer: int, point: str):
        def fn(module, args, output):
            self._cap[point] = output.detach()
            last = self.points[-1]
            if point == last:
                self._reduce(layer, self._cap)
                self._cap = {}

        return fn

    # ---- reduction ----
    def _valid_mask(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[:2]
        m = self._mask_full if self._mask_full is not None else self.explicit_mask
        if m is None:
            return torch.ones(b, n, dtype=torch.bool, device=x.device)
        if m.shape[0] != b or m.shape[1] < n:
            raise ValueError(
                f"attention mask of shape {tuple(m.shape)} does not fit activations of shape {tuple(x.shape)}"
            )
        return m[:, -n:].to(x.device).bool()  # with a KV cache only the newest positions are computed

    def _reduce(self, layer: int, cap: dict) -> None:
        pre = cap.get("pre")
        if pre is None or pre.numel() == 0 or layer not in self._reducers:
            return
        f32 = lambda t: None if t is None else t.to(torch.float32)
        points = {p: (f32(cap.get(p)) if p in self.points else None) for p in ("pre", "mid", "post")}
        mask = self._valid_mask(points["pre"])
        if points["pre"].shape[1] == 1 and self.sink_path is None and not self.keep_tokens:
            # One position per sequence (a KV-cache generation step): batch these up and
            # reduce many at once; a per-step reduction would cost more than the step.
            # Sequences of one token add no consensus, so the result is the same.
            buf = self._buf.setdefault(layer, [])
            buf.append(({p: (None if X is None else X.clone()) for p, X in points.items()}, mask))
            if sum(mk.shape[0] for _, mk in buf) >= BUFFER_TOKENS:
                self._flush(layer)
            return
        self._add(layer, self._reducers[layer](points, mask))
        if self.keep_tokens:
            for key, tgt in self._targets[layer]:
                U = tgt.spec.basis.to(pre.device, torch.float32)
                self._record_tokens(key, points["pre"], points["mid"], points["post"], U, mask)

    def _add(self, layer: int, sums: torch.Tensor) -> None:
        """Add (targets, FIELDS) sums to the running totals (and this forward's, for the sink)."""
        self._acc[layer] = self._acc[layer] + sums if layer in self._acc else sums
        self._delta[layer] = self._delta[layer] + sums if layer in self._delta else sums

    def _flush(self, layer: int | None = None) -> None:
        """Reduce buffered single-position forwards (all layers when layer is None)."""
        for i in [layer] if layer is not None else list(self._buf):
            buf = self._buf.pop(i, [])
            if not buf:
                continue
            points = {p: (None if buf[0][0][p] is None else torch.cat([b[0][p] for b in buf])) for p in buf[0][0]}
            self._add(i, self._reducers[i](points, torch.cat([b[1] for b in buf])))

    def _as_stats(self, acc: dict[int, torch.Tensor]) -> dict[tuple, LayerStats]:
        out = {}
        for layer, tgts in self._targets.items():
            rows = acc[layer].cpu() if layer in acc else torch.zeros(len(tgts), len(FIELDS), dtype=torch.float64)
            for (key, _), row in zip(tgts, rows):
                out[key] = LayerStats.from_vector(row)
        return out

    @property
    def stats(self) -> dict[tuple, LayerStats]:
        """(layer, variant, rank) -> LayerStats, everything measured so far (plus loaded state)."""
        self._flush()
        cur = self._as_stats(self._acc)
        return {k: (v + self._loaded[k] if k in self._loaded else v) for k, v in cur.items()}

    def _record_tokens(self, key, pre, mid, post, U, mask) -> None:
        from .metrics import alignment

        rec = {
            "layer": key[0],
            "variant": key[1],
            "rank": key[2],
            "forward": self.n_forwards,
            "mask": mask.cpu(),
            "a_pre": alignment(pre, U).cpu(),
        }
        if mid is not None:
            rec["a_mid"] = alignment(mid, U).cpu()
        if post is not None:
            rec["a_post"] = alignment(post, U).cpu()
        self.token_records.append(rec)

    # ---- TransformerLens ----
    def fwd_hooks(self) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for TransformerLens ``run_with_hooks`` / ``model.hooks`` (use attach=False)."""
        if self.adapter.backend != "lens":
            raise TypeError("fwd_hooks() is for TransformerLens models; HF models are hooked by the with-block")
        if self._stack is not None:
            raise RuntimeError(
                "this monitor is already attached to the model; create it with attach=False to use fwd_hooks()"
            )
        self._prepare()
        hooks = []
        for i in range(self.adapter.n_layers):
            rp = self.adapter.reading_points(i)
            for point in self.points:
                fn = self._lens_fn(i, point)
                hooks.append((getattr(rp, point).hook_name, lambda act, hook, fn=fn: fn(None, None, act)))
        return hooks

    # ---- results ----
    def summary(self):
        """pandas DataFrame, one row per (layer, variant, rank)."""
        import pandas as pd

        rows = []
        for (layer, variant, rank), st in sorted(self.stats.items()):  # one host sync here
            tgt = next(t for k, t in self._targets[layer] if k == (layer, variant, rank))
            s = tgt.spec
            rows.append(
                {
                    "layer": layer,
                    "variant": variant,
                    "rank": rank,
                    "k": s.k,
                    "kind": s.kind,
                    "lambda_1_re": s.lambda_1.real,
                    "lambda_1_im": s.lambda_1.imag,
                    "abs_lambda_1": abs(s.lambda_1),
                    "gap_ratio": s.gap_ratio,
                    **st.summary(s.k),
                }
            )
        return pd.DataFrame(rows)

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

    def state_dict(self) -> dict:
        return {f"{k[0]}|{k[1]}|{k[2]}": s.state_dict() for k, s in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        """Replace the statistics with a saved state (``state_dict`` of this or another monitor)."""
        self._prepare()
        self._acc, self._loaded, self._buf = {}, {}, {}
        for key, st in state.items():
            layer, variant, rank = key.split("|")
            s = LayerStats()
            s.load_state_dict(st)
            self._loaded[(int(layer), variant, rank)] = s


def monitor(
    model,
    targets=DEFAULT_TARGETS,
    reading_points=("pre", "mid", "post"),
    tokens=False,
    *,
    attention_mask=None,
    null_seed: int = 0,
    sink=None,
    attach: bool = True,
) -> Monitor:
    """Measure alignment with each layer's principal subspace while the model runs.

    Args:
        model: HF or TransformerLens model (or an Adapter).
        targets: (variant, rank) pairs; default the paper's ('ov', 'modulus') and the
            residual-aware ('ov', 'residual').
        reading_points: which of 'pre', 'mid', 'post' to read ('pre' is required).
        tokens: also keep per-token alignments (``mon.token_records``), for plots.
        attention_mask: (batch, seq) mask overriding the one passed to the model call.
        null_seed: seed of the random null subspaces.
        sink: a .jsonl path; one line (the forward's statistics) is appended and flushed per forward.
        attach: register hooks on enter (TransformerLens users may set False and pass
            ``mon.fwd_hooks()`` to ``run_with_hooks``).

    Example:
        >>> model, tok = eh.zoo.load("gpt2-tiny")          # doctest: +SKIP
        >>> with eh.monitor(model) as mon:                   # doctest: +SKIP
        ...     model(**tok(["def f(x):"], return_tensors="pt"))
        >>> mon.summary()[["layer", "rank", "gamma_pre", "rho", "p_value"]]  # doctest: +SKIP
    """
    return Monitor(model, targets, reading_points, tokens, attention_mask, null_seed, sink, attach)

"""``AlignmentCallback``: the monitor over a fixed probe set while a HuggingFace ``Trainer`` trains.

At each evaluation, or every n optimizer steps, the callback runs the probe set through the
model (eval mode, no grad) inside ``eh.monitor`` and logs the running gamma_pre/mid/post, rho and
n_tokens of every (layer, target) through ``trainer.log``: the Trainer's own logging, which puts
them in ``state.log_history`` and hands them to every ``report_to`` integration (TensorBoard,
W&B, MLflow ...) beside the loss. TensorBoard's integration files them under ``train/``, as
``train/eigenhooks/rho/L07/ov-modulus``.

A ``TrainerCallback`` is never given its Trainer, and the ``logs`` dict that ``on_log`` passes
round reaches the reporting integrations before any callback the user adds, so the callback
cannot reach the Trainer's logging on its own: ``attach(trainer)`` adds it to the Trainer and
keeps the Trainer to log through (one line, instead of ``trainer.add_callback``).

The spectra are recomputed whenever the weights changed since the last measurement: the
monitor asks ``eh.spectra``, whose in-process memo is keyed by a hash of every byte of each
layer's attention weights, which an optimizer step changes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from transformers import TrainerCallback

from ..monitor import monitor
from ..monitor.config import DEFAULT_TARGETS

log = logging.getLogger(__name__)
# Only gamma and rho are logged, which no null changes: the smallest nulls keep each measurement cheap.
CHEAP_NULLS = {"null_draws": 1, "fnull_draws": 0, "eig_top": 0}


class AlignmentCallback(TrainerCallback):
    """Log alignment on a fixed probe set through the Trainer's own logging, while it trains.

    Args:
        probe: the probe set, tokenized once (at the first measurement) with the Trainer's
            ``processing_class``: a list of texts; a ``datasets.Dataset`` or list of dicts with
            ``input_ids`` (and ``attention_mask``) or with a ``text`` column; or a dict /
            ``BatchEncoding`` of (n, seq) tensors.
        every_n_steps: also measure every n optimizer steps (None: only at evaluations).
        targets: the monitor's targets (default ``("ov", "modulus"), ("ov", "residual")``).
        batch_size: probe rows per forward.
        max_length: texts are truncated to this many tokens.
        monitor_kwargs: passed to ``eh.monitor`` (default: the smallest nulls, which the logged
            values do not use).

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds, processing_class=tok)  # doctest: +SKIP
        >>> eh.integrations.AlignmentCallback(texts, every_n_steps=50).attach(trainer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(
        self,
        probe,
        every_n_steps: int | None = None,
        targets=DEFAULT_TARGETS,
        *,
        batch_size: int = 8,
        max_length: int = 512,
        monitor_kwargs: dict | None = None,
    ):
        if every_n_steps is not None:
            _check_count("every_n_steps", every_n_steps, " or None (evaluations only)")
        _check_count("batch_size", batch_size)
        _check_count("max_length", max_length)
        if monitor_kwargs is not None and not isinstance(monitor_kwargs, Mapping):
            raise TypeError(
                f"monitor_kwargs must be a dict of eh.monitor arguments, got {type(monitor_kwargs).__name__}"
            )
        if isinstance(probe, str):  # one text, not a sequence of one-character texts
            probe = [probe]
        if hasattr(probe, "__len__") and len(probe) == 0:
            raise ValueError("the probe set is empty: give at least one text or tokenized row")
        self._probe_rows = _rows(probe)  # every row's type checked now, not at the first measurement
        self.probe, self.targets = probe, list(targets)
        self.every_n_steps = None if every_n_steps is None else int(every_n_steps)
        self.batch_size, self.max_length = int(batch_size), int(max_length)
        self.monitor_kwargs = {**CHEAP_NULLS, **(monitor_kwargs or {})}
        self.trainer = None
        self.history: list[tuple[int, dict[str, float]]] = []  # (global_step, values) of every measurement
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._measured_at: int | None = None

    def attach(self, trainer) -> AlignmentCallback:
        """Add this callback to ``trainer`` and log through it. Returns the callback."""
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.trainer = trainer
        return self

    # ---- the Trainer's events ----
    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "AlignmentCallback logs through trainer.log, which a callback is not given: add it with "
                "eh.integrations.AlignmentCallback(probe, ...).attach(trainer) instead of callbacks=[...] "
                "or trainer.add_callback(...)"
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._measure_and_log(state, control, kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        self._measure_and_log(state, control, kwargs)

    # ---- measuring ----
    def measure(self, model, processing_class=None) -> dict[str, float]:
        """Run the probe set through ``model`` under the monitor, now: ``{tag: value}`` (``Monitor.scalars``)."""
        if self._batches is None:
            self._batches = self._encode(processing_class)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), monitor(model, targets=self.targets, **self.monitor_kwargs) as mon:
                for ids, mask in self._batches:
                    model(input_ids=ids.to(device), attention_mask=mask.to(device))
        finally:
            model.train(was_training)
        return mon.scalars()

    def _measure_and_log(self, state, control, kwargs) -> None:
        if self._measured_at == state.global_step:  # an evaluation at a step already measured
            return
        values = self.measure(kwargs["model"], kwargs.get("processing_class"))
        self._measured_at = state.global_step
        self.history.append((state.global_step, values))
        if self.trainer is None:
            return
        should_log = control.should_log  # the Trainer's on_log clears it: keep this step's own log
        self.trainer.log(dict(values))
        control.should_log = should_log

    def _encode(self, processing_class) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The probe as (input_ids, attention_mask) batches, right-padded, on the CPU."""
        rows = self._probe_rows
        if any(isinstance(r, str) for r in rows):
            tok = getattr(processing_class, "tokenizer", processing_class)
            if tok is None:
                raise ValueError(
                    "the probe is text, and the Trainer has no processing_class to tokenize it: pass "
                    "Trainer(processing_class=tokenizer), or give the probe already tokenized (input_ids)"
                )
            rows = [(tok(r, truncation=True, max_length=self.max_length)["input_ids"], None) for r in rows]
        pad = getattr(getattr(processing_class, "tokenizer", processing_class), "pad_token_id", None) or 0
        batches = []
        for at in range(0, len(rows), self.batch_size):
            chunk = rows[at : at + self.batch_size]
            n = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), n), pad, dtype=torch.long)  # (batch, longest)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for i, (r, m) in enumerate(chunk):
                ids[i, : len(r)] = torch.as_tensor(r)
                mask[i, : len(r)] = 1 if m is None else torch.as_tensor(m)
            batches.append((ids, mask))
        log.debug("probe: %d rows in %d batches", len(rows), len(batches))
        return batches


def _check_count(name: str, v, alternative: str = "") -> None:
    """A positive whole number (an int, or a float such as 2.0), else a ValueError naming the argument."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v == int(v) and v >= 1
    if not ok:
        raise ValueError(f"{name} must be a positive int{alternative}, got {v!r}")


def _rows(probe) -> list:
    """Texts, or (input_ids, attention_mask or None) pairs, one per probe row.

    Raises:
        TypeError: a row that is no text, no mapping with 'input_ids' or 'text', or whose
            values have the wrong type (the message names the row).
    """
    if isinstance(probe, Mapping) and "input_ids" in probe:  # a dict / BatchEncoding of (n, seq) tensors
        try:
            ids = torch.as_tensor(probe["input_ids"])
            mask = torch.as_tensor(probe["attention_mask"]) if "attention_mask" in probe else torch.ones_like(ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"the probe's input_ids / attention_mask must be (n, seq) integer tensors: {e}") from e
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool or mask.shape != ids.shape:
            raise TypeError(
                f"the probe's input_ids must be an (n, seq) integer tensor with an attention_mask of the same "
                f"shape, got input_ids {tuple(ids.shape)} {ids.dtype}, attention_mask {tuple(mask.shape)}"
            )
        return [(ids[i][mask[i].bool()].tolist(), None) for i in range(ids.shape[0])]
    out = []
    try:
        rows = iter(probe)
    except TypeError:
        raise TypeError(
            f"the probe must be a text, a list of texts or tokenized rows, or a dict of tensors; got {type(probe).__name__}"
        ) from None
    for i, row in enumerate(rows):
        if isinstance(row, str):
            out.append(row)
        elif isinstance(row, Mapping) and "input_ids" in row:
            ids, mask = _token_ids(row["input_ids"], i, "input_ids"), _mask(row.get("attention_mask"), i)
            if mask is not None and len(mask) != len(ids):
                raise TypeError(f"probe row {i}: attention_mask has {len(mask)} entries, input_ids {len(ids)}")
            out.append((ids, mask))
        elif isinstance(row, Mapping) and "text" in row:
            if not isinstance(row["text"], str):
                raise TypeError(f"probe row {i}: 'text' must be a string, got {type(row['text']).__name__}")
            out.append(row["text"])
        else:
            raise TypeError(
                f"a probe row must be a text or a mapping with 'input_ids' or 'text', got {type(row).__name__} (row {i})"
            )
    return out


def _token_ids(v, i: int, name: str) -> list[int]:
    """A row's token ids as a list of ints; a TypeError naming the row otherwise."""
    if hasattr(v, "tolist"):  # a tensor or a numpy array
        v = v.tolist()
    if isinstance(v, str | bytes) or not hasattr(v, "__iter__"):
        raise TypeError(f"probe row {i}: '{name}' must be a list of token ids (ints), got {type(v).__name__}")
    v = list(v)
    bad = [x for x in v if isinstance(x, bool) or not isinstance(x, int)]
    if bad or not v:
        what = f"{type(bad[0]).__name__} {bad[0]!r}" if bad else "an empty list"
        raise TypeError(f"probe row {i}: '{name}' must be a non-empty list of token ids (ints), got {what}")
    return v


def _mask(v, i: int):
    return None if v is None else _token_ids(v, i, "attention_mask")

"""How an engine hands the monitor what its model computes: the attachment interface (docs/adapters.md).

An adapter attaches (``Adapter.attachment``); it alone knows the model's modules, hook names, call
keywords and batch layout. Its attachment tells the monitor's ``Record`` a few events, one way: a
forward starts (with its ``CallFacts``), a reading of (layer, point), a stack of an encoder-decoder
starts, the forward ends, requests end. The record answers nothing. The monitor alone owns the
lifecycle: it calls ``attach`` on entry and ``detach`` on close, never during a forward.

Two batch layouts reach the record: a padded batch (b, n, d) with its (b, n) mask (HF,
TransformerLens), and a flat one (tokens, d) whose rows are requests (``FlatRows``: each token's
request and position, given by the engine; a vLLM-like scheduler ends requests with
``Record.requests_end``, not a forward's end).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Protocol

import torch


class MeasurementWarning(UserWarning):
    """Something the monitor should have measured was not: hooks removed, bypassed or never reached."""


class Warner:
    """Each kind of ``MeasurementWarning`` once per monitor."""

    def __init__(self):
        self.said: set[str] = set()

    def __call__(self, key: str, msg: str) -> None:
        if key not in self.said:
            self.said.add(key)
            warnings.warn(msg, MeasurementWarning, stacklevel=4)


class FlatRows(NamedTuple):
    """A flat batch's layout: readings of shape (tokens, d), whose rows are requests.

    keys: each row's request key (hashable; the same request keeps its key across forwards until
        the engine ends it, ``Record.requests_end``). row: (tokens,) int64, each token's row (an
        index into keys). position: (tokens,) int64, each token's index among its request's
        tokens, counted from the request's start (a chunked prefill or a decoding step continues it).
        width: the most tokens of one row in this forward, where the engine knows it on the host
        (0: counted from ``row``, one read from the device).
        steps: the engine forwards these readings gather (> 1: each row's tokens are its one-token
        decoding steps, told together as a padded batch's steps are flushed together). The
        within-sequence consensus is one forward's: it is taken only where steps is 1.
        layout: what the engine knows of the tokens' order, on the host. ``"rows"``: every row has
            ``width`` tokens, token ``r * width + i`` being row r's i-th; ``"steps"``: every row has
            ``width`` tokens, token ``s * rows + r`` being row r's s-th. The readings are then the padded
            batch as they stand (a view), not scattered into one. ``""``: any order (``row`` says).
        valid: whether the readings are this forward's, said on the device (an engine whose taps write on
            the device says so after the forward, without reading it back): a bool scalar (False: none of
            its tokens count), or (tokens,) bool, one a token (``steps`` > 1: each step's own); None: all are.
    """

    keys: tuple
    row: torch.Tensor
    position: torch.Tensor
    width: int = 0
    steps: int = 1
    layout: str = ""
    valid: torch.Tensor | None = None


class CallFacts(NamedTuple):
    """What an attachment tells of a forward as it starts.

    rows: (b, n) of a padded batch's input, or None. mask: its (b, n) padding mask (None: every
    position counts). continues: it extends the previous forward's sequences (a KV-cache step).
    attn_ran: layers whose attention output has no tap and was found in place (it counts as read).
    flat: a flat batch's layout (``FlatRows``); its readings are (tokens, d).
    """

    rows: tuple[int, int] | None = None
    mask: torch.Tensor | None = None
    continues: bool = False
    attn_ran: frozenset = frozenset()
    flat: FlatRows | None = None


class Record(Protocol):
    """What an attachment talks to (the monitor's side). Every event returns nothing."""

    def forward_start(self, call: CallFacts) -> None:
        """A forward starts in this thread."""

    def read(self, layer: int, point: str, x: torch.Tensor) -> None:
        """A reading of (layer, point): (b, n, d) padded, or (tokens, d) flat. The first one counts."""

    def read_once(self, roles: list, x: torch.Tensor) -> None:
        """A module's one call of the forward, read for every (layer, point) of ``roles`` (one list
        object per module, the same in every forward: ``Attachment.once``)."""

    def stack_start(self, name: str, mask: torch.Tensor | None) -> None: ...
    def forward_end(self, ok: bool, intact: bool = True) -> None:
        """The forward ended (ok: it returned; intact: none of the attachment's hooks was removed)."""

    def generate_start(self, rows: int | None) -> None: ...
    def generate_end(self) -> None: ...
    def requests_end(self, keys) -> None:
        """The engine's scheduler finished these requests: their sequences end."""


class Attachment:
    """An attachment to one model; the monitor calls these on entry and close only.

    Attributes:
        started: forwards whose start it told. orphans: readings that came outside any forward.
        once: the role lists of modules read once a forward ({key: [(layer, point)]}, for
            ``Record.read_once``), None where readings come one by one. untapped: layers whose
            attention has no tap (their ``CallFacts.attn_ran`` says whether it ran).
    """

    started = 0
    orphans = 0
    once: dict | None = None
    n_slots = 0
    untapped: frozenset = frozenset()

    def attach(self) -> None:
        """Begin telling the record (all or nothing)."""

    def detach(self) -> None:
        """Stop telling it; take off whatever was put on the model (only that)."""

    def detach_after_forward(self) -> None:
        """The monitor closed while a forward runs below it: detach once that forward has ended."""
        self.detach()

    def in_forward(self) -> bool:
        """Whether the model's forward is running below the caller (a close inside it)."""
        return False

    def check(self) -> bool:
        """Warn (once) and say True if something removed part of the attachment."""
        return False

    def fwd_hooks(self, running_mask) -> list:
        raise TypeError("fwd_hooks() is for TransformerLens models; HF models are hooked by the with-block")

"""How a monitor prints: one line (``repr``) and a small notebook table (``_repr_html_``).

The line says what a reader checks first, from what the monitor already holds on the host: the
model's class, the layers and targets measured, the forwards counted, the tokens counted where the
sums live on the CPU, and whether the block is active. Printing reduces nothing and reads nothing
back from an accelerator: buffered one-token steps (``generate``) are said as such, not reduced, and
on a GPU the token count is left to ``summary()`` (reading it would sync the device). The monitor's
table stays ``summary()``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .measures.target import TGT_FIELDS

N_NAMES = 3  # target names listed before "…"
N_FIELD = TGT_FIELDS.index("n")  # valid, finite tokens: the same for every target of a layer


@dataclass(frozen=True)
class Facts:
    """What a monitor's repr says. tokens: counted tokens (None: not read here, ``unread`` says where they
    are); buffered: one-token steps counted as forwards but not yet reduced into the token count."""

    owner: str  # "Monitor", "EngineMonitor"
    model: str  # the model's class, or the engine and its model
    layers: int
    targets: tuple[str, ...]  # as printed: 'ov/modulus', 'ov_head/modulus (9 heads)', a custom name
    n_targets: int  # rows per layer: a head target counts its heads
    forwards: int
    tokens: int | None
    unread: str  # where unread tokens are and what reads them: 'on cuda:0 (summary() reads them)'
    buffered: int
    state: str  # 'active', 'closed', 'not entered', 'hooks handed out'


def monitor_facts(mon) -> Facts:
    """The ``Facts`` of an ``eh.Monitor``, read from its plan and state as they are (nothing built or reduced)."""
    ad = mon.adapter
    names, n_targets = [], 0
    for d in mon.target_defs:
        if d.heads:
            names.append(f"{d.name} ({ad.n_heads} heads)")
            n_targets += ad.n_heads
        else:
            names.append(d.name)
            n_targets += 1
    plan, acc = mon._plan, mon._acc
    if plan is not None:
        layers = len(plan.layers)
    elif any(d.builtin for d in mon.target_defs):
        layers = ad.n_layers
    else:
        layers = len({i for d in mon.target_defs for i in d.per_layer})
    tokens, unread, buffered = 0, "", 0
    if acc is not None and plan.layers:
        tgt = acc.state[min(plan.layers)]["tgt"]  # (T, fields): the first layer's counts
        tokens = int(tgt[0, N_FIELD]) if tgt.device.type == "cpu" and len(tgt) else None
        unread = f"on {tgt.device} (summary() reads them)"  # a read there would sync the device
        buffered = len(acc.buf)
    if mon._active:
        state = "active"
    elif mon._att is not None and not mon.config.attach:
        state = "hooks handed out"
    elif plan is not None and mon._att is not None:
        state = "closed"
    else:
        state = "not entered"
    return Facts("Monitor", type(mon.model).__name__, layers, tuple(names), n_targets, mon.n_forwards, tokens,
                 unread, buffered, state)  # fmt: skip


def config_target_names(targets, n_heads: int) -> tuple[list[str], int]:
    """(names as printed, rows per layer) of a config's targets, without a model (an engine's monitor
    before its state is read back): built-in (variant, rank) pairs, head targets, custom (name, basis)."""
    from .head_targets import HEAD_KINDS

    names, n = [], 0
    for t in targets:
        if isinstance(t[1], str) and t[0] in HEAD_KINDS:
            names.append(f"{t[0]}/{t[1]} ({n_heads} heads)")
            n += n_heads
        else:
            names.append(f"{t[0]}/{t[1]}" if isinstance(t[1], str) else str(t[0]))
            n += 1
    return names, n


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def _tokens(f: Facts) -> str:
    if f.tokens is None:
        return f"tokens {f.unread}"
    text = _count(f.tokens, "token")
    if f.buffered:
        text += f" + {_count(f.buffered, 'step')} buffered"
    return text


def _names(f: Facts) -> str:
    shown = list(f.targets[:N_NAMES]) + (["…"] if len(f.targets) > N_NAMES else [])
    return "[" + ", ".join(shown) + "]"


def facts_repr(f: Facts) -> str:
    """Monitor(LlamaForCausalLM, 30 layers × 2 targets [ov/modulus, ov_ln/modulus], 12 forwards, 3,057 tokens, active)."""
    return (
        f"{f.owner}({f.model}, {_count(f.layers, 'layer')} × {_count(f.n_targets, 'target')} {_names(f)}, "
        f"{_count(f.forwards, 'forward')}, {_tokens(f)}, {f.state})"
    )


def facts_html(f: Facts) -> str:
    """The same facts as a two-column table (a notebook cell's view)."""
    rows = [
        ("model", f.model),
        ("layers", f"{f.layers:,}"),
        ("targets", f"{f.n_targets:,}: " + ", ".join(f.targets)),
        ("forwards", f"{f.forwards:,}"),
        ("tokens", _tokens(f)),
        ("state", f.state),
    ]
    body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table><caption>{html.escape(f.owner)}</caption>{body}</table><p>the table: <code>summary()</code></p>"

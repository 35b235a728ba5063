"""The adapter interface: everything eigenhooks needs to know about a model's layout.

An adapter is the only object that knows where a family keeps its layers, which linear is
V and which is O, which norm feeds attention and where the residual stream can be read.
Everything downstream (spectra, monitor, dynamics, steering) talks to this interface.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..linalg.eig import Factors
from .calls import Calls
from .hooks import HookAttachment

NormPosition = Literal["pre", "post"]


class StopForward(Exception):
    """Raised inside a hook to end a forward pass once everything needed is captured."""


class UnsupportedModelError(TypeError):
    """Raised when no adapter fits a model (and the probe fallback cannot find attention)."""


class LayoutError(UnsupportedModelError):
    """A model of a known family that the family's rule cannot read (another layout, a variant not
    supported, a configuration the model itself cannot run). ``get_adapter`` re-raises it instead
    of falling back to the generic probe, whose guess would be silently wrong there."""


UnsupportedConfigError = LayoutError  # the name the GPT-lineage rules use


def layer_index(layer, n_layers: int, what: str = "layer") -> int:
    """``layer`` as an index in 0..n_layers-1, negative counting from the end (-1: the last).

    Python, numpy and 0-d torch integers are ints; bools are not (``True`` would be layer 1).

    Args:
        layer: the index given. n_layers: the model's attention layers. what: the argument's
            name, for the messages.

    Raises:
        TypeError: not an integer (a float, a bool, a string, a tensor of another shape or dtype).
        IndexError: out of range.
    """
    value = None
    if isinstance(layer, torch.Tensor):
        if layer.dim() == 0 and not (layer.is_floating_point() or layer.is_complex() or layer.dtype == torch.bool):
            value = int(layer)
    elif not isinstance(layer, bool) and type(layer).__name__ != "bool_":  # numpy < 2: np.bool_ has __index__
        try:
            value = operator.index(layer)
        except TypeError:
            pass
    if value is None:
        raise TypeError(f"{what} must be an int (negative counts from the end), got {layer!r} ({type(layer).__name__})")
    if not -n_layers <= value < n_layers:
        raise IndexError(
            f"{what} {value} is out of range for a model with {n_layers} attention layers: "
            f"use 0..{n_layers - 1} or -{n_layers}..-1"
        )
    return value % n_layers


@dataclass(frozen=True)
class Tap:
    """Where to read a tensor: a module's input or output (HF), or a hook name (TransformerLens)."""

    module: nn.Module | None = None
    where: Literal["input", "output"] = "output"
    hook_name: str | None = None


@dataclass(frozen=True)
class ReadingPoints:
    """Where the residual stream around one attention block is read (docs/design.md, "Mathematics").

    Values are read where they are consumed, so an edit by any other tool or hook is
    measured as the model computed it:

    pre: the residual as the attention sublayer receives it (the input of its norm in
        pre-norm models; the attention module's input in post-norm models).
    mid: the residual as the next sublayer receives it (the input of the MLP's norm in
        pre-norm models; the output of the post-attention norm in post-norm models).
        None for parallel attention+MLP blocks: no such state exists, and mid is formed
        as pre + attention output (documented, not a model state).
    post: what the next block receives (the next layer's ``pre`` tap, so post(t) and
        pre(t+1) are one reading), or the final norm's input, or the block's output.
    attn: the attention sublayer's output (used for ``mid`` of parallel blocks).
    post_norm: in post-norm models, LN_t, the norm applied after the attention add; the
        monitor applies it to ``pre`` to compare at equal normalisation.
    """

    pre: Tap
    mid: Tap | None
    post: Tap
    attn: Tap
    post_norm: nn.Module | None = None

    @property
    def mid_is_sum(self) -> bool:
        return self.mid is None


def as_tokens(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A tap's tensor in (b, n, d) shape: some blocks flatten tokens before a norm (OPT's MLP)."""
    if t is not None and t.shape != like.shape and t.numel() == like.numel():
        return t.reshape(like.shape)
    return t


@dataclass
class Layer:
    """One attention block, as the adapter sees it.

    Attributes:
        index: position in the unrolled stack (ALBERT's shared layer appears once per use).
        block: the block module (its input is 'pre', its output 'post').
        attn_in: the module whose ``hidden_states`` input is the attention input (probe target).
        attn_out: the module whose output is O (sum_j A_ij V x_j + b_V) + b_O.
        norm: the LayerNorm/RMSNorm feeding attention (pre-norm) or following it (post-norm).
        factors: a function returning this layer's (O, V) factors in the column convention.
        group: shared-weight group id; layers with equal ids share all attention weights.
        mid_in: the module whose first input is the 'mid' residual as the model forms it (the
            MLP's norm in pre-norm blocks); None for post-norm blocks (mid is the output of
            ``norm``) and for parallel attention+MLP blocks (no such state exists).
        parallel: attention and MLP read the same input (GPT-J, NeoX with parallel residual).
        pre_in: the module whose first input is the 'pre' residual, when it is neither the
            pre-norm ``norm`` nor (post-norm) ``attn_in``.
        mid_out: the module whose output is the 'mid' residual, when no module receives it
            as input (post-norm blocks: default ``norm``).
        post_in: the module whose first input is the 'post' residual, overriding the default
            (the next layer of the same stack, or the final norm).
        post_out: the module whose output is the 'post' residual, when no module receives it
            as input (an encoder-decoder's last decoder layer without a final norm).
        stack: which tower the layer belongs to ('' for single-stack models; 'encoder',
            'decoder', 'text', 'vision' otherwise). ``post`` never crosses a stack.
        kind: 'self' (attention over the residual it is added to) or 'cross' (the values come
            from another stack's states: F acts on those, not on this residual).
        probe_arg: the keyword of ``attn_in`` that carries the values (default: its
            ``hidden_states`` or first argument; 'key_value_states' etc. for cross-attention).
        linear: the value path is linear in x, so the probe is F exactly. False where it is
            not (attention sinks, a norm inside the value path): ``factors`` then gives the
            linear F of the weights and the probe is only a local linearisation.
        masked: the forward's ``attention_mask`` (batch, seq) marks this layer's tokens. False for
            a tower it does not describe (CLIP's vision tower beside the text tower): all of its
            tokens count.
        d_model: this layer's residual width, where it differs from the adapter's (CLIP's text
            and vision towers); None: ``Adapter.d_model``. See ``Adapter.width``.
        norm_offset: added to ``norm.weight`` to give the norm's real scale (Gemma's RMSNorm
            computes x_hat * (1 + w): offset 1.0); the family's ``Family.norm_offset``. See ``norm_scale``.
    """

    index: int
    block: nn.Module
    attn_in: nn.Module
    attn_out: nn.Module
    norm: nn.Module | None
    factors: Callable[[], Factors] | None
    group: int
    name: str = ""
    o_proj: nn.Module | None = None  # the output projection (nn.Linear, or GPT-2's Conv1D)
    mid_in: nn.Module | None = None
    parallel: bool = False
    pre_in: nn.Module | None = None
    mid_out: nn.Module | None = None
    post_in: nn.Module | None = None
    post_out: nn.Module | None = None
    stack: str = ""
    kind: Literal["self", "cross"] = "self"
    probe_arg: str | None = None
    linear: bool = True
    masked: bool = True
    d_model: int | None = None
    norm_offset: float = 0.0

    def __repr__(self) -> str:  # a line: where the layer sits and how its F is read; the modules are its fields
        where = f"{self.stack} " if self.stack else ""
        name = f" {self.name!r}" if self.name else ""
        f_from = "weights" if self.factors is not None else "the probe"
        return (
            f"Layer({where}{self.index}{name}: {type(self.block).__name__}, {self.kind}-attention, "
            f"norm {type(self.norm).__name__ if self.norm is not None else None}, group {self.group}, F from {f_from})"
        )


def norm_scale(norm: nn.Module | None, offset: float = 0.0) -> torch.Tensor | None:
    """The elementwise scale a norm multiplies its normalised input by: ``weight + offset``, float64.

    The one place that knows a norm's effective scale, for every family and for the final norm as for
    the blocks': Gemma's, Nemotron's and Qwen3-Next's norms compute x_hat * (1 + w) (offset 1.0, from
    the family table, or a module's ``eigenhooks_offset``). Float64 whatever the model's dtype: 1 + w
    in bf16 would round w away. None for a norm without a scale (a folded TransformerLens LNPre).
    """
    w = getattr(norm, "weight", None) if norm is not None else None
    if not isinstance(w, torch.Tensor):
        return None
    offset = offset or getattr(norm, "eigenhooks_offset", 0.0)
    w = w.detach().to(torch.float64)
    return w + offset if offset else w


@dataclass
class Adapter:
    """A model seen through one family's layout.

    Attributes:
        model: the wrapped model.
        family: e.g. 'gpt2', 'llama', 'lens-bridge'.
        backend: 'hf' or 'lens'.
        layers: the attention blocks in forward order.
        norm_position: 'pre' (norm, attention, residual add) or 'post' (add, then norm).
        d_model: residual width.
        notes: facts the user should know about the weights that were read (e.g. folded norms).
    """

    model: nn.Module
    family: str
    backend: str
    layers: list[Layer]
    norm_position: NormPosition
    d_model: int
    n_heads: int
    n_kv_heads: int
    final_norm_module: nn.Module | None = None
    final_norm_offset: float = 0.0  # added to the final norm's weight (Gemma: 1.0); see ``norm_scale``
    unembed_weight: Callable[[], torch.Tensor | None] = lambda: None
    notes: list[str] = field(default_factory=list)
    probe_runner: Callable | None = None  # backend-specific forward used by the probe
    reading_points_fn: Callable | None = None  # backend-specific reading points (hook names)
    final_in: bool = True  # the final norm's input is the last block's output (False: something sits between)
    probe_inputs: Callable | None = None  # (model, b, n, device) -> forward kwargs for the probe
    probe_separately: bool = False  # probe one layer per forward: the layers' probes interact
    # stack name -> (its root module, the kwarg of that module carrying the stack's padding mask, or None).
    # A stack's layers count only in forwards where its root ran, with that mask (encoder-decoders).
    stacks: dict = field(default_factory=dict)
    calls: Calls = field(default_factory=Calls)  # what a call of the model is: its mask, rows, KV cache

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:  # a line: the layout a reader checks; the model itself is ``model``
        stacks = sorted({layer.stack for layer in self.layers} - {""})
        towers = f" ({', '.join(stacks)})" if stacks else ""
        heads = f"{self.n_heads} heads" + (f" / {self.n_kv_heads} kv" if self.n_kv_heads != self.n_heads else "")
        notes = f", {len(self.notes)} note{'s' * (len(self.notes) != 1)}" if self.notes else ""
        return (
            f"Adapter({self.family!r} on {self.backend}, {type(self.model).__name__}: "
            f"{self.n_layers} layers{towers}, {self.norm_position}-norm, d_model={self.d_model}, {heads}{notes})"
        )

    def to_frame(self):
        """One row per layer (index, stack, name, block, kind, norm, group, F from weights), a pandas DataFrame."""
        import pandas as pd

        rows = [
            {
                "layer": layer.index,
                "stack": layer.stack,
                "name": layer.name,
                "block": type(layer.block).__name__,
                "kind": layer.kind,
                "norm": type(layer.norm).__name__ if layer.norm is not None else None,
                "group": layer.group,
                "parallel": layer.parallel,
                "linear": layer.linear,
                "F_from_weights": layer.factors is not None,
            }
            for layer in self.layers
        ]
        return pd.DataFrame(rows)

    def attachment(self, layers: dict, points, record, warn, read_mask: bool = True, layout=None):
        """What tells ``record`` (``attach.Record``) what this model computes at ``layers`` (the
        monitor's per-layer plans: ``reading``, ``mid_is_sum``, ``need_mid``, ``last_point``) and
        ``points``: hooks on its modules (``hooks.HookAttachment``). An engine with its own batch
        layout (flat token batches, a compiled graph) returns its own ``attach.Attachment``."""
        return HookAttachment(self, layers, points, record, warn, read_mask, layout)

    def width(self, layer: int) -> int:
        """The residual width d of one layer (towers of one model may differ)."""
        return self.layers[layer].d_model or self.d_model

    def factors(self, layer: int) -> Factors:
        """(O, V) of one layer, column convention (F = sum_h O_h V_h)."""
        fn = self.layers[layer].factors
        if fn is None:
            raise UnsupportedModelError(
                f"{self.family}: layer {layer} has no weight-reading rule; its F comes from the probe"
            )
        return fn()

    def norm_weight(self, layer: int) -> torch.Tensor | None:
        """The elementwise scale (d,) of the norm feeding (pre-norm) or following (post-norm) attention,
        float64 (``norm_scale``), or None for a norm without one."""
        ly = self.layers[layer]
        return norm_scale(ly.norm, ly.norm_offset)

    def shared_groups(self) -> list[list[int]]:
        """Lists of layer indices that share the same attention weights."""
        groups: dict[int, list[int]] = {}
        for layer in self.layers:
            groups.setdefault(layer.group, []).append(layer.index)
        return list(groups.values())

    def final_norm(self) -> nn.Module | None:
        return self.final_norm_module

    def final_norm_scale(self) -> torch.Tensor | None:
        """The final norm's elementwise scale (d,), float64 (Gemma's 1 + w), or None: what the readout, the
        full OV circuit and a token's steering direction fold into the unembedding (``norm_scale``)."""
        return norm_scale(self.final_norm_module, self.final_norm_offset)

    def unembedding(self) -> torch.Tensor | None:
        """(vocab, d) unembedding matrix, or None if the model has no LM head."""
        return self.unembed_weight()

    def reading_points(self, layer: int) -> ReadingPoints:
        if self.reading_points_fn is not None:
            return self.reading_points_fn(self, layer)
        ly = self.layers[layer]
        attn = Tap(ly.attn_out, "output")
        nxt = next((n for n in self.layers[layer + 1 :] if n.stack == ly.stack), None)
        if ly.post_in is not None:
            post = Tap(ly.post_in, "input")
        elif ly.post_out is not None:
            post = Tap(ly.post_out, "output")
        elif nxt is not None:
            post = self._pre_tap(nxt)
        elif ly.stack:
            post = Tap(ly.block, "output")
        elif self.final_norm_module is not None and self.final_in and self.norm_position == "pre":
            post = Tap(self.final_norm_module, "input")
        else:
            post = Tap(ly.block, "output")
        pre = self._pre_tap(ly)
        if ly.mid_in is not None:
            mid = Tap(ly.mid_in, "input")
        elif ly.mid_out is not None or (self.norm_position == "post" and ly.norm is not None):
            mid = Tap(ly.mid_out if ly.mid_out is not None else ly.norm, "output")
        else:
            mid = None  # parallel block: mid = pre + attention output
        post_norm = ly.norm if self.norm_position == "post" else None
        return ReadingPoints(pre=pre, mid=mid, post=post, attn=attn, post_norm=post_norm)

    def _pre_tap(self, ly: Layer) -> Tap:
        if ly.pre_in is not None:
            return Tap(ly.pre_in, "input")
        if self.norm_position == "pre":
            return Tap(ly.norm if ly.norm is not None else ly.block, "input")
        return Tap(ly.attn_in, "input")

    def describe(self) -> dict:
        return {
            "family": self.family,
            "backend": self.backend,
            "model_class": type(self.model).__name__,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "norm_position": self.norm_position,
            "shared_groups": self.shared_groups(),
            "notes": list(self.notes),
        }

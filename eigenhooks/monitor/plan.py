"""What a monitor measures, fixed once at entry: its targets and, per layer, a ``LayerPlan``.

``parse_targets`` checks the targets against the model (widths, layer keys). ``build_plan`` reads
the spectra (cached) and builds each layer's bases and null frames (``reduce.LayerBases``), the
facts its taps and reduction look up in every forward, and the arenas layers of one kind project
into. Nothing here runs in a forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..linalg.eig import RANKS
from ..models import Adapter, layer_index
from ..spectra import parallel_map
from ..spectra.compute import VARIANTS, spectra_by_rank
from . import fingerprint, stats
from . import head_targets as H
from .config import MonitorConfig
from .measures import Draw, registered
from .reduce import Arena, LayerBases, pad_to_stack, warm
from .sinks import check_tags


class TargetDef(NamedTuple):
    """One target as the user gave it: built-in (variant, rank), a head target (``head_targets``), or
    custom with a basis per layer."""

    name: str
    variant: str | None = None  # built-in and head targets only
    rank: str | None = None
    per_layer: dict[int, torch.Tensor] | None = None  # custom only: {layer: orthonormal (d, k) float64}
    heads: bool = False  # one target per query head: its principal subspace

    @property
    def builtin(self) -> bool:
        return self.per_layer is None


@dataclass(frozen=True)
class SpecFacts:
    """What a summary row says of a built-in target's spectrum: the spectrum itself (its eigenvectors, its
    heads') is not kept by the plan, which would hold a copy of every layer's for as long as the monitor."""

    kind: str
    lambda_1: complex
    gap_ratio: float

    @classmethod
    def of(cls, s) -> SpecFacts | None:
        """The facts of a LayerSpectrum or HeadSpectrum (None: a custom target's, which has none)."""
        return None if s is None else cls(s.kind, complex(s.lambda_1), float(s.gap_ratio))


@dataclass(frozen=True)
class TargetMeta:
    """What a summary row says of its target: its name, and for a built-in one the facts of the layer's
    spectrum (a head target's: its head's)."""

    name: str
    variant: str | None
    rank: str | None
    spec: SpecFacts | None  # a built-in target's layer spectrum's, a head target's head's; None for a custom one
    head: int | None = None  # a head target's query head


@dataclass(eq=False)
class LayerPlan:
    """One measured layer: its targets and bases, its reading points, and the facts a forward looks up."""

    index: int
    targets: list[stats.TargetSpec]
    meta: list[TargetMeta]
    bases: LayerBases
    reading: object  # models.ReadingPoints: where pre, attn, mid and post are read
    mid_is_sum: bool  # a parallel block: mid is pre + the attention's output, not a model state
    post_norm: torch.nn.Module | None  # post-norm: LN_t, the baseline's norm
    masked: bool  # the forward's attention_mask describes this layer's tokens
    stack: str | None  # its stack (Adapter.stacks) in an encoder-decoder
    need_mid: bool  # a mid reading is expected in every forward
    last_point: str  # the point whose reading completes the layer in a forward


@dataclass(eq=False)
class Plan:
    """Every measured layer's plan, the arenas they project into, the custom vectors' digests, and what is
    measured (the registered measures when it was built, then the researcher's own)."""

    layers: dict[int, LayerPlan]
    arenas: list[Arena]
    vectors: dict[str, dict[int, str]] = field(default_factory=dict)  # custom target -> {layer: digest}
    measures: tuple = ()

    def drop_frames(self) -> None:
        """Keep only what reading a state back needs (the table, the verdict of a sample brought here): each
        layer's null frames and their stacks go (``LayerBases.drop_frames``), and the arenas. A monitor whose
        readings another process projects (an engine's worker) holds no second copy of them."""
        for lp in self.layers.values():
            lp.bases.drop_frames()
        self.arenas = []


def parse_targets(adapter: Adapter, targets) -> tuple[list[TargetDef], dict[str, dict[int, str]]]:
    """The targets checked against the model, and each custom target's vector digests by layer.

    Raises:
        ValueError: a malformed target, an unknown variant or rank, names not unique.
        TargetError: a custom target of the wrong shape, not orthonormal, or with a bad layer key.
    """
    vectors: dict[str, dict[int, str]] = {}
    defs = [_parse_target(adapter, t, vectors) for t in targets]
    names = [d.name for d in defs]
    if len(set(names)) != len(names):
        raise ValueError(f"target names must be unique, got {names}")
    for d in defs:  # a custom target never takes a built-in row's name, given or not (its rows would mix)
        if not d.builtin and _builtin_name(d.name):
            raise ValueError(
                f"target name {d.name!r} is a built-in row's name ({_builtin_name(d.name)}); "
                "give your own target another name"
            )
    heads = [H.row_name(d.name, h) for d in defs if d.heads for h in range(adapter.n_heads)]
    check_tags(names + heads)  # and their sink tags: 'ov-modulus' and 'ov/modulus' would share one
    return defs, vectors


def _builtin_name(name: str) -> str | None:
    """What built-in row ``name`` is ('the target ("ov", "modulus")', 'head 3 of ("ov_head", "modulus")'), or None."""
    parts = name.split("/")
    if len(parts) == 2 and parts[1] in RANKS and (parts[0] in VARIANTS or parts[0] in H.HEAD_KINDS):
        return f"the target {tuple(parts)!r}"
    if (
        len(parts) == 3
        and parts[0] in H.HEAD_KINDS
        and parts[1] in RANKS
        and parts[2][:1] == "h"
        and parts[2][1:].isdigit()
    ):
        return f"head {int(parts[2][1:])} of the head target {tuple(parts[:2])!r}"
    return None


def _parse_target(ad: Adapter, t, vectors: dict) -> TargetDef:
    shape = "a target is (variant, rank), e.g. ('ov', 'modulus'), or (name, tensor | {layer: tensor})"
    if isinstance(t, str):
        raise ValueError(f"{shape}, got the string {t!r}")
    if not isinstance(t, tuple | list) or len(t) != 2:
        raise ValueError(f"{shape}, got {tuple(t) if isinstance(t, list) else t!r}")
    t = tuple(t)
    if isinstance(t[1], str):  # built-in (variant, rank), or a head target (kind, rank)
        kind, rank = t
        heads = H.is_head_target(t)
        if not heads and kind not in VARIANTS:
            kinds = VARIANTS + tuple(H.HEAD_KINDS)
            raise ValueError(f"variant must be one of {kinds}, got {kind!r} in target {t!r}")
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}, got {rank!r} in target {t!r}")
        return TargetDef(f"{kind}/{rank}", H.HEAD_KINDS[kind] if heads else kind, rank, heads=heads)
    name, U = t
    if not isinstance(name, str) or not name:
        raise ValueError(f"a custom target's name must be a non-empty string, got {name!r}")
    if not isinstance(U, dict):
        checked = {d: stats.check_target(name, U, d) for d in sorted({ad.width(i) for i in range(ad.n_layers)})}
        vectors[name] = dict.fromkeys(range(ad.n_layers), fingerprint.vector_digest(U))
        return TargetDef(name, per_layer={i: checked[ad.width(i)] for i in range(ad.n_layers)})
    if not U:
        raise stats.TargetError(f"target {name!r}: an empty dict measures no layer; give {{layer: tensor}}")
    per, given = {}, {}
    for key, u in U.items():
        try:
            layer = layer_index(key, ad.n_layers, f"target {name!r}: layer key")
        except (TypeError, IndexError) as e:
            raise stats.TargetError(str(e)) from None
        if layer in per:
            raise stats.TargetError(f"target {name!r}: layer keys {given[layer]!r} and {key!r} are both layer {layer}")
        given[layer] = key
        per[layer] = stats.check_target(name, u, ad.width(layer))
        vectors.setdefault(name, {})[layer] = fingerprint.vector_digest(u)
    return TargetDef(name, per_layer=dict(sorted(per.items())))


def seed(config: MonitorConfig, layer: int, which: int) -> int:
    """The seed of layer ``layer``'s null draws of one kind (each null family's ``which``; 1000: ties)."""
    return stats.draw_seed(config.null_seed, layer, which)


def build_plan(adapter: Adapter, config: MonitorConfig, defs: list[TargetDef], vectors: dict) -> Plan:
    """Spectra (cached), bases, null frames and facts for every layer a target measures."""
    ad, measures = adapter, registered() + config.measures
    top = max(4, 2 * config.eig_top)
    wanted: dict[tuple[str, bool], list[str]] = {}  # (variant, heads) -> ranking rules: one decomposition a layer
    for d in defs:
        for key in [(d.variant or "ov", False)] + ([(d.variant, True)] if d.heads else []):
            ranks = wanted.setdefault(key, [])
            if (d.rank or "modulus") not in ranks:
                ranks.append(d.rank or "modulus")
    specs = {  # (variant, rank, heads): the layer's spectra alone are those of a monitor without head targets
        (variant, rank, heads): layer_specs
        for (variant, heads), ranks in wanted.items()
        for rank, layer_specs in spectra_by_rank(ad, variant, tuple(ranks), top=top, heads=heads).items()
    }
    # each layer's bases and null frames, layers side by side (torch releases the GIL); an offloaded
    # model's layers are brought in one at a time, in order
    offloaded = any(p.device.type == "meta" for p in ad.model.parameters())
    built = parallel_map(lambda i: _layer(ad, config, defs, specs, measures, i), range(ad.n_layers), serial=offloaded)
    layers = {i: lp for i, lp in enumerate(built) if lp is not None}
    where = {lp.bases: w for lp in layers.values() if (w := _where(ad, lp.index)) is not None}
    on_cuda = bool(where) and len(where) == len(layers) and all(w[0].type == "cuda" for w in where.values())
    arenas = pad_to_stack([lp.bases for lp in layers.values()], widen_frames=on_cuda)  # one kind reduces together
    warm(arenas, where)
    return Plan(layers, arenas, vectors, measures)


def _targets(ad: Adapter, config: MonitorConfig, d: TargetDef, specs: dict, i: int) -> list[tuple]:
    """Layer i's (TargetSpec, TargetMeta) of one target: none, one, or one per head (head targets)."""
    if not d.builtin and i not in d.per_layer:
        return []
    variant = d.variant or "ov"  # a custom target's F: the layer's plain one
    s = specs[(variant, d.rank or "modulus", False)][i]
    if d.heads:  # each head's subspace, checked as a custom target is; ranked among the layer's F
        eig = stats.eig_subspaces(s.eigenvalues, s.eigenvectors, config.eig_top)
        out = []
        for p in H.heads_of(specs[(d.variant, d.rank, True)][i]):
            name = H.row_name(d.name, p.head)
            U = stats.check_target(name, p.basis, ad.width(i))
            t = stats.TargetSpec(name, U, U[:, 0] if U.shape[1] == 1 else None, eig, variant)
            out.append((t, TargetMeta(name, d.variant, d.rank, SpecFacts.of(p), p.head)))
        return out
    eig = stats.eig_subspaces(s.eigenvalues, s.eigenvectors, config.eig_top + (1 if d.builtin else 0))
    if d.builtin:
        U, eig = s.basis, eig[1:]  # the target is F's own top subspace: rank it among the others
    else:
        U = d.per_layer[i]
    v1 = U[:, 0] if U.shape[1] == 1 else None
    return [
        (
            stats.TargetSpec(d.name, U, v1, eig, variant),
            TargetMeta(d.name, d.variant, d.rank, SpecFacts.of(s if d.builtin else None)),
        )
    ]


def _layer(
    ad: Adapter, config: MonitorConfig, defs: list[TargetDef], specs: dict, measures: tuple, i: int
) -> LayerPlan | None:
    """Layer i's plan, or None if no target measures it."""
    pairs = [(pair, d.heads) for d in defs for pair in _targets(ad, config, d, specs, i)]
    if not pairs:
        return None
    tgts, meta, heads = [p[0] for p, _ in pairs], [p[1] for p, _ in pairs], [h for _, h in pairs]
    k_draw, k_max = H.frame_widths([t.k for t in tgts], heads)
    at = Draw(ad, config, i, tgts, heads, k_draw, k_max, lambda which: seed(config, i, which))
    frames = {m.name: f for m in measures if (f := m.draw(at)) is not None}  # each null family's
    bases = LayerBases(tgts, frames, config.null_stride, eig_slots=config.eig_top, measures=measures, layer=i)
    rp, ly = ad.reading_points(i), ad.layers[i]
    points = config.reading_points
    need_mid = "mid" in points and rp.mid is not None
    last = "post" if "post" in points else "mid" if need_mid else "attn"
    return LayerPlan(
        i, tgts, meta, bases, rp, rp.mid is None, rp.post_norm, getattr(ly, "masked", True), ly.stack, need_mid, last
    )


def _where(adapter: Adapter, i: int) -> tuple[torch.device, torch.dtype] | None:
    """The device and floating dtype of layer i's attention weights: where its activations will be."""
    ly = adapter.layers[i]
    for m in (ly.o_proj, ly.attn_out, ly.block):
        p = next((p for p in m.parameters() if p.is_floating_point()), None) if isinstance(m, torch.nn.Module) else None
        if p is not None and p.device.type != "meta":
            return p.device, p.dtype
    return None

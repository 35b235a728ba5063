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
from ..spectra.compute import VARIANTS, layer_stacked, spectra_by_rank
from . import fingerprint, stats
from .config import MonitorConfig
from .measures import MEASURES
from .reduce import Arena, LayerBases, pad_to_stack, warm
from .sinks import check_tags


class TargetDef(NamedTuple):
    """One target as the user gave it: built-in (variant, rank), or custom with a basis per layer."""

    name: str
    variant: str | None = None  # built-in only
    rank: str | None = None
    per_layer: dict[int, torch.Tensor] | None = None  # custom only: {layer: orthonormal (d, k) float64}

    @property
    def builtin(self) -> bool:
        return self.per_layer is None


@dataclass(frozen=True)
class TargetMeta:
    """What a summary row says of its target: its name, and for a built-in one the layer's spectrum."""

    name: str
    variant: str | None
    rank: str | None
    spec: object | None  # LayerSpectrum of a built-in target, None for a custom one


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
    """Every measured layer's plan, the arenas they project into, and the custom vectors' digests."""

    layers: dict[int, LayerPlan]
    arenas: list[Arena]
    vectors: dict[str, dict[int, str]] = field(default_factory=dict)  # custom target -> {layer: digest}


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
    check_tags(names)  # and their sink tags: 'ov-modulus' and 'ov/modulus' would share one
    return defs, vectors


def _parse_target(ad: Adapter, t, vectors: dict) -> TargetDef:
    shape = "a target is (variant, rank), e.g. ('ov', 'modulus'), or (name, tensor | {layer: tensor})"
    if isinstance(t, str):
        raise ValueError(f"{shape}, got the string {t!r}")
    if not isinstance(t, tuple | list) or len(t) != 2:
        raise ValueError(f"{shape}, got {tuple(t) if isinstance(t, list) else t!r}")
    t = tuple(t)
    if isinstance(t[1], str):
        variant, rank = t
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r} in target {t!r}")
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}, got {rank!r} in target {t!r}")
        return TargetDef(f"{variant}/{rank}", variant, rank)
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
    """The seed of layer ``layer``'s null draws of one kind (0: Haar, 1+j: the j-th F-null, 1000: ties)."""
    return (config.null_seed * 1_000_003 + layer * 101 + which) % (2**63)


def build_plan(adapter: Adapter, config: MonitorConfig, defs: list[TargetDef], vectors: dict) -> Plan:
    """Spectra (cached), bases, null frames and facts for every layer a target measures."""
    ad = adapter
    top = max(4, 2 * config.eig_top)
    wanted: dict[str, list[str]] = {}  # variant -> ranking rules: one eigen-decomposition a layer for all
    for d in defs:
        ranks = wanted.setdefault(d.variant or "ov", [])
        if (d.rank or "modulus") not in ranks:
            ranks.append(d.rank or "modulus")
    specs = {
        (variant, rank): layer_specs
        for variant, ranks in wanted.items()
        for rank, layer_specs in spectra_by_rank(ad, variant, tuple(ranks), top=top).items()
    }
    # each layer's bases and null frames, layers side by side (torch releases the GIL); an offloaded
    # model's layers are brought in one at a time, in order
    offloaded = any(p.device.type == "meta" for p in ad.model.parameters())
    built = parallel_map(lambda i: _layer(ad, config, defs, specs, i), range(ad.n_layers), serial=offloaded)
    layers = {i: lp for i, lp in enumerate(built) if lp is not None}
    where = {lp.bases: w for lp in layers.values() if (w := _where(ad, lp.index)) is not None}
    on_cuda = bool(where) and len(where) == len(layers) and all(w[0].type == "cuda" for w in where.values())
    arenas = pad_to_stack([lp.bases for lp in layers.values()], widen_frames=on_cuda)  # one kind reduces together
    warm(arenas, where)
    return Plan(layers, arenas, vectors)


def _layer(ad: Adapter, config: MonitorConfig, defs: list[TargetDef], specs: dict, i: int) -> LayerPlan | None:
    """Layer i's plan, or None if no target measures it."""
    tgts, meta = [], []
    for d in defs:
        if not d.builtin and i not in d.per_layer:
            continue
        s = specs[(d.variant or "ov", d.rank or "modulus")][i]
        eig = stats.eig_subspaces(s.eigenvalues, s.eigenvectors, config.eig_top + (1 if d.builtin else 0))
        if d.builtin:
            U, eig = s.basis, eig[1:]  # the target is F's own top subspace: rank it among the others
        else:
            U = d.per_layer[i]
        v1 = U[:, 0] if U.shape[1] == 1 else None
        fkey = d.variant or "ov"
        tgts.append(stats.TargetSpec(d.name, U, v1, eig, fkey if config.fnull_draws else None))
        meta.append(TargetMeta(d.name, d.variant, d.rank, s if d.builtin else None))
    if not tgts:
        return None
    k_max = max(t.k for t in tgts)
    haar = stats.haar_frames(ad.width(i), k_max, config.null_draws, seed(config, i, 0))
    fnull = {}
    for fkey in sorted({t.fnull for t in tgts if t.fnull}):
        O, V = layer_stacked(ad, i, fkey)
        fnull[fkey] = stats.power_step_frames(
            lambda G, O=O, V=V: O @ (V @ G), ad.width(i), k_max, config.fnull_draws, seed(config, i, 1 + len(fnull))
        )
    bases = LayerBases(
        tgts, haar, fnull, config.stride, eig_slots=config.eig_top, measures=MEASURES + config.measures, layer=i
    )
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

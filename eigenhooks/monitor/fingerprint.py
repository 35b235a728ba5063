"""What a monitor's sums mean, as a fingerprint that merges and all_reduce compare before adding.

Two states add up only if every column counts the same thing: the same model (the weights
that define each layer's F, hashed exactly: ``spectra.weights_digest``), the same targets in
the same order with the same vectors and k per layer, the same reading points, and the same
null settings (seed, draws, eig_top, stride). The fingerprint records all of them as plain
JSON; ``differences`` names what differs (which field, which layer or target, this vs that),
and ``parse_layers`` reads a saved state's sums, checking each layer, key and shape.

Digests are exact (bytes as stored), never hashes of computed spectra: eigenvectors may differ
in their last bits from one machine to another, the weights and a user's vectors do not.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch

from ..linalg.cache import tensors_digest
from ..spectra.compute import weights_digest
from .measures import owner

FORMAT = 2  # the fingerprint's own version: a state of another format is refused, never guessed (2: xxh3)
SHOWN = 3  # differences named in one message


def vector_digest(u) -> str:
    """Exact hash of a custom target as given (real inputs as float64, complex ones as complex128).

    The same values in float32 and float64 hash alike only when the float32 ones widen exactly.
    """
    t = torch.as_tensor(u).detach().to("cpu")
    t = t.to(torch.complex128 if t.is_complex() else torch.float64)
    return tensors_digest([t], {"digest": "target"})


def fingerprint(adapter, config, plan, target_defs) -> dict:
    """The fingerprint of a monitor's plan.

    Args:
        adapter: the model's adapter. config: the ``MonitorConfig``. plan: the ``Plan`` (its
            layers, and each custom target's vector digests by layer). target_defs: the targets, in order.
    """
    ad = adapter
    try:
        dtype = str(next(ad.model.parameters()).dtype).replace("torch.", "")
    except StopIteration:
        dtype = None
    by_group: dict[int, str] = {}  # shared-weight layers are hashed once
    layers = {}
    for i, lp in sorted(plan.layers.items()):
        group = ad.layers[i].group
        if group not in by_group:
            by_group[group] = weights_digest(ad, i)
        layers[str(i)] = {
            "weights": by_group[group],
            "targets": {
                meta.name: {"k": t.k, "vector": plan.vectors.get(meta.name, {}).get(i)}
                for t, meta in zip(lp.targets, lp.meta)
            },
        }
    return {
        "format": FORMAT,
        "settings": {
            **{k: v for m in plan.measures for k, v in m.fingerprint(config).items()},  # each measure's keys
            "reading_points": list(config.reading_points),
            **({"measures": [m.name for m in config.measures]} if config.measures else {}),
        },
        "model": {
            "n_layers": ad.n_layers,
            "widths": [ad.width(i) for i in range(ad.n_layers)],
            "norm_position": ad.norm_position,
            "dtype": dtype,
        },
        "targets": [d[0] for d in target_defs],
        "layers": layers,
    }


def check_state(ours: dict, state, expected: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """A saved state's sums as float64 tensors, once its fingerprint, layers, keys and shapes all match ``ours``.

    Raises:
        ValueError: the state is no state, predates the fingerprint, or differs; the message names what.
    """
    if not isinstance(state, dict):
        raise ValueError(f"a monitor state is the dict state_dict() returns, got {type(state).__name__}")
    if "fingerprint" not in state:
        what = "predates the fingerprint (saved by an older eigenhooks)" if "layout" in state else "has no fingerprint"
        raise ValueError(
            f"this state {what}: it does not record the model's weights, the target vectors or the reading "
            "points, so it cannot be checked against this monitor; recompute it with this version"
        )
    diffs = differences(ours, state["fingerprint"], "here", "in the state")
    if diffs:
        raise ValueError(
            f"the state's layout differs from this monitor's: {mismatch(diffs)}. Merge only states of the "
            "same model weights, targets, reading points and null settings"
        )
    return parse_layers(state, expected)


def check_ranks(fp: dict, dist, group) -> None:
    """Raise the same ValueError on every rank unless all ranks' fingerprints agree.

    Short digests go round first; only when they differ do the whole fingerprints, to name
    the difference. Every rank takes the same branch, so none waits on a collective alone.
    """
    world = dist.get_world_size(group)
    digests: list = [None] * world
    dist.all_gather_object(digests, digest(fp), group=group)
    if len(set(digests)) == 1:
        return
    fps: list = [None] * world
    dist.all_gather_object(fps, fp, group=group)
    r = next(r for r in range(world) if digests[r] != digests[0])
    diffs = differences(fps[0], fps[r], "on rank 0", f"on rank {r}")
    raise ValueError(
        f"all_reduce: rank {r} differs from rank 0, so their sums cannot be added: {mismatch(diffs)}. "
        "Every rank needs the same model weights, targets, reading points and null settings"
    )


def digest(fp: dict) -> str:
    """A short hash of a whole fingerprint (what ranks compare first)."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def _short(v):
    return v[:8] if isinstance(v, str) and len(v) in (32, 40) else v


def differences(ours: dict, theirs, here: str, there: str) -> list[str]:
    """Each way ``theirs`` differs from ``ours``, as 'where, field: this here vs that there', most telling first.

    A difference found alike in several layers (a shared target's vector) is named once, with its layers.
    """
    out: list[str] = []
    per_layer: dict[str, list[int]] = {}  # "field: this vs that" -> the layers where it differs

    def cmp(label: str, a, b, layer: int | None = None) -> None:
        if a == b:
            return
        line = f"{label}: {_short(a)} {here} vs {_short(b)} {there}"
        if layer is None:
            out.append(line)
        else:
            per_layer.setdefault(line, []).append(layer)

    if not isinstance(theirs, dict):
        return [f"fingerprint: a dict {here} vs {type(theirs).__name__} {there}"]
    if theirs.get("format") != ours["format"]:
        return [f"fingerprint format: {ours['format']} {here} vs {theirs.get('format')!r} {there}"]
    for section in ("settings", "model"):
        got = theirs.get(section) if isinstance(theirs.get(section), dict) else {}
        for key, value in ours[section].items():
            cmp(key, value, got.get(key))
    cmp("targets", ours["targets"], theirs.get("targets"))
    got_layers = theirs.get("layers") if isinstance(theirs.get("layers"), dict) else {}
    mine = sorted(int(i) for i in ours["layers"])
    cmp("layers", mine, sorted(_ints(got_layers)))
    for i in mine:
        a, b = ours["layers"][str(i)], got_layers.get(str(i))
        if not isinstance(b, dict):
            continue
        cmp("weights", a["weights"], b.get("weights"), i)
        b_targets = b.get("targets") if isinstance(b.get("targets"), dict) else {}
        for name, ta in a["targets"].items():
            tb = b_targets.get(name)
            if not isinstance(tb, dict):
                continue
            cmp(f"target {name!r}, k", ta["k"], tb.get("k"), i)
            if ta["k"] == tb.get("k"):
                cmp(f"target {name!r}, vector", ta["vector"], tb.get("vector"), i)
    order = lambda item: (not item[0].startswith("weights"), item[1][0])  # noqa: E731 (other weights explain the rest)
    for line, layers in sorted(per_layer.items(), key=order):
        out.append(f"{'layer' if len(layers) == 1 else 'layers'} {', '.join(map(str, layers))}, {line}")
    return out


def _ints(keys) -> list[int]:
    return [int(k) for k in keys if isinstance(k, str) and k.lstrip("-").isdigit()]


def mismatch(diffs: list[str]) -> str:
    """The differences as one line: the first few, and how many more."""
    more = f" (and {len(diffs) - SHOWN} more)" if len(diffs) > SHOWN else ""
    return "; ".join(diffs[:SHOWN]) + more


def parse_layers(state: dict, expected: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """A saved state's sums as float64 tensors, each layer, key and shape checked against ``expected``.

    Raises:
        ValueError: a layer or key missing or extra, a value not a rectangular array of numbers, a
            wrong shape; the message names the layer and key.
    """
    layers = state.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"the state has no 'layers' dict (got {type(layers).__name__}); pass a Monitor.state_dict()")
    for key in layers:
        if not (isinstance(key, str) and key.isdigit() and int(key) in expected):
            raise ValueError(
                f"layer {key}: in the state but not a layer of this monitor (it measures {sorted(expected)})"
            )
    out = {}
    for i, want in expected.items():
        got = layers.get(str(i))
        if not isinstance(got, dict):
            raise ValueError(f"layer {i}: missing from the state (it has layers {sorted(_ints(layers))})")
        extra = sorted(set(got) - set(want))
        if extra:
            raise ValueError(f"layer {i}, {extra[0]!r}: in the state but not a field of this monitor's sums")
        out[i] = {}
        for key, ref in want.items():
            if key not in got:
                raise ValueError(f"layer {i}, {key!r}: missing from the state")
            where = f"layer {i}, {key!r}"
            if _has_bool(got[key]):
                raise ValueError(f"{where}: holds true/false values; the sums are numbers (a damaged or edited state)")
            try:
                t = torch.tensor(got[key], dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{where}: not a rectangular array of numbers ({e})") from None
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"{where}: shape {tuple(t.shape)} in the state, expected {tuple(ref.shape)}")
            _check_sums(where, key, t, _target_names(state, i))
            out[i][key] = t
    return out


def _has_bool(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dtype == torch.bool
    if isinstance(v, bool):
        return True
    return isinstance(v, list | tuple) and any(_has_bool(x) for x in v)


def _target_names(state: dict, i: int) -> list[str]:
    """The targets of layer i's rows, in order, as the state's fingerprint lists them ([] if it cannot say)."""
    try:
        return list(state["fingerprint"]["layers"][str(i)]["targets"])
    except (KeyError, TypeError):
        return []


def _check_sums(where: str, key: str, t: torch.Tensor, targets: list[str]) -> None:
    """No entry a forward could not have written (the field's measure says which: ``Builtin.damaged``);
    a ValueError naming the field and entry otherwise. A researcher's own fields are its own."""
    m = owner(key)
    if m is None:
        return
    bad = m.damaged(key, t)
    if not bool(bad.any()):
        return
    at = tuple(int(x) for x in bad.nonzero()[0])
    value = float(t[at])
    what = "not finite" if not math.isfinite(value) else "negative, and it counts or adds up non-negative terms"
    raise ValueError(f"{where}, {m.entry(key, at, targets)}: {value} is {what} (a damaged or edited state)")

"""Models dispatched with accelerate: read offloaded weights one layer at a time.

``accelerate`` (``cpu_offload``, ``dispatch_model`` / ``from_pretrained(device_map=...)``
with CPU or disk offload) leaves offloaded parameters on the meta device and keeps their
values in the ``weights_map`` of an ``AlignDevicesHook`` attached as ``module._hf_hook``;
the hook loads them for each forward and drops them after. eigenhooks reads spectra the
same way: :func:`onloaded` brings in one layer's attention weights (into host memory),
the caller copies what it needs, and the weights go back to meta on exit, so the whole
model is never materialised.

accelerate is never imported here: a model it dispatched carries its hooks, and those
are recognised by their attributes (``offload``, ``weights_map``, ``pre_forward``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn


def _align_hooks(module: nn.Module) -> list:
    """The accelerate AlignDevicesHook(s) attached to ``module`` (inside a SequentialHook too)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    hooks = list(getattr(hook, "hooks", None) or [hook])
    return [h for h in hooks if hasattr(h, "weights_map") and hasattr(h, "offload")]


def _offload_hook(module: nn.Module):
    """The hook that offloads ``module``'s weights (a weights_map holds them), or None."""
    return next((h for h in _align_hooks(module) if h.offload and h.weights_map is not None), None)


def _map_keys(mapping, seen: dict[int, list[str]]) -> set[str]:
    """Keys of an offload map, without loading a value (a disk map loads on ``in``).

    ``seen`` caches the key list of each underlying map (cpu_offload shares one state dict).
    """
    prefix = ""
    while hasattr(mapping, "prefix") and hasattr(mapping, "dataset"):  # accelerate's PrefixedDataset
        prefix, mapping = mapping.prefix + prefix, mapping.dataset
    if id(mapping) not in seen:
        keys = mapping.keys() if isinstance(mapping, dict) else getattr(mapping, "all_keys", None) or mapping
        seen[id(mapping)] = list(keys)
    return {k[len(prefix) :] for k in seen[id(mapping)] if k.startswith(prefix)}


def is_offloaded(model: nn.Module) -> bool:
    """True when some module's weights live in an accelerate offload map."""
    return any(_offload_hook(m) is not None for m in model.modules())


def empty_meta_parameters(model: nn.Module) -> list[str]:
    """Names of meta-device parameters that no offload map holds: truly empty weights.

    Offloaded parameters (meta in the module, values in an ``AlignDevicesHook`` weights
    map of their module, or of an ancestor that places its submodules) are not listed.

    Returns:
        Dotted parameter names, in ``named_parameters`` order.
    """
    covered: set[str] = set()
    seen: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        hook = _offload_hook(module)
        if hook is None:
            continue
        prefix = f"{name}." if name else ""
        covered.update(prefix + k for k in _map_keys(hook.weights_map, seen))
    return [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in covered]


def _modules_to_onload(model: nn.Module, targets: list[nn.Module]) -> list[tuple[nn.Module, object]]:
    """Offload-hooked modules whose weights the targets need: each target's own subtree, and an
    ancestor whose hook places its submodules (its map then holds the target's weights)."""
    names = {id(m): n for n, m in model.named_modules()}
    wanted = [names[id(t)] for t in targets if id(t) in names]
    out = []
    for name, module in model.named_modules():
        hook = _offload_hook(module)
        if hook is None:
            continue
        inside = any(name == w or name.startswith(f"{w}.") or w == "" for w in wanted)
        above = hook.place_submodules and any(name == "" or w.startswith(f"{name}.") for w in wanted)
        if inside or above:
            out.append((module, hook))
    return out


@contextmanager
def _onload_one(module: nn.Module, hook) -> Iterator[None]:
    """Load one module's offloaded weights into host memory, and drop them again on exit."""
    saved = hook.execution_device
    hook.execution_device = torch.device("cpu")  # spectra are computed on the CPU, in float64
    try:
        hook.pre_forward(module)
        yield
    finally:
        hook.post_forward(module, None)  # offload=True: the weights go back to meta
        hook.execution_device = saved


@contextmanager
def onloaded(model: nn.Module, modules: list[nn.Module | None]) -> Iterator[bool]:
    """Bring the offloaded weights of ``modules`` (and their submodules) into host memory.

    Inside the block their parameters are real CPU tensors; on exit they are on the meta
    device again and the memory is free. Modules without offloaded weights are untouched.

    Args:
        model: the dispatched model (its module names locate the hooks).
        modules: the modules whose weights are needed (None entries are skipped).

    Yields:
        True if any weights were brought in (the caller must copy what it keeps), else False.

    Example:
        >>> with onloaded(model, [model.model.layers[3].self_attn]) as loaded:  # doctest: +SKIP
        ...     O = model.model.layers[3].self_attn.o_proj.weight.clone()
    """
    targets = [m for m in modules if isinstance(m, nn.Module)]
    if not any([p.device.type == "meta" for t in targets for p in t.parameters()]):
        yield False  # every weight they need is in place (offloaded ones sit on meta): no walk of the model
        return
    todo = _modules_to_onload(model, targets)
    with ExitStack() as stack:
        for module, hook in todo:
            stack.enter_context(_onload_one(module, hook))
        yield bool(todo)


def source_modules(model: nn.Module, tensors: list[torch.Tensor]) -> list[nn.Module] | None:
    """The modules whose parameters ``tensors`` are views of, or None if one is not a view of a parameter.

    Called with factors read from meta (offloaded) parameters: reading F's factors on meta
    costs nothing, and the views tell which weights they come from (Llama's ``v_proj`` and
    ``o_proj``, not ``q_proj`` and ``k_proj``, which are as large), so only those are
    brought in.

    Args:
        model: the model the parameters belong to.
        tensors: views (``reshape``, ``permute``, slices) of some of its parameters.
    """
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    out: dict[int, nn.Module] = {}
    for t in tensors:
        base = t if t._base is None else t._base
        m = owner.get(id(base))
        if m is None:
            return None
        out[id(m)] = m
    return list(out.values())

"""Memory of ``eh.spectra`` on a 70B-shaped offloaded stack stays per layer.

A Llama-70B-shaped model (d=8192, 64 query heads, 8 kv heads x 128, MLP 28672, bf16;
80 layers by default) is built under accelerate's ``init_empty_weights``: every weight is
on the meta device. Its weights come from a lazy offload map that draws each tensor
(seeded, deterministic) only when accelerate's ``AlignDevicesHook`` asks for it, i.e. one
module at a time; ``cpu_offload(model, state_dict=map)`` attaches the hooks. The whole
model (~130 GiB) is never in memory; spectra read it layer by layer.

Prints the resident memory (RSS, sampled every 20 ms, and the kernel's peak) before,
during (at several layer counts, to show it is flat) and after, against the size of one
layer's attention weights, one whole layer and the whole model; and checks one layer's
spectrum against a direct computation from the same weights.

Usage: python benchmarks/bench_offload.py [--layers 80]   (needs the dev extra: accelerate, psutil)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import threading
import time
import zlib
from collections.abc import Mapping

import psutil
import torch

GiB = 2**30


def trimmed_rss(proc) -> int:
    """RSS after glibc's malloc_trim(0): freed heap pages the allocator kept are returned first.

    Without it RSS also counts memory freed but held in glibc's arenas (two threads draw and
    free ~0.3 GiB per layer), which is not live data; 0 where there is no glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return 0
    return proc.memory_info().rss


class LazyWeights(Mapping):
    """name -> a seeded random tensor of the model's shape and dtype, drawn on access."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]):
        self.shapes = shapes
        self.layers_read: set[int] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        if ".layers." in name:
            self.layers_read.add(int(name.split(".layers.")[1].split(".")[0]))
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class RssSampler(threading.Thread):
    """Samples this process's RSS every 20 ms; ``peak`` is the largest seen."""

    def __init__(self):
        super().__init__(daemon=True)
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)


def build(n_layers: int):
    import transformers as T
    from accelerate import cpu_offload, init_empty_weights

    cfg = T.LlamaConfig(
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        num_hidden_layers=n_layers,
        vocab_size=128,  # the embedding is not what this measures
        dtype=torch.bfloat16,
    )
    with init_empty_weights():
        model = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    weights = LazyWeights(shapes)
    cpu_offload(model, execution_device="cpu", state_dict=weights)
    return model.eval(), weights, shapes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=80)
    a = p.parse_args()
    import eigenhooks as eh

    proc = psutil.Process()
    model, weights, shapes = build(a.layers)
    nbytes = {n: s.numel() * torch.empty(0, dtype=d).element_size() for n, (s, d) in shapes.items()}
    layer0 = [n for n in nbytes if ".layers.0." in n]
    attn = sum(nbytes[n] for n in layer0 if "self_attn" in n or "input_layernorm" in n)
    layer = sum(nbytes[n] for n in layer0)
    total = sum(nbytes.values())
    meta = sum(p.device.type == "meta" for p in model.parameters())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {a.layers} layers (70B has 80)")
    print(
        f"model: {total / GiB:.1f} GiB of bf16 weights, {meta}/{len(shapes)} parameters on meta; one layer "
        f"{layer / GiB:.2f} GiB, of which attention (q, k, v, o, norm) {attn / GiB:.3f} GiB"
    )
    base = proc.memory_info().rss
    print(f"RSS before spectra: {base / GiB:.2f} GiB")

    sampler = RssSampler()
    sampler.start()
    # Layer 1, the middle, the last, and every eighth in between (1, 10, 20, 30, 40, ..., 80).
    marks = sorted({1, max(1, a.layers // 2), a.layers} | {max(1, a.layers * k // 8) for k in range(1, 9)})
    seen: dict[int, tuple[int, int]] = {}

    def watch():
        while not sampler.stop.is_set():
            n = len(weights.layers_read)
            for m in marks:  # a mark passed between two polls (two layers in flight) still counts
                if n >= m and m not in seen:
                    seen[m] = (proc.memory_info().rss, trimmed_rss(proc))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t = time.perf_counter()
    specs = eh.spectra(model, cache=False)
    dt = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    watcher.join()
    after = proc.memory_info().rss
    gc.collect()
    after_trim = trimmed_rss(proc)
    for n in sorted(seen):
        raw, trim = seen[n]
        print(
            f"  after {n:3d} layers read: RSS {raw / GiB:.2f} GiB (+{(raw - base) / GiB:.2f}); "
            f"after malloc_trim {trim / GiB:.2f} GiB (+{(trim - base) / GiB:.2f})"
        )
    print(f"spectra of {len(specs)} layers in {dt:.0f} s ({dt / len(specs):.1f} s per layer)")
    peak = sampler.peak - base
    kernel_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        f"peak RSS {sampler.peak / GiB:.2f} GiB (kernel's peak {kernel_peak / GiB:.2f} GiB), +{peak / GiB:.2f} GiB over "
        f"the start = {peak / attn:.1f}x one layer's attention weights, {peak / layer:.2f}x one whole layer, "
        f"{peak / total:.4f}x the whole model; RSS after {after / GiB:.2f} GiB, "
        f"after malloc_trim {after_trim / GiB:.2f} GiB ({len(specs)} spectra kept)"
    )
    still_meta = sum(p.device.type == "meta" for p in model.parameters())
    print(f"parameters still on meta after spectra: {still_meta}/{len(shapes)}")

    # Check: layer 0's spectrum from the same weights, drawn directly (not through accelerate).
    from eigenhooks.linalg.eig import Factors

    pre = "model.layers.0.self_attn."
    f = Factors.from_stacked(weights[pre + "o_proj.weight"], weights[pre + "v_proj.weight"], 64, 8)
    ref = eh.layer_spectrum(f)
    err = abs(ref.lambda_1 - specs[0].lambda_1) / abs(ref.lambda_1)
    ok = err < 1e-9 and still_meta == meta and len(specs) == a.layers
    print(f"check: layer 0 lambda_1 {specs[0].lambda_1:.6g} vs direct {ref.lambda_1:.6g} (rel {err:.1e}): {ok}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Where a monitored forward and a monitored generate spend their time on a CUDA device.

Builds the Llama-3.2-1B shape (random weights, bf16; ``--shape llama-8b`` for the other), enters the
monitor, and runs torch.profiler over monitored forwards and a monitored ``generate``, and the same
without the monitor. Prints the CUDA kernels and the CPU-side ops that take the most time, and the
totals side by side. Writes the tables to ``$OUT/gpu_profile.txt`` when OUT is set.

Usage: python benchmarks/gpu_profile.py [--shape llama-1b] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as gc  # noqa: E402


def _profile(fn, dev, n: int = 2):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    fn()
    gc.sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        gc.sync(dev)
    return prof


def _totals(prof) -> tuple[float, float]:
    ev = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in ev) / 1e3
    dev = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ev) / 1e3
    return cpu, dev


def _added(plain, monitored) -> list[tuple[str, int, float, float]]:
    """Per op (and kernel) name: the monitored profile's calls and self times minus the plain one's,
    largest added device time first (then host time): what the monitor itself costs, by op."""

    def by_name(prof):
        return {
            e.key: (
                e.count,
                e.self_cpu_time_total / 1e3,
                getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3,
            )
            for e in prof.key_averages()
        }

    p, m = by_name(plain), by_name(monitored)
    rows = []
    for k in set(p) | set(m):
        (pc, pt, pd), (mc, mt, md) = p.get(k, (0, 0.0, 0.0)), m.get(k, (0, 0.0, 0.0))
        rows.append((k, mc - pc, mt - pt, md - pd))
    return sorted(rows, key=lambda r: (-r[3], -r[2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-1b", choices=sorted(gc.SHAPES))
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    import tempfile

    os.environ.setdefault("EIGENHOOKS_CACHE", tempfile.mkdtemp(prefix="eh-prof-"))
    import eigenhooks as eh

    dev = torch.device("cpu" if a.cpu else "cuda:0")
    shape = (gc.CPU_SHAPES if a.cpu else gc.SHAPES)[a.shape]
    plan = (gc.CPU_PLAN if a.cpu else gc.PLAN)[a.shape]
    model = gc.build_shape(shape, dev, torch.bfloat16)
    b, n = plan["fwd"]
    ids = torch.randint(0, shape["vocab_size"], (b, n), generator=torch.Generator().manual_seed(1)).to(dev)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gb, gp, gn = plan["gen"]
    gbatch = {"input_ids": ids[:gb, :gp], "attention_mask": torch.ones_like(ids[:gb, :gp])}

    def fwd():
        with torch.no_grad():
            model(**batch)

    def gen():
        with torch.no_grad():
            model.generate(**gbatch, max_new_tokens=gn, min_new_tokens=gn, do_sample=False, pad_token_id=0)

    lines = []
    say = lambda s: (print(s, flush=True), lines.append(s))  # noqa: E731
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    plain_f, plain_g = _profile(fwd, dev), _profile(gen, dev, 1)
    t = time.perf_counter()
    with eh.monitor(model):
        gc.sync(dev)
        say(f"entry {time.perf_counter() - t:.2f} s")
        mon_f, mon_g = _profile(fwd, dev), _profile(gen, dev, 1)
    for what, pp, mm in (("forward x2", plain_f, mon_f), ("generate x1", plain_g, mon_g)):
        (pc, pd), (mc, md) = _totals(pp), _totals(mm)
        say(f"{what}: self CPU {pc:.1f} -> {mc:.1f} ms, self CUDA {pd:.1f} -> {md:.1f} ms")
        say(mm.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=60))
        say(mm.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        say(f"{what}, what the monitor added (monitored - plain, by op; calls, self CPU ms, self device ms):")
        for name, calls, cpu, dev in _added(pp, mm)[:25]:
            say(f"  {name[:60]:60s} {calls:+7d} {cpu:+9.2f} {dev:+9.2f}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_profile.txt").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

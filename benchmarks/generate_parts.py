"""Where a monitored decoding step's extra host time goes, on generate_host.py's CPU proxy.

Five copies of the same weights run ``generate`` interleaved (the order alternating), thread CPU time:

- plain;
- hooks: no-op hooks of the same kinds on the same modules as the monitor's (torch's hooked
  ``_call_impl`` path, the floor of any hook-based tool);
- no buffer: the monitor, each step's readings dropped at its end instead of kept (the steps' own
  work, the prefill's reduction and the hooks);
- no flush: the monitor, its buffered steps kept until the flush and then dropped, not reduced;
- monitor: the monitor as it is.

Per decoding step (prefill and flushes amortised over a generate's forwards), the medians' differences
give: hook dispatch = hooks - plain; the monitor's own work a step and its prefill = no buffer - hooks;
holding a flush's steps = no flush - no buffer; the flush's reduction = monitor - no flush. The medians of paired ratios to plain are printed as well.
Only for reading the parts: the "no buffer" and "no flush" copies count wrong sums on purpose.

Usage: PYTHONPATH=. python benchmarks/generate_parts.py [--pairs 11]   (from the repository root)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_host as gh  # noqa: E402


def _copy_hooks(src, dst) -> int:
    """No-op hooks on dst's modules where src's have hooks, of the same kinds; returns how many."""
    n, mods = 0, dict(dst.named_modules())
    for name, m in src.named_modules():
        for hid in m._forward_pre_hooks:
            if hid in m._forward_pre_hooks_with_kwargs:
                mods[name].register_forward_pre_hook(lambda mod, a, k: None, with_kwargs=True)
            else:
                mods[name].register_forward_pre_hook(lambda mod, a: None)
            n += 1
        for hid in m._forward_hooks:
            always = hid in m._forward_hooks_always_called
            mods[name].register_forward_hook(lambda mod, a, o: None, always_call=always)
            n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=11)
    gh.add_proxy_args(p)
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import eigenhooks as eh

    model, kw = gh.build(a)
    plain, hooked, nobuf, noflush = (copy.deepcopy(model) for _ in range(4))
    with torch.no_grad(), eh.monitor(model), eh.monitor(noflush) as mon_nf, eh.monitor(nobuf) as mon_nb:
        n_hooks = _copy_hooks(model, hooked)
        acc = mon_nf._prepare()
        acc.flush = lambda: acc.buf.clear()  # the buffered steps dropped, not reduced
        mon_nb._prepare()._buffer = lambda steps, shapes: None  # each step's readings dropped at its end
        runs = {"plain": plain, "hooks": hooked, "no buffer": nobuf, "no flush": noflush, "monitor": model}
        for m in runs.values():
            m.generate(**kw)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(a.pairs):
            order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]
            for name, m in order:
                t0 = time.thread_time()
                m.generate(**kw)
                times[name].append(time.thread_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    us = lambda k: (med[k] - med["plain"]) / a.new * 1e6  # noqa: E731  per decoding step
    print(f"generate parts: generate_host.py's proxy, {a.batch} x ({a.prompt} + {a.new}), 1 thread, {a.pairs} rounds; "
          f"{n_hooks} no-op hooks; plain {med['plain'] * 1e3:.1f} ms a generate")  # fmt: skip
    for k in runs:
        r = statistics.median([t / p for t, p in zip(times[k], times["plain"])])
        print(f"  {k:9s} median {med[k] * 1e3:8.1f} ms  paired ratio {r:.3f}  +{us(k):5.0f} us a step")
    print(f"  hook dispatch {us('hooks'):.0f} us a step; the monitor's steps and prefill {us('no buffer') - us('hooks'):.0f}; "
          f"holding a flush's steps {us('no flush') - us('no buffer'):.0f}; "
          f"the flush's reduction {us('monitor') - us('no flush'):.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

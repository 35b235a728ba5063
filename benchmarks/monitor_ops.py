"""How many device ops the monitor adds to a forward, a generation step and a buffer flush.

On a GPU a monitored forward of a 1-8B model is bound by what the host enqueues: every op the
hooks and the reduction dispatch is a kernel launch and ~10 us of host time (an H200 profile of
the Llama-1B shape showed the host, not the device, setting the pace of a monitored forward).
This counts those ops on the CPU, where the count is the same as on CUDA and does not depend on
the machine's noise: a ``TorchDispatchMode`` records every aten op dispatched during a plain and
a monitored call of the same model (views and empty allocations, which launch nothing, left out),
and names the project's lines that dispatch the most.

Model: a 16-layer Llama of small width (random weights, float32), so the count is that of the
Llama-1B shape's 16 layers (the count depends on the layers and reading points, not the width).

``--generate`` (public API only, so it runs on any version of the code): the launching ops of a whole
``model.generate`` of 4 x (16 + 128) tokens, monitored minus plain, with the prefill's own extra ops
taken out and the rest (steps and buffer flushes) divided by the 128 decoding steps.

Usage: python benchmarks/monitor_ops.py [--layers 16] [--top 15] [--generate]
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as gc  # noqa: E402

NO_LAUNCH = {
    "view", "select", "slice", "unsqueeze", "expand", "unbind", "split", "alias", "as_strided", "t",
    "transpose", "permute", "_unsafe_view", "detach", "squeeze", "split_with_sizes", "chunk",
    "_reshape_alias", "lift_fresh", "empty", "empty_strided", "new_empty",
}  # fmt: skip


class Ops(TorchDispatchMode):
    """Counts the launching aten ops dispatched inside it, and the project's lines that dispatched them."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NO_LAUNCH:
            self.n += 1
            own = [f for f in traceback.extract_stack() if "/eigenhooks/" in f.filename]
            if own:
                f = own[-1]
                self.sites[f"{f.filename.split('/eigenhooks/')[-1]}:{f.lineno}  {(f.line or '').strip()[:60]}"] += 1
        return out


def count(fn) -> Ops:
    fn()  # warm: lazily made constants are not counted
    ops = Ops()
    with ops:
        fn()
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--generate", action="store_true", help="only the per-step count of a whole generate")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    import eigenhooks as eh

    if a.generate:
        return generate_ops(eh, a.layers)

    shape = dict(gc.CPU_SHAPES["llama-1b"], num_hidden_layers=a.layers, hidden_size=256, intermediate_size=512)
    model = gc.build_shape(shape, "cpu", torch.float32)
    ids = torch.randint(0, shape["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))

    def fwd():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))

    def step():  # one single-token forward with a KV cache, as generate makes
        with torch.no_grad():
            out = model(input_ids=ids[:, :16], attention_mask=torch.ones(4, 16, dtype=torch.long), use_cache=True)
            am = torch.ones(4, 17, dtype=torch.long)
            ops = Ops()
            with ops:
                model(input_ids=ids[:, 16:17], attention_mask=am, past_key_values=out.past_key_values, use_cache=True)
            return ops

    from eigenhooks.monitor import plan, reduce

    plain_f, plain_s = count(fwd), step()
    L = a.layers
    print(f"{L}-layer Llama, 4x128: plain forward {plain_f.n} ops, plain generation step {plain_s.n}")
    for layout, widen in (("CPU layout (frames kept)", False), ("CUDA layout (frames widened)", True)):
        # the monitor picks the layout from its layers' device; here both run on the CPU, counted alike
        plan.pad_to_stack = lambda rs, widen_frames=False, w=widen: reduce.pad_to_stack(rs, widen_frames=w)
        with eh.monitor(model) as mon:
            mon_f = count(fwd)
            mon_s = step()
            for _ in range(8):
                step()
            flush = Ops()
            with flush:
                mon._acc.flush()
            groups = len(mon._plan.arenas)
        print(f"{layout}, {groups} stacked group(s):")
        print(f"  forward +{mon_f.n - plain_f.n} ops ({(mon_f.n - plain_f.n) / L:.1f} per layer); "
              f"generation step +{mon_s.n - plain_s.n}; a flush of buffered steps {flush.n} ({flush.n / L:.1f} per layer)")  # fmt: skip
    plan.pad_to_stack = reduce.pad_to_stack
    print(f"lines that dispatch the most in a monitored forward, CUDA layout (of {sum(mon_f.sites.values())}):")
    for site, n in mon_f.sites.most_common(a.top):
        print(f"  {n:5d}  {site}")
    generate_ops(eh, a.layers)
    return 0


def generate_ops(eh, layers: int, new: int = 128) -> int:
    """Extra launching ops per decoding step of a whole generate (prefill's own extra taken out)."""
    shape = dict(gc.CPU_SHAPES["llama-1b"], num_hidden_layers=layers, hidden_size=256, intermediate_size=512)
    model = gc.build_shape(shape, "cpu", torch.float32)
    ids = torch.randint(0, shape["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)

    def gen():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=am, use_cache=True)

    plain_g, plain_p = count(gen), count(prefill)
    with eh.monitor(model):
        mon_p = count(prefill)
    with eh.monitor(model):
        gen()  # warm, as count() does
    ops = Ops()
    mon = eh.monitor(model).__enter__()
    with ops:  # the exit's flush of the buffered steps counts too
        gen()
        mon.__exit__(None, None, None)
    per_step = (ops.n - plain_g.n - (mon_p.n - plain_p.n)) / (new - 1)
    print(
        f"{layers}-layer Llama, generate 4 x (16 + {new}): plain {plain_g.n} ops, monitored {ops.n}; "
        f"prefill +{mon_p.n - plain_p.n}; per decoding step, flushes amortised: +{per_step:.1f} ops (goal <= 10)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

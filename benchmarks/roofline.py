"""A roofline estimate of the monitored forward on an H200, at the real Llama-3.2-1B and 3.1-8B shapes.

No GPU needed. Every launching aten op of a forward is recorded by a ``TorchDispatchMode`` with the
bytes it touches (its tensor inputs and outputs, views counted at their own size, broadcast axes
once) and its FLOPs (torch's flop counter formulas for matmuls and attention), and priced as one
kernel: max(bytes / bandwidth, FLOPs / peak of its input dtype, floor), the floor standing for a
small kernel's launch, ramp and tail. The estimated ratio is (plain + monitor) / plain.

How the forwards run without the weights: the plain model is built on ``torch.device("meta")`` at
its full depth and vocabulary (bfloat16), so nothing is allocated. The monitor needs real values at
its entry (spectra of F = O V), so its model is the same shape at full depth with real random
bfloat16 values in every layer's V and O only (1B: 0.17 GB, 8B: 1.3 GB), every other weight a
broadcast zero and a 512-token vocabulary; once entered it is moved to meta and run at the real
batch x sequence. Two internals are switched to what CUDA runs, as ``monitor_ops.py`` does: the
frames widened to one stacked group (``plan.pad_to_stack``) and the bfloat16 [B_hi | B_lo] matmuls
with float32 output (``reduce.kernels.has_out_dtype``), which otherwise hold only for tensors on a CUDA
device; where a name is missing the output says so.

Calibration: ``--calibrate`` runs the same count on another checkout of the package (the code
measured on the H200 at 1.18 (1B) and 1.07 (8B), commit a514878) and fits the floor so that its
estimate meets those ratios; the plain forward's matmul efficiency is fitted to the measured 1B
plain forward (45.7 ms, ../shared/gpu/h200-gpu_scale.log). The fused-read line prices the hooks'
reads as ``benchmarks/fused_read.py`` would make them: one read of each distinct activation
per layer (pre(t) is post(t-1)) plus the null rows, every other monitor kernel as counted.

Usage (from the repository root):
    PYTHONPATH=. python benchmarks/roofline.py [--shapes llama-1b llama-8b] [--floor-us 4] [--top 15]
    PYTHONPATH=. python benchmarks/roofline.py --calibrate OLD   (OLD: a folder holding a514878's eigenhooks/,
        e.g. mkdir OLD && git archive a514878 eigenhooks | tar -x -C OLD)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as gc  # noqa: E402
from monitor_ops import NO_LAUNCH  # noqa: E402

H200 = dict(bw=4.8e12, bf16=989e12, fp32=67e12)  # bytes/s; dense FLOP/s (bf16 tensor cores, fp32 FMA: no TF32)
FWD = {name: plan["fwd"] for name, plan in gc.PLAN.items()}  # batch x sequence
GOALS = {"llama-1b": 1.04, "llama-8b": 1.025}
MEASURED_OLD = {"llama-1b": 1.18, "llama-8b": 1.07}  # a514878 on the H200, median of paired ratios ~1.18 / 1.09
GATHERS = {"index_select", "gather", "index", "take", "embedding"}
PLAIN_1B_MS = 45.7  # measured plain 1B forward 8x1024 on the H200 (h200-gpu_scale.log)


@dataclass
class Cost:
    """Kernels of one kind, each as (bytes, FLOPs, peak: 'bf16' or 'fp32', aten op)."""

    ops: list = field(default_factory=list)

    def add(self, nbytes: float, flops: float, peak: str, name: str = "") -> None:
        self.ops.append((float(nbytes), float(flops), peak, name))


def price(ops, floor: float, mm_eff: float = 1.0, bw_eff: float = 1.0) -> float:
    """Seconds for these kernels run one after another: each its roofline time, at least the floor."""
    return sum(max(b / (H200["bw"] * bw_eff), f / (H200[p] * mm_eff), floor) for b, f, p, *_ in ops)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes of t: its view, broadcast (stride 0) axes once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _where() -> str:
    """Which part of the monitor dispatched the current op: 'read' (a hook's projections), 'reduce'
    (the stacked reduction and state), 'hook' (the rest of the hooks), or 'model'."""
    f, own = sys._getframe(2), []
    while f is not None:
        if "/eigenhooks/" in f.f_code.co_filename:
            own.append(f.f_code.co_name)
        f = f.f_back
    if not own:
        return "model"
    if "project" in own:
        return "read"
    if any(n in own for n in ("reduce_many", "_commit", "_add_all", "_flush")):
        return "reduce"
    return "hook"


class Record(TorchDispatchMode):
    """Costs of every launching op dispatched inside it, by where it came from. Attention
    (``F.scaled_dot_product_attention``, which meta tensors run as its math decomposition) is priced as
    the one fused kernel a GPU runs: q, k, v and the output once, causal FLOPs halved."""

    def __init__(self):
        super().__init__()
        self.by: dict[str, Cost] = {}
        self.inside_attention = False

    def __enter__(self):
        self._fn = _Attention(self)
        self._fn.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._fn.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in NO_LAUNCH or self.inside_attention:
            return out
        ins = [
            t
            for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
            if isinstance(t, torch.Tensor)
        ]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        if name in GATHERS:  # reads the rows it writes (and its index), not the whole source
            nbytes = 2 * sum(_nbytes(t) for t in outs) + sum(_nbytes(t) for t in ins[1:])
        flops = _flops(func, args, kwargs, out)
        half = any(t.dtype in (torch.bfloat16, torch.float16) for t in ins)
        self.by.setdefault(_where(), Cost()).add(nbytes, flops, "bf16" if half else "fp32", name)
        return out


def _flops(func, args, kwargs, out) -> float:
    """torch's flop formula for the op; for the forms it does not take (mm and bmm with out_dtype, whose
    formula would raise inside the monitor's try and send it down its fallback path), 2 m k n."""
    fn = flop_registry.get(func.overloadpacket)
    if fn is None:
        return 0.0
    if func.overloadpacket.__name__ in ("mm", "bmm") and isinstance(out, torch.Tensor):
        return 2.0 * out.numel() * args[0].shape[-1]
    return float(fn(*args, **kwargs, out_val=out))


class _Attention(TorchFunctionMode):
    def __init__(self, rec: Record):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or self.rec.inside_attention:
            return func(*args, **kwargs)
        self.rec.inside_attention = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.rec.inside_attention = False
        q, k, v = args[:3]
        causal = kwargs.get("is_causal", False) or (len(args) > 5 and args[5])
        flops = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1.0)
        nbytes = sum(_nbytes(t) for t in (q, k, v, out))
        self.rec.by.setdefault(_where(), Cost()).add(nbytes, flops, "bf16", "sdpa")
        return out


def _cuda_paths() -> str:
    """Take, on meta tensors, the code paths CUDA takes; say which could be switched."""
    said = []
    half = lambda device, dtype: dtype in (torch.bfloat16, torch.float16)  # noqa: E731
    try:  # the rebuilt monitor (reduce/ a package, plan.py) or the code before it (reduce.py, state.py)
        from eigenhooks.monitor.reduce import bases, kernels

        bases.has_out_dtype = kernels.has_out_dtype = half
        said.append("bf16 [hi|lo] matmuls")
    except ImportError:
        try:
            from eigenhooks.monitor import reduce

            reduce._has_out_dtype = half
            reduce._OUT_DTYPE.clear()
            said.append("bf16 [hi|lo] matmuls")
        except AttributeError:
            said.append("NOT the bf16 [hi|lo] matmuls (no switch found: float32 copies counted)")
    try:
        from eigenhooks.monitor import reduce

        try:
            from eigenhooks.monitor import plan as where
        except ImportError:
            from eigenhooks.monitor import state as where
        if hasattr(where, "pad_to_stack") and "widen_frames" in reduce.pad_to_stack.__code__.co_varnames:
            where.pad_to_stack = lambda rs, widen_frames=False: reduce.pad_to_stack(rs, widen_frames=True)
            said.append("frames widened to one group")
        else:
            said.append("the monitor's own grouping (no widen_frames switch)")
    except ImportError:
        said.append("the monitor's own grouping")
    return ", ".join(said)


def _ids(name: str) -> torch.Tensor:
    b, n = FWD[name]
    return torch.zeros(b, n, dtype=torch.long, device="meta")


def plain_cost(name: str) -> Cost:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**gc.SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    rec = Record()
    with torch.no_grad(), rec:
        model(input_ids=_ids(name))
    return rec.by["model"]


def monitored_model(name: str):
    """The shape's model at full depth with no memory to speak of: built on meta, then every layer's
    V and O (all the monitor's entry reads: F = O V) given random bfloat16 values (HF's init, std
    0.02), every other weight a broadcast zero (one element of storage); a 512-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**dict(gc.SHAPES[name], vocab_size=512), max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        for lin in (layer.self_attn.v_proj, layer.self_attn.o_proj):
            w = (torch.randn(lin.weight.shape, generator=g) * 0.02).to(torch.bfloat16)
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
    for mod in model.modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.device.type == "meta":
                zero = torch.zeros(1, dtype=p.dtype).expand(p.shape)
                setattr(mod, pname, torch.nn.Parameter(zero, requires_grad=False))
    return model


def monitor_cost(name: str) -> dict[str, Cost]:
    """The monitor's kernels in a forward of the shape at full depth (the second forward: the first
    makes the constants for the meta device, as a GPU's first forward does)."""
    import eigenhooks as eh

    model = monitored_model(name)
    with eh.monitor(model):
        model.to("meta")
        with torch.no_grad():
            model(input_ids=_ids(name))
            rec = Record()
            with rec:
                model(input_ids=_ids(name))
    return {k: v for k, v in rec.by.items() if k != "model"}


def raw(name: str) -> dict:
    """Everything priced later: the plain forward's kernels and the monitor's, by kind."""
    import inspect

    import eigenhooks as eh

    b, n = FWD[name]
    sh = gc.SHAPES[name]
    stride = inspect.signature(eh.monitor).parameters["null_stride"].default
    return {
        "name": name, "layers": sh["num_hidden_layers"], "b": b, "n": n, "d": sh["hidden_size"],
        "null_stride": stride if isinstance(stride, int) else None, "paths": _cuda_paths(),
        "plain": plain_cost(name).ops,
        "mon": {k: c.ops for k, c in monitor_cost(name).items()},
    }  # fmt: skip


def estimate(r: dict, floor: float, mm_eff: float, fused: bool = False) -> dict:
    """Seconds of the plain forward and of the monitor's kernels by kind, and the ratio."""
    out = {"plain": price(r["plain"], floor, mm_eff)}
    for k, ops in sorted(r["mon"].items()):
        out[k] = price(ops, floor)
    if fused:
        out["read"] = _fused_read(r, floor)
    out["monitor"] = sum(v for k, v in out.items() if k != "plain")
    out["ratio"] = 1 + out["monitor"] / out["plain"]
    return out


def _fused_read(r: dict, floor: float) -> float:
    """The hooks' reads as fused.fused_read makes them: per layer one pass over mid and one over
    post(t) = pre(t+1) (post(t-1) for the first), each writing its norms, projections and consensus
    partials; a gather-GEMM over the null rows of pre and mid; a sum of the partials per pass. The
    projections' FLOPs are the counted ones (the same [hi | lo] products), on tensor cores."""
    L, b, n, d = r["layers"], r["b"], r["n"], r["d"]
    X = b * n * d * 2  # one bfloat16 activation
    s = r["null_stride"] or 1
    N = b * -(-n // s)
    flops_layer = sum(o[1] for o in r["mon"].get("read", [])) / L
    out_layer = flops_layer / d  # float32 outputs: (2 d FLOPs per output, [hi | lo] halves summed in-kernel)
    per_layer = 2 * max(X / H200["bw"], floor) + 2 * floor  # two passes, two partial sums
    per_layer += 2 * max((N * d * 2 + out_layer / 2) / H200["bw"], flops_layer / 2 / H200["bf16"], floor)
    return L * per_layer + max(X / H200["bw"], floor)  # the last post's pass


def kernels(r: dict) -> dict:
    return {"plain": len(r["plain"]), **{k: len(ops) for k, ops in r["mon"].items()}}


def fit_mm_eff(r1b: dict, floor: float) -> float:
    """The matmul efficiency at which the plain 1B forward takes the measured time."""
    lo, hi = 0.05, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if price(r1b["plain"], floor, mid) * 1e3 > PLAIN_1B_MS:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_floor(old: dict[str, dict], mm_eff: float) -> tuple[float, dict]:
    """The floor (s) at which the old code's estimated ratios come closest to the measured ones
    (least squares in log ratio over the shapes), and those estimates."""
    import math

    best = None
    for us in [x / 10 for x in range(0, 401)]:
        est = {k: estimate(v, us * 1e-6, mm_eff)["ratio"] for k, v in old.items() if k in MEASURED_OLD}
        err = sum((math.log(est[k]) - math.log(MEASURED_OLD[k])) ** 2 for k in est)
        if best is None or err < best[0]:
            best = (err, us * 1e-6, est)
    return best[1], best[2]


def _raw_from(checkout: str, shapes: list[str]) -> dict[str, dict]:
    """raw() of another checkout of the package, in a subprocess with that checkout first on the path."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"roofline-{os.getpid()}.json"
    env = dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))
    cmd = [sys.executable, __file__, "--dump", str(out), "--shapes", *shapes]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(FWD), choices=list(FWD))
    p.add_argument("--floor-us", type=float, default=4.0, help="per-kernel floor when not calibrated (us)")
    p.add_argument("--calibrate", metavar="CHECKOUT", help="a checkout of the measured code (a514878)")
    p.add_argument("--top", type=int, default=0, help="list the monitor's N costliest kinds of kernel")
    p.add_argument("--dump", help=argparse.SUPPRESS)  # write raw() as JSON and stop (used by --calibrate)
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    shapes = sorted(set(a.shapes) | ({"llama-1b"} if a.calibrate else set()))
    if a.dump:
        Path(a.dump).write_text(json.dumps({s: raw(s) for s in shapes}))
        return 0
    import eigenhooks

    cur = {s: raw(s) for s in shapes}
    floor = a.floor_us * 1e-6
    mm_eff = fit_mm_eff(cur["llama-1b"], floor) if "llama-1b" in cur else 0.5
    print(f"H200 roofline: {H200['bw'] / 1e12:.1f} TB/s, {H200['bf16'] / 1e12:.0f} TFLOP/s bf16, "
          f"{H200['fp32'] / 1e12:.0f} TFLOP/s fp32; code: {Path(eigenhooks.__file__).parent}")  # fmt: skip
    print(f"  as CUDA runs it: {next(iter(cur.values()))['paths']}")
    if a.calibrate:
        old = _raw_from(a.calibrate, shapes)
        for _ in range(3):  # the floor and the plain forward's matmul efficiency, each fitted given the other
            floor, est_old = fit_floor(old, mm_eff)
            mm_eff = fit_mm_eff(cur["llama-1b"], floor)
        print(f"calibrated on {a.calibrate}: floor {floor * 1e6:.1f} us a kernel; the old code's estimates "
              + ", ".join(f"{k} {v:.3f} (measured {MEASURED_OLD[k]})" for k, v in est_old.items()))  # fmt: skip
        for k, r in old.items():
            _print(k, r, floor, mm_eff, "old code")
    print(
        f"matmul efficiency {mm_eff:.2f} (the plain 1B forward at the measured {PLAIN_1B_MS} ms), floor {floor * 1e6:.1f} us"
    )
    for k, r in cur.items():
        _print(k, r, floor, mm_eff, "current code")
        if a.top:
            _top(r, floor, a.top)
    return 0


def _top(r: dict, floor: float, n: int) -> None:
    """The monitor's kernels in the forward, grouped by kind and aten op, costliest first."""
    import collections

    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for kind, ops in r["mon"].items():
        for op in ops:
            a = agg[(kind, op[3])]
            a[0] += 1
            a[1] += op[0]
            a[2] += price([op], floor)
    print(f"  {r['name']}, the monitor's costliest kernels (kind, op: count, MB, estimated us):")
    for (kind, name), (c, b, t) in sorted(agg.items(), key=lambda kv: -kv[1][2])[:n]:
        print(f"    {kind:6s} {name:28s} {c:4d}  {b / 1e6:9.1f} MB  {t * 1e6:8.1f} us")


def _print(name: str, r: dict, floor: float, mm_eff: float, label: str) -> None:
    e, f, k = estimate(r, floor, mm_eff), estimate(r, floor, mm_eff, fused=True), kernels(r)
    b, n = FWD[name]
    kinds = [x for x in ("read", "hook", "reduce") if x in e]
    parts = ", ".join(f"{x} {e[x] * 1e3:.2f} ms / {k.get(x, 0)} kernels" for x in kinds)
    goal = GOALS[name]
    print(f"{name} forward {b}x{n}, {label}: plain {e['plain'] * 1e3:.1f} ms ({k['plain']} kernels); "
          f"monitor {e['monitor'] * 1e3:.2f} ms ({parts})")  # fmt: skip
    print(f"  estimated ratio {e['ratio']:.3f}  goal <= {goal}  {'met' if e['ratio'] <= goal else 'NOT met'}; "
          f"with the fused read {f['ratio']:.3f} (reads {f['read'] * 1e3:.2f} ms)  "
          f"{'met' if f['ratio'] <= goal else 'NOT met'}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

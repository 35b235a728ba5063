"""Monitored vs plain, interleaved, 2 threads: SmolLM2 4x128 forward, SmolLM2 generating 48
tokens, and a GPT-2-small-shaped model (random weights) 4x128 forward.

    python benchmarks/bench_monitor_real.py [--reps 7] [--knobs] [--fresh]

Also the forward with the monitor entered afresh for each one, its with-block timed with it (a
user who wraps one forward in its own ``with``); --fresh: that alone. Prints min-of-reps times and their ratios, the median and quartiles of paired ratios (each
monitored run over the plain runs around it), measured side by side in one run, the
monitor's own time inside the forward (its hooks and reduction, timed directly; with
--knobs for each cost knob too), and the monitor's state size after 1 and after 10
forwards (flat in tokens). Needs `eigenhooks fetch smollm2-135m`. Not a timed test: read
the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as T

import eigenhooks as eh

CONFIGS = {
    "default (K=128 Haar, 64 power-step, 16 eig; nulls on every 5th token)": {},
    "nulls on every token": {"null_stride": 1},
    "no nulls (K=1, 0, 0)": {"null_draws": 1, "fnull_draws": 0, "eig_top": 0},
    # the verdict's kept tokens (issue 56) cost their candidates' gather and the in-place merge a forward
    "no verdict sample (verdict_tokens=0)": {"verdict_tokens": 0},
}
# --knobs: what each of the monitor's cost knobs buys, against the default (docs/concepts.md, "What the monitor costs")
KNOBS = {
    "null_stride=7": {"null_stride": 7},
    "fnull_draws=32": {"fnull_draws": 32},
    "null_stride=7, fnull_draws=32": {"null_stride": 7, "fnull_draws": 32},
    "Haar null only (fnull_draws=0, eig_top=0)": {"fnull_draws": 0, "eig_top": 0},
}


def interleaved(fn, mons: dict, reps: int, fresh: bool = False) -> tuple[float, dict[str, float], dict[str, float]]:
    """fn plain and under each monitor, alternating so drift hits both.

    fresh: the monitor's with-block is timed with the forward (a user who wraps each forward in its
    own ``with``: the hooks go on and come off every time); else only the forward inside it.

    Returns the plain minimum, each monitor's minimum, and each monitor's paired ratios:
    every monitored run over the mean of the plain runs just before and after it, which
    cancels the slow drift of a shared machine better than a ratio of minima does.
    """
    for m in mons.values():
        m._prepare()  # spectra and null frames once, outside the timing
    fn()

    def plain_run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    plain, timed, pairs = [plain_run()], {name: [] for name in mons}, {name: [] for name in mons}
    for _ in range(reps):
        for name, m in mons.items():
            t_in = time.perf_counter()
            with m:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
            timed[name].append(time.perf_counter() - t_in if fresh else t1 - t0)
            plain.append(plain_run())
            pairs[name].append(timed[name][-1] / ((plain[-2] + plain[-1]) / 2))
    return min(plain), {k: min(v) for k, v in timed.items()}, pairs


def report(title: str, base: float, timed: dict[str, float], paired: dict[str, list[float]]) -> None:
    """The ratio of minima, and the median of the paired ratios with their quartiles (the spread
    a goal like <= 1.05 has to be read against on a shared machine)."""
    print(f"{title}, plain: {base:.3f} s")
    for name, t in timed.items():
        v = paired[name]
        q1, _, q3 = statistics.quantiles(v, n=4) if len(v) > 1 else (v[0], v[0], v[0])
        print(
            f"  monitored, {name}: {t:.3f} s  ratio of minima {t / base:.3f}, median paired ratio "
            f"{statistics.median(v):.3f} (quartiles {q1:.3f}-{q3:.3f} of {len(v)})"
        )


def own_time(fn, mons: dict, reps: int) -> tuple[dict[str, tuple[float, float]], float]:
    """Each monitor's own in-forward time (its hooks' work and the end-of-forward reduction): a
    direct figure, steadier than a ratio of two noisy wall times. Times the monitors' bound
    methods, so only their code is counted; the monitors take turns with the plain forward in
    every round, so a slow stretch of the machine hits them alike.

    Returns {name: (min, median)} of the own times, and the plain forward's minimum."""
    spent = [0.0]

    def timed(f):
        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        return g

    for mon in mons.values():  # the record's events: what the adapter's attachment tells of each forward
        mon._prepare()
        rec = mon._record
        for event in ("forward_start", "read", "read_once", "forward_end"):
            setattr(rec, event, timed(getattr(rec, event)))
        with mon:
            fn()
    own, plain = {name: [] for name in mons}, []
    for _ in range(reps):
        for name, mon in mons.items():
            t0 = time.perf_counter()
            fn()
            plain.append(time.perf_counter() - t0)
            spent[0] = 0.0
            with mon:
                fn()
            own[name].append(spent[0])
    return {k: (min(v), statistics.median(v)) for k, v in own.items()}, min(plain)


def print_own(mons: dict, fn, reps: int) -> None:
    own, base = own_time(fn, mons, reps)
    for name, (lo, med) in own.items():
        print(
            f"  own time in the forward, {name}: min {lo * 1e3:.1f} ms = {lo / base:.3f}, "
            f"median {med * 1e3:.1f} ms = {med / base:.3f} of the plain forward's min"
        )


def state_bytes(mon) -> int:
    mon._acc.flush()
    return sum(v.numel() * v.element_size() for st in mon._acc.state.values() for v in st.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--knobs", action="store_true", help="also the cost knobs (null_stride, fnull_draws, eig_top)")
    ap.add_argument("--fresh", action="store_true", help="only the forward with the monitor entered afresh each time")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = eh.zoo.load("smollm2-135m")
    ids = torch.randint(100, 20000, (4, 128), generator=torch.Generator().manual_seed(0))

    def fwd(m=model):
        with torch.no_grad():
            m(input_ids=ids)

    # a user who wraps each forward in its own with-block pays the hooks' going on and off too
    res = interleaved(fwd, {"default": eh.monitor(model)}, args.reps, fresh=True)
    report("SmolLM2 4x128 forward, the monitor entered afresh for each (its with-block timed)", *res)
    if args.fresh:
        return
    configs = {**CONFIGS, **(KNOBS if args.knobs else {})}
    res = interleaved(fwd, {n: eh.monitor(model, **kw) for n, kw in configs.items()}, args.reps)
    report("SmolLM2 4x128 forward", *res)
    owned = {n: kw for n, kw in configs.items() if args.knobs or not kw}  # the default alone, or every config
    print_own({n: eh.monitor(model, **kw) for n, kw in owned.items()}, fwd, args.reps)

    prompt = tok(["The capital of France is"], return_tensors="pt")

    def gen():
        with torch.no_grad():
            model.generate(**prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False)

    res = interleaved(gen, {"default": eh.monitor(model)}, max(3, args.reps // 2))
    report("SmolLM2 generate 48 tokens", *res)

    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_head=12, n_embd=768)).eval()  # GPT-2 small shape

    def fwd2():
        fwd(gpt2)

    res = interleaved(fwd2, {"default": eh.monitor(gpt2)}, args.reps)
    report("GPT-2-small shape (random weights) 4x128 forward", *res)
    print_own({"default": eh.monitor(gpt2)}, fwd2, args.reps)

    mon = eh.monitor(model)
    sizes = []
    with mon:
        for i in range(10):
            fwd()
            if i in (0, 9):
                sizes.append(state_bytes(mon))
    print(f"monitor state after 1 forward: {sizes[0]} bytes; after 10 (10x the tokens): {sizes[1]} bytes")


if __name__ == "__main__":
    main()

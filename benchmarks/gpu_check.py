"""The GPU check (issue 13, item 6): one short script to run when a CUDA device is lent.

Checks, each printed with its figures and a PASS / FAIL / SKIP line:

1. CUDA hooks on gpt2-tiny and SmolLM2-135M in float16 and bfloat16: the monitor's
   statistics (gamma_pre/mid/post, rho; n_tokens exactly) vs the same model in float32 on
   the CPU, on the same 4 x 128 tokens, within ``TOL`` (absolute; gamma and rho are in [0, 1]).
2. Spectra from GPU weights vs CPU weights (float32 both, ``cache=False``): |lambda_1|
   relative difference and the principal subspaces' distance ||(I - U U^T) W||_2 (the sine
   of their largest principal angle, U from the CPU, W from the GPU).
3. monitored / plain time on the GPU: SmolLM2 on 4 x 128 tokens, alternated, CUDA-synchronised.
4. With >= 2 GPUs: ``Monitor.all_reduce`` over NCCL in 2 spawned processes equals one
   process on the same batches; ``device_map`` across 2 GPUs equals the single-device
   monitor. With 1 GPU both say "skipped: 1 GPU".

5. ``--scale``: Llama-3.2-1B and Llama-3.1-8B shapes built from their configs with random
   weights on the GPU (bf16; no download). For each: ``eh.monitor`` entry time cold (empty disk
   cache, empty memo) and warm (disk cache); host syncs inside the monitor's hooks during a
   forward and a generation (every hook runs under ``torch.cuda.set_sync_debug_mode("warn")``,
   each warning counted; the whole forward's own syncs are counted apart, so the model's are not
   blamed on the monitor); the forward (1B: 8x1024, 8B: 4x2048) and ``generate`` (4x(128+64),
   4x(128+32)) ratios monitored / plain, alternated and synchronised (min over reps, and the
   median of paired ratios); extra peak memory; whether every statistic is finite; and, on the
   1B shape, the bf16 hi/lo projections against the float32 path on the same forward.

Everything is offline (zoo models; SmolLM2 must be fetched already, else its checks are
skipped and say so). Figures go to ``$OUT/gpu_check.json`` when OUT is set (rewritten after
every check, so a run cut short keeps what it measured). Exit 1 if any check fails; without
CUDA it prints "no CUDA device: nothing checked" and exits 0.

The functions take a ``device`` so that ``tests/benchmarks/test_gpu_check_on_cpu.py`` runs them on the CPU
(``--cpu``: tiny shapes stand in for the Llama ones).

Usage: python benchmarks/gpu_check.py [--reps 10] [--scale] [--cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

STAT_COLS = ("gamma_pre", "gamma_mid", "gamma_post", "rho")
# (gamma, rho) absolute tolerances vs float32 on the CPU (gamma and rho are in [0, 1]). Set
# from CPU runs of the same check in tests/benchmarks/test_gpu_check_on_cpu.py, with a margin of 2-10x:
#   gpt2-tiny 4x128  fp16: |d gamma| <= 5.7e-5, |d rho| 0.0020;  bf16: 1.4e-4, 0.0039
#   SmolLM2   2x64   fp16: |d gamma| <= 1.1e-4, |d rho| 0.0078;  bf16: 1.3e-3, 0.0234
#   SmolLM2   4x128  fp16: |d gamma| <= 1.1e-4, |d rho| 0.0039;  bf16: 1.3e-3, 0.0098
# gamma (a mean of alignments) moves by about the precision of the residuals; rho (the share
# of tokens with delta > 0) moves in steps of 1/n_tokens, by the tokens whose delta is that
# close to 0. float32 (device_map, the same kernels on another GPU) must agree to 1e-5.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 0.02), torch.bfloat16: (1e-2, 0.05)}
SPEC_TOL = 1e-6  # float64 spectra of the same float32 weights: only the eig routine differs
REDUCE_TOL = 1e-5  # the bound for sharded vs one process
SMOLLM = "smollm2-135m"


def check_line(name: str, ok: bool | None, figures: str) -> None:
    """One line per check: PASS / FAIL / SKIP, its name, its figures."""
    tag = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    print(f"{tag} {name}: {figures}", flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def fixed_ids(tok, batch: int = 4, seq: int = 128) -> torch.Tensor:
    """(batch, seq) real tokens from the bundled sample text (deterministic)."""
    from eigenhooks.run.texts import sample_text

    ids = tok(sample_text(), add_special_tokens=False)["input_ids"][: batch * seq]
    return torch.tensor(ids).view(batch, seq)


def load(name: str, device, dtype=None):
    """(model, tok) of a zoo model on ``device`` in ``dtype`` (None: as saved), eval mode."""
    import eigenhooks as eh

    model, tok = eh.zoo.load(name, dtype=dtype)
    return model.to(device).eval(), tok


def monitored_summary(model, ids: torch.Tensor):
    """The monitor's summary for one forward over ids (batch, seq), on the model's device."""
    import eigenhooks as eh

    dev = next(model.parameters()).device
    ids = ids.to(dev)
    with eh.monitor(model) as mon, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return mon.summary()


def compare_summaries(a, b, cols=STAT_COLS) -> dict:
    """Max |a - b| per column over (layer, target) rows, and whether n_tokens agree exactly."""
    keys = ["layer", "target"]
    a, b = a.sort_values(keys).reset_index(drop=True), b.sort_values(keys).reset_index(drop=True)
    if len(a) != len(b) or (a[keys].to_numpy() != b[keys].to_numpy()).any():
        raise ValueError(f"summaries have different rows: {len(a)} vs {len(b)}")
    diff = {c: float((a[c] - b[c]).abs().max()) for c in cols}
    diff["n_tokens_equal"] = bool((a["n_tokens"].to_numpy() == b["n_tokens"].to_numpy()).all())
    diff["finite"] = bool(all(b[c].notna().all() for c in cols))
    return diff


def judge(d: dict, tol: tuple[float, float]) -> dict:
    """Add worst_gamma, worst_rho, worst, the tolerance and ok (n_tokens exact, finite, within tol)."""
    g = max(d[c] for c in STAT_COLS if c.startswith("gamma"))
    d.update(worst_gamma=g, worst_rho=d["rho"], worst=max(g, d["rho"]), tol_gamma=tol[0], tol_rho=tol[1])
    d["ok"] = d["n_tokens_equal"] and d["finite"] and g <= tol[0] and d["rho"] <= tol[1]
    return d


def stats_check(name: str, device, dtype, ids: torch.Tensor, reference) -> dict:
    """Monitor statistics of ``name`` on device in dtype vs the float32 CPU reference summary."""
    model, _ = load(name, device, dtype)
    return judge(compare_summaries(reference, monitored_summary(model, ids)), TOL[dtype])


def spectra_check(model_ref, model_dev) -> dict:
    """eh.spectra (cache off) of the same weights on two devices: lambda_1 and subspace agreement."""
    import eigenhooks as eh

    ref = eh.spectra(model_ref, cache=False)
    dev = eh.spectra(model_dev, cache=False)
    rel, dist = 0.0, 0.0
    for r, g in zip(ref, dev, strict=True):
        rel = max(rel, abs(r.lambda_1 - g.lambda_1) / max(abs(r.lambda_1), 1e-30))
        U, W = torch.as_tensor(r.basis).cpu(), torch.as_tensor(g.basis).cpu()  # (d, k) orthonormal
        if U.shape != W.shape:
            return {"layers": len(ref), "lambda1_rel": rel, "subspace_dist": 1.0, "ok": False, "why": "k differs"}
        dist = max(dist, float(torch.linalg.matrix_norm(W - U @ (U.T @ W), ord=2)))  # sin of the largest angle
    return {"layers": len(ref), "lambda1_rel": rel, "subspace_dist": dist, "ok": rel <= SPEC_TOL and dist <= SPEC_TOL}


def overhead_check(model, ids: torch.Tensor, reps: int = 10) -> dict:
    """Best-of-reps time of a plain and a monitored forward, alternated, synchronised on the device.

    The plain side is a deep copy of the model (same weights, no hooks); the monitored side
    keeps one monitor attached throughout, warmed up, so its one-off preparation is not timed.
    """
    import copy

    import eigenhooks as eh

    dev = next(model.parameters()).device
    ids = ids.to(dev)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain_model = copy.deepcopy(model)

    def timed(m) -> float:
        sync(dev)
        t = time.perf_counter()
        with torch.no_grad():
            m(**batch)
        sync(dev)
        return time.perf_counter() - t

    plain, mon = [], []
    with eh.monitor(model):
        timed(model), timed(plain_model)  # warm-up: bases, null draws, kernels
        for _ in range(reps):
            plain.append(timed(plain_model))
            mon.append(timed(model))
    p, m = min(plain), min(mon)
    return {"plain_s": p, "monitored_s": m, "ratio": m / p, "reps": reps}


def _batches(tok, n: int = 6) -> list[torch.Tensor]:
    ids = fixed_ids(tok, batch=2 * n, seq=64)  # (2n, 64)
    return list(ids.split(2))  # n batches of (2, 64)


def _reduce_worker(rank: int, world: int, backend: str, rendezvous: str, out: str) -> None:
    """One rank: monitor its batches (i % world == rank), all_reduce, rank 0 saves the summary."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        import eigenhooks as eh

        model, tok = load("gpt2-tiny", device)
        with eh.monitor(model) as mon, torch.no_grad():
            for i, ids in enumerate(_batches(tok)):
                if i % world == rank:
                    ids = ids.to(device)
                    model(input_ids=ids, attention_mask=torch.ones_like(ids))
        mon.all_reduce()
        if rank == 0:
            mon.summary().to_json(out, orient="records")
        dist.barrier()  # both ranks done before either tears gloo down (a rank once aborted in CI at exit)
    finally:
        dist.destroy_process_group()


def reduce_check(backend: str = "nccl", world: int = 2, device="cuda:0") -> dict:
    """all_reduce over ``world`` spawned ranks vs one process on the same batches (on ``device``)."""
    import pandas as pd
    import torch.multiprocessing as mp

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # spawned ranks unpickle _reduce_worker by module name
        sys.path.insert(0, here)
    with tempfile.TemporaryDirectory(prefix="eh-gpu-check-") as work:
        out = os.path.join(work, "summary.json")
        # The ranks meet through a file in this fresh folder, not a TCP port: a port picked free
        # and released before the ranks bind it can be taken in between by another process.
        rendezvous = os.path.join(work, "rendezvous")
        mp.spawn(_reduce_worker, args=(world, backend, rendezvous, out), nprocs=world, join=True)
        sharded = pd.read_json(out, orient="records")
    import eigenhooks as eh

    model, tok = load("gpt2-tiny", device)
    with eh.monitor(model) as mon, torch.no_grad():
        for ids in _batches(tok):
            ids = ids.to(device)
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    d = judge(compare_summaries(mon.summary(), sharded), (REDUCE_TOL, REDUCE_TOL))
    d.update(world=world, backend=backend)
    return d


def split_device_map(model, devices: list) -> dict:
    """A device_map putting the first half of the decoder blocks on devices[0], the rest on devices[1].

    The blocks are the model's largest ModuleList; every module outside it holding parameters
    or buffers (embeddings, rotary tables, final norm, a tied head) stays on devices[0], so
    activations cross devices twice per forward.
    """
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to split")
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    half = len(blocks) // 2
    dmap = {f"{name}.{i}": devices[0] if i < half else devices[1] for i in range(len(blocks))}
    held = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers()]
    for pname in held:  # buffers too: a rotary table left on the CPU would meet CUDA activations
        if not pname.startswith(name + "."):
            dmap[pname.rsplit(".", 1)[0] if "." in pname else ""] = devices[0]
    return dmap


def device_map_check(name: str, devices: list, ids: torch.Tensor) -> dict:
    """The monitor on a model split across devices (accelerate dispatch_model) vs on devices[0] alone."""
    from accelerate import dispatch_model

    single, _ = load(name, devices[0])
    ref = monitored_summary(single, ids)
    del single
    model, _ = load(name, "cpu")
    dmap = split_device_map(model, devices)
    model = dispatch_model(model, device_map=dmap)
    placed = sorted({str(p.device) for p in model.parameters()})
    d = judge(compare_summaries(ref, monitored_summary(model, ids)), TOL[torch.float32])
    d["devices"] = placed
    return d


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items() if k != "ok")


def _stats_checks(names: list[str], device, figures: dict) -> None:
    for name in names:
        ref_model, tok = load(name, "cpu", torch.float32)
        ids = fixed_ids(tok)
        ref = monitored_summary(ref_model, ids)
        for dtype in (torch.float16, torch.bfloat16):
            d = stats_check(name, device, dtype, ids, ref)
            figures[f"stats/{name}/{str(dtype)[6:]}"] = d
            check_line(f"hooks {name} {str(dtype)[6:]} on {device} vs float32 CPU", d["ok"], _fmt(d))
        for dtype in (torch.float32, torch.float16):  # the same weights' values on both devices
            d = spectra_check(load(name, "cpu", dtype)[0], load(name, device, dtype)[0])
            figures[f"spectra/{name}/{str(dtype)[6:]}"] = d
            check_line(f"spectra {name} from {device} {str(dtype)[6:]} weights vs CPU", d["ok"], _fmt(d))


def default_models() -> list[str]:
    """gpt2-tiny, and SmolLM2 if it is fetched on this machine."""
    import eigenhooks as eh

    return ["gpt2-tiny"] + ([SMOLLM] if eh.zoo.is_fetched(SMOLLM) else [])


def run_checks(device="cuda:0", reps: int = 10, models: list[str] | None = None) -> dict:
    """Every check on ``device`` for ``models`` (default: ``default_models()``); returns {check: figures}."""
    cuda = torch.device(device).type == "cuda"
    figures: dict = {"device": torch.cuda.get_device_name(device) if cuda else str(device)}
    names = default_models() if models is None else list(models)
    if SMOLLM not in names:
        check_line(f"hooks/spectra/overhead {SMOLLM}", None, f"skipped: {SMOLLM} not fetched or not asked for")
        figures[SMOLLM] = "skipped: not fetched or not asked for"
    _stats_checks(names, device, figures)
    model, tok = load(names[-1], device)
    d = overhead_check(model, fixed_ids(tok), reps)
    figures[f"overhead/{names[-1]}"] = d
    check_line(f"monitored/plain {names[-1]} 4x128 on {device}", True, _fmt(d))
    n_gpu = torch.cuda.device_count() if cuda else 0
    if n_gpu < 2:
        for what in ("NCCL all_reduce", "device_map across 2 GPUs"):
            check_line(what, None, f"skipped: {n_gpu} GPU")
            figures[what] = f"skipped: {n_gpu} GPU"
        return figures
    d = reduce_check("nccl", 2, "cuda:0")
    figures["nccl_all_reduce"] = d
    check_line("NCCL all_reduce, 2 processes vs 1", d["ok"], _fmt(d))
    d = device_map_check(names[-1], ["cuda:0", "cuda:1"], fixed_ids(tok))
    figures["device_map"] = d
    check_line(f"device_map {names[-1]} across cuda:0, cuda:1 vs cuda:0", d["ok"], _fmt(d))
    return figures


# ---- 5. at scale: Llama-1B / Llama-8B shapes with random weights ----

SHAPES = {
    # Llama-3.2-1B and Llama-3.1-8B (their configs' attention and MLP shapes)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, head_dim=64),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, head_dim=128),
}  # fmt: skip
# What each shape runs: forward batch x seq, generate batch x (prompt + new), reps, and its goals.
PLAN = {
    "llama-1b": dict(fwd=(8, 1024), gen=(4, 128, 64), reps=10, goal_fwd=1.05, goal_gen=1.05, goal_cold=10.0),
    "llama-8b": dict(fwd=(4, 2048), gen=(4, 128, 32), reps=6, goal_fwd=1.03, goal_gen=1.05, goal_cold=30.0),
}
GOAL_WARM = 3.0
# Stand-ins for a dry run on the CPU: the same code paths, tiny shapes.
CPU_SHAPES = {
    "llama-1b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=512, head_dim=16),
    "llama-8b": dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=2, vocab_size=512, head_dim=32),
}  # fmt: skip
CPU_PLAN = {k: dict(v, fwd=(2, 64), gen=(2, 16, 6), reps=2) for k, v in PLAN.items()}


def build_shape(shape: dict, device, dtype):
    """A LlamaForCausalLM of this shape with random weights, on device, eval mode (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def _timed(fn, dev) -> float:
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


def paired(plain_fn, mon_fn, reps: int, dev) -> dict:
    """Alternated, synchronised timings: min over reps of each, and the median of paired ratios."""
    import statistics

    p, m = [], []
    for _ in range(reps):
        p.append(_timed(plain_fn, dev))
        m.append(_timed(mon_fn, dev))
    ratios = [b / a for a, b in zip(p, m)]
    return {
        "plain_min_ms": 1e3 * min(p),
        "monitored_min_ms": 1e3 * min(m),
        "ratio_min": min(m) / min(p),
        "ratio_median": statistics.median(ratios),
        "reps": reps,
    }


@contextlib.contextmanager
def count_syncs(dev):
    """Count the host syncs torch's sync debug mode reports (CUDA only) inside the block: {'n': ...}."""
    import warnings

    box = {"n": 0, "where": []}
    if torch.device(dev).type != "cuda":
        yield box
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode(before)
    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
    box["n"] = len(hits)
    box["where"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in hits})[:8]


def guard_hooks(mon, box: dict, dev) -> None:
    """Run each of the monitor's hook entry points under the sync debug mode, counting into box.

    The hooks look these methods up on the instance at call time, so wrapping them there (before
    ``__enter__`` registers the model-level ones) covers every hook and nothing of the model's own."""
    import functools
    import warnings

    if torch.device(dev).type != "cuda":
        return
    for name in ("_on_model_start", "_on_model_end", "_on_tap"):
        fn = getattr(mon, name)

        @functools.wraps(fn)
        def wrapped(*a, _fn=fn, **k):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return _fn(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode(before)
                    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
                    box["n"] += len(hits)
                    box["where"].extend(f"{Path(w.filename).name}:{w.lineno}" for w in hits[:2])

        setattr(mon, name, wrapped)


def _entry(model, dev) -> tuple[float, float]:
    """eh.monitor entry: cold (fresh disk cache, empty memo) and warm (disk cache, empty memo), seconds."""
    import warnings

    import eigenhooks as eh
    from eigenhooks.spectra import clear_memo

    os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-scale-cache-")
    times = []
    for _ in range(2):
        clear_memo()
        mon = eh.monitor(model)
        times.append(_timed(mon.__enter__, dev))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", eh.MeasurementWarning)  # entered to be timed, not to measure
            mon.__exit__(None, None, None)
    return times[0], times[1]


def _split_vs_float32(model, batch: dict) -> dict:
    """The bf16 hi/lo projections against the float32 path, on the same forward: max |diff| per column."""
    import eigenhooks as eh
    from eigenhooks.monitor import reduce

    out = {}
    for mode in ("split", "float32"):
        saved = dict(reduce._OUT_DTYPE)
        if mode == "float32":
            for k in list(reduce._OUT_DTYPE):
                reduce._OUT_DTYPE[k] = False
            reduce._OUT_DTYPE.setdefault((next(model.parameters()).device.type, torch.bfloat16), False)
        try:
            with eh.monitor(model) as mon, torch.no_grad():
                model(**batch)
            out[mode] = mon.summary()
        finally:
            reduce._OUT_DTYPE.clear()
            reduce._OUT_DTYPE.update(saved)
    cols = ["gamma_pre", "gamma_mid", "rho", "null_rho_lo", "null_rho_hi", "rho_percentile", "p_null", "lift"]
    d = {c: float((out["split"][c] - out["float32"][c]).abs().max()) for c in cols}
    d["n_tokens_equal"] = bool((out["split"]["n_tokens"] == out["float32"]["n_tokens"]).all())
    d["ok"] = d["n_tokens_equal"] and d["gamma_pre"] <= 1e-4 and d["rho"] <= 0.01
    return d


def scale_check(name: str, device, shape: dict, plan: dict, figures: dict, out: str | None) -> None:
    """One shape: entry, syncs, forward and generate ratios, memory, finiteness. Figures into figures[name]."""
    import copy

    import eigenhooks as eh

    dev = torch.device(device)
    dtype = torch.bfloat16
    f = figures.setdefault(name, {})
    t = time.perf_counter()
    model = build_shape(shape, dev, dtype)
    plain = copy.deepcopy(model)
    sync(dev)
    f["build_s"] = time.perf_counter() - t
    cold, warm = _entry(model, dev)
    f.update(entry_cold_s=cold, entry_warm_s=warm)
    ok_entry = dev.type != "cuda" or (cold <= plan["goal_cold"] and warm <= GOAL_WARM)
    check_line(
        f"{name} monitor entry",
        ok_entry,
        f"cold {cold:.2f} s (goal <= {plan['goal_cold']:.0f}), warm {warm:.2f} s (goal <= {GOAL_WARM:.0f})",
    )
    _save(figures, out)

    b, n = plan["fwd"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (b, n), generator=g).to(dev)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gb, gp, gn = plan["gen"]
    gbatch = {"input_ids": ids[:gb, :gp], "attention_mask": torch.ones_like(ids[:gb, :gp])}

    def fwd(m):
        def f_():
            with torch.no_grad():
                m(**batch)

        return f_

    def gen(m):
        def f_():
            with torch.no_grad():
                m.generate(**gbatch, max_new_tokens=gn, min_new_tokens=gn, do_sample=False, pad_token_id=0)

        return f_

    fwd(plain)(), fwd(plain)()
    with count_syncs(dev) as plain_syncs:
        fwd(plain)()
    f["plain_forward_syncs"] = plain_syncs["n"]
    base_peak = peak = 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        fwd(plain)()
        base_peak = torch.cuda.max_memory_allocated(dev)
    hook_syncs = {"n": 0, "where": []}
    guarded = eh.monitor(model)
    guard_hooks(guarded, hook_syncs, dev)
    with guarded:
        fwd(model)()  # the first forward too: constants are made at entry
        gen(model)()
    f["hook_syncs"] = hook_syncs["n"]
    f["hook_sync_sites"] = sorted(set(hook_syncs["where"]))[:8]
    check_line(
        f"{name} host syncs inside the monitor's hooks (1 forward + 1 generate)",
        hook_syncs["n"] == 0,
        f"{hook_syncs['n']} {f['hook_sync_sites']} (the plain forward itself: {plain_syncs['n']})",
    )
    from eigenhooks.monitor import reduce

    f["split_projections"] = {f"{k[0]}/{str(k[1])[6:]}": v for k, v in reduce._OUT_DTYPE.items()}
    with eh.monitor(model) as mon:  # a monitor without the guard, for the timings (entry: the memo)
        fwd(model)()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            fwd(model)()
            peak = torch.cuda.max_memory_allocated(dev)
        f["extra_peak_GiB"] = (peak - base_peak) / 2**30
        f["forward"] = r = paired(fwd(plain), fwd(model), plan["reps"], dev)
        check_line(
            f"{name} forward {b}x{n} bf16 monitored/plain",
            dev.type != "cuda" or r["ratio_min"] <= plan["goal_fwd"],
            f"plain {r['plain_min_ms']:.1f} ms, monitored {r['monitored_min_ms']:.1f} ms, ratio(min) {r['ratio_min']:.3f}, "
            f"ratio(median pair) {r['ratio_median']:.3f} (goal <= {plan['goal_fwd']}); extra peak {f['extra_peak_GiB']:.2f} GiB",
        )
        _save(figures, out)
        gen(model)(), gen(plain)()
        f["generate"] = r = paired(gen(plain), gen(model), max(3, plan["reps"] // 2), dev)
        check_line(
            f"{name} generate {gb}x({gp}+{gn}) monitored/plain",
            dev.type != "cuda" or r["ratio_min"] <= plan["goal_gen"],
            f"plain {r['plain_min_ms']:.0f} ms, monitored {r['monitored_min_ms']:.0f} ms, ratio(min) {r['ratio_min']:.3f}, "
            f"ratio(median pair) {r['ratio_median']:.3f} (goal <= {plan['goal_gen']})",
        )
    s = mon.summary()
    cols = [
        c
        for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho", "null_rho_lo", "null_rho_hi", "p_null")
        if c in s.columns
    ]
    f["rows"], f["all_finite"] = len(s), bool(s[cols].notna().all().all())
    f["n_tokens"] = int(s["n_tokens"].max())
    check_line(f"{name} statistics finite", f["all_finite"], f"{len(s)} rows, n_tokens {f['n_tokens']}")
    f["ok"] = bool(ok_entry and f["all_finite"] and f["hook_syncs"] == 0)
    _save(figures, out)
    if name == "llama-1b" and dev.type == "cuda":
        d = _split_vs_float32(model, batch)
        figures["bf16_split_vs_float32"] = d
        check_line("bf16 hi/lo projections vs float32 path (llama-1b, one forward)", d["ok"], _fmt(d))
    del model, plain
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    _save(figures, out)


def _save(figures: dict, out: str | None) -> None:
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(figures, indent=1, default=str))


def run_scale(device, figures: dict, out: str | None, shapes: list[str] | None = None) -> None:
    cpu = torch.device(device).type != "cuda"
    for name in shapes or list(SHAPES):
        t = time.perf_counter()
        try:
            scale_check(
                name, device, (CPU_SHAPES if cpu else SHAPES)[name], (CPU_PLAN if cpu else PLAN)[name], figures, out
            )
        except Exception as e:  # one shape's failure is reported, the next still runs
            figures.setdefault(name, {}).update(ok=False, error=f"{type(e).__name__}: {e}")
            check_line(f"{name} at scale", False, f"{type(e).__name__}: {e}")
        figures[name]["seconds"] = time.perf_counter() - t
        _save(figures, out)


def _failed(figures: dict) -> list[str]:
    return [k for k, v in figures.items() if isinstance(v, dict) and v.get("ok") is False]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--models", nargs="+", help="zoo models to check (default: gpt2-tiny, and SmolLM2 if fetched)")
    p.add_argument("--cpu", action="store_true", help="dry run of the script's flow on the CPU (checks no GPU)")
    p.add_argument(
        "--scale", action="store_true", help="also the Llama-1B / Llama-8B shapes (tiny stand-ins with --cpu)"
    )
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="with --scale: which shapes (default: all)")
    p.add_argument("--only-scale", action="store_true", help="with --scale: skip the zoo-model checks")
    a = p.parse_args(argv)
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    from eigenhooks.zoo import real

    os.environ.setdefault("EIGENHOOKS_MODELS", str(real.models_dir()))  # fetched models stay found
    os.environ.setdefault("EIGENHOOKS_CACHE", tempfile.mkdtemp(prefix="eh-gpu-check-cache-"))
    out = os.environ.get("OUT")
    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        if out:
            Path(out, "gpu_check.json").write_text(json.dumps({"status": "no CUDA device: nothing checked"}))
        return 0
    t0 = time.perf_counter()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n_gpu} GPU(s)", flush=True)
    device = "cpu" if a.cpu else "cuda:0"
    figures = {} if a.only_scale else run_checks(device, a.reps, a.models)
    _save(figures, out)
    if a.scale:
        import transformers

        figures.update(torch=torch.__version__, transformers=transformers.__version__, cores=os.cpu_count())
        run_scale(device, figures, out, a.shapes)
    figures["seconds"] = time.perf_counter() - t0
    failed = _failed(figures)
    print(f"{'FAIL' if failed else 'PASS'} gpu_check: {len(failed)} failed {failed} in {figures['seconds']:.0f} s")
    _save(figures, out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

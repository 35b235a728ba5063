"""Data scale: monitored vs plain over many tokens, and ``eigenhooks run --dataset``, with memory.

Two modes (issue 13, item 4), both on the zoo model gpt2-tiny:

1. default: monitored vs plain forwards over ``--tokens`` tokens (default 1M), interleaved
   in chunks (``--chunk`` batches plain, the same batches monitored, and again), so that
   drift in the machine's load hits both sides. The plain side is a deep copy of the model
   without hooks; the monitored side keeps ONE monitor attached for the whole run, so its
   state holds every token. Prints the monitored/plain time ratio, tokens/s of each, and
   the process RSS at 10%, 50% and 100% of the tokens (memory must be flat).
2. ``--dataset PATH``: ``eigenhooks run gpt2-tiny --dataset PATH`` through ``eh.run.run``
   (what the CLI calls), on a local .txt or .jsonl generated at PATH if it does not exist.
   Prints the run's own throughput (meta.json's tokens/s) and the RSS at 10/50/100% of
   the tokens, sampled by a thread that reads the run's stats.jsonl as it is appended.

Usage:
    flock /tmp/eh/bench.lock nice python benchmarks/bench_data.py [--tokens 1000000] [--chunk 16]
    flock /tmp/eh/bench.lock nice python benchmarks/bench_data.py --dataset /tmp/corpus.jsonl [--tokens 10000000]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

import torch

MARKS = (0.1, 0.5, 1.0)
SEQ, BATCH = 128, 8


def rss_mib() -> float:
    """Resident set size of this process now, in MiB (Linux /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def token_blocks(tok, n_tokens: int):
    """(BATCH, SEQ) blocks of real tokens cycling over the bundled sample text; n_tokens rounded up to whole rows."""
    from eigenhooks.run.texts import sample_text

    ids = torch.tensor(tok(sample_text(), add_special_tokens=False)["input_ids"])  # (n_sample,)
    n_rows = -(-n_tokens // SEQ)
    for r0 in range(0, n_rows, BATCH):
        rows = min(BATCH, n_rows - r0)
        yield ids[(torch.arange(rows * SEQ) + r0 * SEQ) % len(ids)].view(rows, SEQ)  # (rows, SEQ)


def interleaved(n_tokens: int, chunk: int) -> dict:
    """Monitored vs plain, chunk by chunk; RSS at the marks of the monitored tokens."""
    import eigenhooks as eh

    model, tok = eh.zoo.load("gpt2-tiny")
    model.eval()
    plain = copy.deepcopy(model)  # same weights, no hooks
    for rank in ("modulus", "residual"):
        eh.spectra(model, rank=rank)  # measure hooks, not eig
    t_plain = t_mon = 0.0
    done, marks, rss = 0, list(MARKS), {}
    rss0 = rss_mib()
    blocks = token_blocks(tok, n_tokens)
    with eh.monitor(model) as mon, torch.no_grad():
        while True:
            batch = [b for _, b in zip(range(chunk), blocks, strict=False)]
            if not batch:
                break
            t = time.perf_counter()
            for ids in batch:
                plain(input_ids=ids, attention_mask=torch.ones_like(ids))
            t_plain += time.perf_counter() - t
            t = time.perf_counter()
            for ids in batch:
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
            t_mon += time.perf_counter() - t
            done += sum(b.numel() for b in batch)
            while marks and done >= marks[0] * n_tokens:
                rss[marks.pop(0)] = (done, rss_mib())
    t = time.perf_counter()
    summary = mon.summary()
    t_summary = time.perf_counter() - t
    return {
        "tokens": done,
        "n_tokens_monitored": int(summary["n_tokens"].max()),
        "plain_s": t_plain,
        "monitored_s": t_mon,
        "summary_s": t_summary,
        "ratio": t_mon / t_plain,
        "plain_tok_s": done / t_plain,
        "monitored_tok_s": done / t_mon,
        "rss_start_mib": rss0,
        "rss": rss,
        "peak_rss_mib": peak_rss_mib(),
    }


def make_corpus(path: Path, n_tokens: int, tok) -> None:
    """A local .txt (one sample paragraph per line) or .jsonl ({"text": ...} per line) of >= n_tokens."""
    from eigenhooks.run.texts import _paragraphs, sample_text

    paras = [p.replace("\n", " ").strip() for p in _paragraphs(sample_text().splitlines(keepends=True))]
    end = "" if path.suffix == ".jsonl" else "\n"  # a text row keeps its line break
    per_pass = sum(len(tok(p + end, add_special_tokens=False)["input_ids"]) for p in paras)
    passes = int(n_tokens * 1.02) // per_pass + 2
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(passes):
            for p in paras:
                f.write(json.dumps({"text": p}) + "\n" if path.suffix == ".jsonl" else p + "\n")


class StatsWatcher(threading.Thread):
    """Samples (tokens measured, RSS) while a run appends stats.jsonl in its hidden folder."""

    def __init__(self, out: Path, marks: list[float], n_tokens: int):
        super().__init__(daemon=True)
        self.out, self.marks, self.n_tokens = out, list(marks), n_tokens
        self.rss: dict[float, tuple[int, float]] = {}
        self.stop = threading.Event()
        self.tokens = 0
        self.last: tuple[int, float] | None = None  # at the last forward seen

    def _stats_file(self) -> Path | None:
        found = list(self.out.parent.glob(f".{self.out.name}.tmp-*/stats.jsonl"))
        return found[0] if found else None

    def run(self) -> None:
        path, fh, buf = None, None, ""
        while not self.stop.is_set() and self.marks:
            if fh is None:
                path = self._stats_file()
                fh = open(path, encoding="utf-8") if path else None  # noqa: SIM115 (closed below)
            if fh is not None:
                buf += fh.read()
                *lines, buf = buf.split("\n")
                for line in lines:
                    rec = json.loads(line)
                    self.tokens += int(
                        next(s["n"] for s in rec["stats"] if s["layer"] == 0 and s["target"] == "ov/modulus")
                    )
                while self.marks and self.tokens >= self.marks[0] * self.n_tokens:
                    self.rss[self.marks.pop(0)] = (self.tokens, rss_mib())
                if lines:
                    self.last = (self.tokens, rss_mib())
            time.sleep(0.05)
        if fh is not None:
            fh.close()


def dataset_run(path: Path, n_tokens: int) -> dict:
    import eigenhooks as eh
    from eigenhooks.run import run

    if not path.exists():
        t = time.perf_counter()
        make_corpus(path, n_tokens, eh.zoo.load("gpt2-tiny")[1])
        print(f"generated {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t:.1f} s")
    out = Path(tempfile.mkdtemp(prefix="eh-bench-data-")) / "run"
    rss0 = rss_mib()
    watch = StatsWatcher(out, list(MARKS), n_tokens)
    watch.start()
    t = time.perf_counter()
    res = run("gpt2-tiny", dataset=str(path), max_tokens=n_tokens, out=out, progress=False)
    wall = time.perf_counter() - t
    watch.stop.set()
    watch.join()
    meta = json.loads((res.out / "meta.json").read_text())
    rss = dict(watch.rss)
    if 1.0 not in rss and watch.last is not None:  # the file ran out before max_tokens
        rss[watch.last[0] / n_tokens] = watch.last
    return {
        "file": str(path),
        "file_mib": path.stat().st_size / 2**20,
        "n_tokens": meta["n_tokens"],
        "forwards": meta["forwards"],
        "run_tokens_per_s": meta["tokens_per_s"],
        "forward_seconds": meta["seconds"],
        "wall_s": wall,
        "rss_start_mib": rss0,
        "rss": rss,
        "rss_after_mib": rss_mib(),  # summary, plots and report included
        "peak_rss_mib": peak_rss_mib(),
        "out": str(res.out),
    }


def print_rss(r: dict) -> None:
    for m, (tok, mib) in sorted(r["rss"].items()):
        print(f"    RSS at {m:>4.0%} ({tok:>10,} tokens): {mib:8.1f} MiB")
    vals = [mib for _, mib in sorted(r["rss"].values())]
    after = f"; after the run (summary, plots, report) {r['rss_after_mib']:.1f} MiB" if "rss_after_mib" in r else ""
    print(
        f"    RSS start {r['rss_start_mib']:.1f} MiB; 10% -> 100%: {vals[-1] - vals[0]:+.1f} MiB; "
        f"peak {r['peak_rss_mib']:.1f} MiB{after}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--chunk", type=int, default=16, help="batches of 8 x 128 per side before switching")
    p.add_argument("--dataset", type=Path, help="run `eigenhooks run --dataset` on this .txt/.jsonl (made if absent)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    os.environ.setdefault("EIGENHOOKS_CACHE", tempfile.mkdtemp(prefix="eh-bench-"))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    if a.dataset is None:
        r = interleaved(a.tokens, a.chunk)
        print(f"[1] gpt2-tiny, {r['tokens']:,} tokens in batches of {BATCH}x{SEQ}, interleaved every {a.chunk} batches")
        print(f"    plain     {r['plain_s']:8.1f} s  {r['plain_tok_s']:>10,.0f} tokens/s")
        print(f"    monitored {r['monitored_s']:8.1f} s  {r['monitored_tok_s']:>10,.0f} tokens/s")
        print(f"    ratio monitored / plain = {r['ratio']:.2f}x; summary() over all tokens {r['summary_s']:.2f} s")
        print(f"    tokens in the monitor's summary: {r['n_tokens_monitored']:,}")
    else:
        r = dataset_run(a.dataset, a.tokens)
        print(
            f"[2] eigenhooks run gpt2-tiny --dataset {r['file']} ({r['file_mib']:.1f} MiB), --max-tokens {a.tokens:,}"
        )
        print(
            f"    n_tokens {r['n_tokens']:,} in {r['forwards']} forwards; run throughput "
            f"{r['run_tokens_per_s']:,.0f} tokens/s (forwards {r['forward_seconds']:.1f} s, wall {r['wall_s']:.1f} s)"
        )
        if r["n_tokens"] < a.tokens:
            print(f"    the file ran out: {r['n_tokens']:,} of {a.tokens:,} tokens")
    print_rss(r)
    print(f"load {os.getloadavg()[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, default=str))


if __name__ == "__main__":
    main()

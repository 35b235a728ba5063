"""What a sink adds to a monitored forward, side by side with no sink (not a timed test).

On a GPT-2-small-shaped model (12 x 768, random weights, CPU) with ``log_every=10``, each round
times, in an order that rotates from round to round, ``--forwards`` forwards of 1 x ``--tokens``
tokens: plain (no monitor), monitored with no sink, and monitored with each sink (a callable,
a .jsonl file, TensorBoard, wandb offline, MLflow on a file store). Each monitor is made and
prepared once, before the rounds. Timed: the forwards, and the write of the block's last log
point (in a long run it comes at the next log point; here that is the exit). The rest of leaving
the block (the summary table, flushing) is timed apart. On the CPU the clock is this process's
CPU time (``time.process_time``), with one torch thread by default: on a shared machine, wall time
and two threads' barriers make a forward's time swing tenfold. Work a library does in a process
of its own (wandb's service) is not counted: it is not in the forward either. A small forward (1 x 32) is
the hard case: a log point costs the same whatever the forward. Printed per sink:

- rise: the median over rounds of (t_sink - t_none) / t_plain, how much monitored/plain rises
  over no sink (goal <= 0.01);
- ratio: the median of the paired ratios t_sink / t_none;
- log point: the time one log point takes with that sink (a whole ``mon.log()``: the copy of the
  sums, the 120 values, the write; median of 20), and what it comes to per forward at
  log_every=10 as a share of a plain forward: the figure "rise" estimates, without the noise of
  whole forwards (the .jsonl file writes one line every forward instead).

A sink whose library is missing is skipped, with a line saying so.

Usage: python benchmarks/bench_sinks.py [--rounds 3] [--forwards 10] [--tokens 32] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

LOG_EVERY = 10


def make_sinks(tmp: Path) -> dict:
    """name -> the sink spec (libraries that are missing are left out, and said so)."""
    sinks = {"callable": lambda step, values: None, "jsonl": tmp / "stats.jsonl"}
    try:
        from torch.utils.tensorboard import SummaryWriter

        sinks["tensorboard"] = SummaryWriter(log_dir=str(tmp / "tb"))
    except ImportError as e:
        print(f"tensorboard: skipped ({e})")
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        sinks["wandb"] = wandb.init(project="eigenhooks-bench", mode="offline", dir=str(tmp))
    except ImportError as e:
        print(f"wandb: skipped ({e})")
    try:
        import mlflow

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        mlflow.set_tracking_uri("file:" + str(tmp / "mlruns"))
        mlflow.start_run()
        sinks["mlflow"] = "mlflow"
    except ImportError as e:
        print(f"mlflow: skipped ({e})")
    return sinks


CLOCK = time.process_time  # CPU: this process's CPU time, which other processes' load leaves alone


def timed(fn) -> float:
    t = CLOCK()
    fn()
    return CLOCK() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forwards", type=int, default=10)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda to see the same figures on a GPU")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device != "cpu":
        global CLOCK
        CLOCK = time.perf_counter  # the GPU's time is not this process's CPU time
    os.environ.setdefault("EIGENHOOKS_CACHE", str(Path(tempfile.gettempdir()) / "eigenhooks-bench-cache"))
    import transformers as T

    import eigenhooks as eh

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval().to(a.device)
    ids = torch.randint(0, model.config.vocab_size, (1, a.tokens), device=a.device)

    def forwards():
        with torch.no_grad():
            for _ in range(a.forwards):
                model(ids)
        if model.device.type == "cuda":
            torch.cuda.synchronize()  # the block's work, not only its launches

    tmp = Path(tempfile.mkdtemp(prefix="eh-bench-sinks-"))
    sinks = make_sinks(tmp)
    t0 = time.perf_counter()
    mons = {"none": eh.Monitor(model, log_every=LOG_EVERY)}
    mons.update({name: eh.Monitor(model, sink=s, log_every=LOG_EVERY) for name, s in sinks.items()})
    for m in mons.values():
        m.state_dict()  # prepares spectra and nulls now, not in a timed block
    print(f"prepared {len(mons)} monitors in {time.perf_counter() - t0:.1f} s; timing {a.rounds} rounds")
    forwards()  # warm-up

    names = ["plain", *mons]
    times: dict[str, list[float]] = {n: [] for n in names}
    exits: dict[str, list[float]] = {n: [] for n in mons}
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name == "plain":
                times[name].append(timed(forwards))
                continue
            mon = mons[name]
            mon.__enter__()
            try:
                # The block's last log point is written at the next one, which is the exit here: write it
                # in the timed region, so a block of 10 forwards counts one write, as a long run does.
                times[name].append(timed(lambda mon=mon: (forwards(), mon._logs.emit_pending(mon._labels()))))
            finally:
                exits[name].append(timed(lambda mon=mon: mon.__exit__(None, None, None)))

    plain = statistics.median(times["plain"]) / a.forwards
    none = statistics.median(times["none"]) / a.forwards
    print(
        f"\n{a.device}: 1 x {a.tokens} tokens, {a.forwards} forwards a block, log_every={LOG_EVERY}: plain {plain * 1e3:.1f} ms, "
        f"monitored {none * 1e3:.1f} ms a forward (monitored/plain {none / plain:.3f})"
    )
    print(f"{'sink':<12} {'rise':>8} {'ratio':>7} {'log point':>10} {'per fwd':>8} {'exit':>7}")
    for name in sinks:
        rise = statistics.median((s - n) / p for s, n, p in zip(times[name], times["none"], times["plain"]))
        ratio = statistics.median(s / n for s, n in zip(times[name], times["none"]))
        point, per_forward = _log_point(mons[name])
        print(
            f"{name:<12} {rise:>+8.4f} {ratio:>7.4f} {point * 1e3:>8.2f}ms {per_forward / plain:>+8.5f} "
            f"{statistics.median(exits[name]):>6.2f}s"
        )
    print("\nrise: median of (t_sink - t_none) / t_plain (goal <= 0.01); ratio: median of t_sink / t_none;")
    print("log point: one mon.log() (jsonl: one line, written every forward); per fwd: its share of a plain forward")
    if "wandb" in sinks:
        sinks["wandb"].finish()


def _log_point(mon) -> tuple[float, float]:
    """(seconds one log point takes, seconds it adds per forward): a whole ``mon.log()`` (the copy
    of the sums, the values, the sink's write), median of 20; the .jsonl file writes one line of
    the forward's own sums every forward instead."""
    sink = mon._logs.sinks[0]
    if sink.per_forward:
        from eigenhooks.monitor.measures import TGT_FIELDS

        stats = [{"layer": i, "target": "ov/modulus", **dict.fromkeys(TGT_FIELDS, 1.0)} for i in range(24)]
        line = statistics.median(timed(lambda: sink.forward(0, stats)) for _ in range(20))
        return line, line
    point = statistics.median(timed(mon.log) for _ in range(20))
    return point, point / LOG_EVERY


if __name__ == "__main__":
    main()

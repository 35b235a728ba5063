"""An opted-in OpenAI-compatible server writes one JSON line per finished request; tensor parallel 2 equals 1.

The server runs as users start it (``python -m vllm.entrypoints.openai.api_server``, the ``vllm`` script
being broken beside the CPU torch here), on 127.0.0.1 only, in its own process group, bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from parity import compare, hf_table, processed_tokens
from test_engine_monitor import OPT_IN, OPTS, greedy, prompts, shut
from tier import start_engine

import eigenhooks as eh
from eigenhooks.engines.vllm.serve import read_lines

BOOT_S = 240  # the server must answer its health check within this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _complete(port: int, prompt: str, request_id: str | None = None) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0.0}).encode()
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_served_engine_writes_one_line_per_request_under_8_at_once(tiny_llama, tmp_path):
    """8 concurrent completions, 2 of them (of different lengths) sent with one X-Request-Id: 10 lines, each
    request's own, the two that shared an id told apart by engine_id; then SIGKILL leaves whole lines."""
    out, port = tmp_path / "eh", _free_port()
    extra = {"eigenhooks": {"out": str(out), "settings": {"null_draws": 9}}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--gpu-memory-utilization", "0.1", "--max-model-len", "256", "--enforce-eager",
           "--additional-config", json.dumps(extra)]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() - t0 < BOOT_S, "the server did not come up in time"
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                time.sleep(1)
        texts = [f"request number {i} says " + "word " * (3 + 5 * i) for i in range(8)]
        jobs = [(t, None) for t in texts] + [("a short one", "trace-42"), ("a longer one " + "word " * 9, "trace-42")]
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda job: _complete(port, *job), jobs))
        ids = sorted(a["id"] for a in answers)
        assert ids.count("cmpl-trace-42") == 2
        deadline = time.time() + 30
        while len(read_lines(out)) < 10 and time.time() < deadline:  # a line follows the scheduler's next step
            time.sleep(0.5)
        lines = read_lines(out)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # killed, not stopped: what it wrote must still be whole lines
        proc.wait(30)
        log.close()
    assert len(list(out.glob("*.jsonl"))) == 1  # one writing process (rank 0's worker), one file
    assert sorted(line["request_id"] for line in lines) == ids
    assert len({line["engine_id"] for line in lines}) == 10
    dup = [line for line in lines if line["request_id"] == "cmpl-trace-42"]
    assert all(line["engine_id"].startswith("cmpl-trace-42-0-") for line in dup)

    def order(n_tokens):  # answers and lines of one id paired by their token counts
        return lambda x: (x["request_id"] if "request_id" in x else x["id"], n_tokens(x))

    tokens = lambda a: a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] - 1  # noqa: E731  (forwards processed)
    lines = sorted(lines, key=order(lambda x: x["layers"][0]["n_tokens"]))
    for line, a in zip(lines, sorted(answers, key=order(tokens))):
        n = tokens(a)
        assert {(r["layer"], r["target"]) for r in line["layers"]} == {(0, "ov/modulus"), (0, "ov/residual"),
                                                                      (1, "ov/modulus"), (1, "ov/residual")}  # fmt: skip
        for r in line["layers"]:
            assert r["n_tokens"] == n and 0 < r["gamma_pre"] < 1 and 0 <= r["rho"] <= 1
    raw = b"".join(p.read_bytes() for p in out.glob("*.jsonl"))
    assert raw.endswith(b"\n") and len(raw.splitlines()) == 10


def test_tensor_parallel_2_equals_1(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    ps = prompts([33, 14, 51], seed=9)
    llm = start_engine(tiny_llama, enforce_eager=True, additional_config=OPT_IN, tensor_parallel_size=2,
                       distributed_executor_backend="mp")  # fmt: skip
    try:
        with eh.monitor(llm, **OPTS) as mon:
            outs = llm.generate(ps, greedy(6))
    finally:
        shut(llm)
    compare(mon.summary(), hf_table(tiny_llama, processed_tokens(outs), **OPTS))
    assert int(mon.summary()["n_sequences"].iloc[0]) == 3  # counted on one rank: each request once


pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

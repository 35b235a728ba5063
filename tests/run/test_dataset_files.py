"""``--dataset`` with local files: offline, exact token counts, streamed, clear errors.

The token count a run must reach is computed here from the file itself (plain Python
reading, the model's tokenizer), not through HF datasets; the streaming check counts the
bytes this process reads (``/proc/self/io``) and the rows the run pulls from the source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eigenhooks as eh
from eigenhooks.run import run
from eigenhooks.run.texts import DataLoadError, TokenBatches, iter_texts

PARAGRAPH = "The model reads each line as it comes; nothing waits for the whole file.\n"


def _write_txt(path: Path, n_lines: int) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_lines):
            f.write(f"line {i}: {PARAGRAPH}")
            if i % 7 == 6:
                f.write("\n")  # blank lines are skipped, not counted
    return path


def _write_jsonl(path: Path, n_rows: int) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_rows):
            f.write(json.dumps({"id": i, "text": f"row {i}. {PARAGRAPH.strip()}"}) + "\n")
    return path


def _expected_tokens(path: Path, tok) -> int:
    """Tokens the file holds, read without HF datasets: one row per non-blank line (or JSON line)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.strip():
            continue
        rows.append(json.loads(line)["text"] if path.suffix == ".jsonl" else line)
    return sum(len(tok(r, add_special_tokens=False)["input_ids"]) for r in rows)


@pytest.fixture(scope="module")
def tok():
    return eh.zoo.load("gpt2-tiny")[1]


def _offline_env(tmp_path: Path) -> dict:
    """The hub unreachable three ways: offline flags, a dead endpoint, a private empty HF home."""
    return {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HOME": str(tmp_path / "hf-home"),
        "EIGENHOOKS_CACHE": str(tmp_path / "eh-cache"),
        "OMP_NUM_THREADS": "1",
    }


# One process (the offline variables must be set before `datasets` is imported), several
# `eigenhooks run` invocations through the CLI app, each reported as one JSON line.
_CLI_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from typer.testing import CliRunner
    from eigenhooks.cli import app
    runner = CliRunner()
    for src, max_tokens, out in json.loads(sys.argv[1]):
        r = runner.invoke(app, ["run", "gpt2-tiny", "--dataset", src, "--max-tokens", str(max_tokens), "--out", out])
        print(json.dumps({"src": src, "code": r.exit_code, "output": r.output[-3000:]}))
    """
)


def test_cli_dataset_offline_counts_exactly_the_file(tmp_path, tok):
    txt = _write_txt(tmp_path / "corpus.txt", 60)
    jsonl = _write_jsonl(tmp_path / "corpus.jsonl", 50)
    n_txt, n_jsonl = _expected_tokens(txt, tok), _expected_tokens(jsonl, tok)
    assert 400 < n_txt < 4096 and 400 < n_jsonl < 4096  # whole files fit under --max-tokens 4096
    jobs = [
        (str(txt), 4096, str(tmp_path / "txt-all")),
        (str(jsonl), 4096, str(tmp_path / "jsonl-all")),
        (str(txt), 300, str(tmp_path / "txt-300")),
        (f"json:{jsonl}", 333, str(tmp_path / "jsonl-333")),
        (str(tmp_path / "missing.jsonl"), 100, str(tmp_path / "missing")),
    ]
    p = subprocess.run(
        [sys.executable, "-c", _CLI_SCRIPT, json.dumps(jobs)],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path),
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(res) == len(jobs), p.stdout[-3000:]
    for r, (_, _, out), want in zip(res[:4], jobs[:4], (n_txt, n_jsonl, 300, 333), strict=True):
        assert r["code"] == 0, r["output"]
        assert "tokens/s" in r["output"], r["output"]
        meta = json.loads((Path(out) / "meta.json").read_text())
        assert meta["status"] == "complete" and meta["n_tokens"] == want, (out, meta["n_tokens"], want)
        assert meta["tokens_per_rank"] == [want] and meta["tokens_per_s"] > 0
    assert res[4]["code"] == 1 and "no such file" in res[4]["output"], res[4]["output"]
    assert not (tmp_path / "missing").exists()
    assert not list((tmp_path / "hf-home").rglob("*.arrow"))  # streamed: nothing cached as Arrow


def _rchar() -> int:
    """Bytes this process has read through read() calls so far (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_dataset_streams_a_file_much_larger_than_max_tokens(tmp_path, tok):
    text = "The quick brown fox jumps over the lazy dog. " * 200
    row = json.dumps({"text": text}) + "\n"
    per_row = len(tok(text, add_special_tokens=False)["input_ids"])
    max_tokens = 2 * per_row + 10  # three rows' worth, just
    big = tmp_path / "big.jsonl"
    with open(big, "w", encoding="utf-8") as f:
        f.write(row * ((96 << 20) // len(row) + 1))  # 96 MB, ~9.6 of HF datasets' 10 MB chunks
    size = big.stat().st_size
    list(iter_texts(dataset=str(_write_jsonl(tmp_path / "warm.jsonl", 3))))  # imports, not measured

    pulled = 0

    def counted(rows):
        nonlocal pulled
        for r in rows:
            pulled += 1
            yield r

    before = _rchar()
    batches = TokenBatches(tok, counted(iter_texts(dataset=str(big))), max_tokens, 128, 8)
    n = sum(b.numel() for b in batches)
    lazy = _rchar() - before
    assert n == batches.n_tokens == max_tokens
    assert pulled == 3  # the source is pulled row by row, and no further than needed
    assert lazy < 0.4 * size, f"read {lazy / 2**20:.1f} MB of a {size / 2**20:.1f} MB file for {n} tokens"

    # the measure can fail: reading every row does read the whole file
    before = _rchar()
    assert sum(1 for _ in iter_texts(dataset=str(big))) == size // len(row)
    assert _rchar() - before >= size


def test_run_through_the_api_stops_at_max_tokens_on_a_big_file(tmp_path, tok):
    txt = _write_txt(tmp_path / "long.txt", 20_000)  # ~400k tokens
    res = run("gpt2-tiny", dataset=str(txt), max_tokens=700, out=tmp_path / "r", progress=False)
    assert (res.summary["n_tokens"] == 700).all() and res.tokens_per_s > 0


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.jsonl", None, "no such file: .*missing.jsonl"),
        ("missing.txt", None, "no such file: .*missing.txt"),
        ("empty.jsonl", "", "the file is empty"),
        ("numbers.jsonl", '{"text": 1}\n{"text": 2}\n', r"no text column: its first row holds text: int"),
        ("nested.jsonl", '{"doc": {"body": "x"}}\n', r"no text column: its first row holds doc: dict"),
        ("broken.jsonl", '{"text": "fine"}\n{"text": \n', r"could not read .*broken.jsonl with the 'json' builder"),
        ("data.xml", "<a>text</a>\n", r"unknown file type '.xml'"),
    ],
)
def test_dataset_errors_name_the_file_and_the_fix(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataLoadError, match=match):
        list(iter_texts(dataset=str(path)))


def test_missing_builder_path_and_run_refuse_before_loading(tmp_path):
    with pytest.raises(DataLoadError, match="no such file or folder: .*nope.txt"):
        iter_texts(dataset=f"text:{tmp_path / 'nope.txt'}")
    with pytest.raises(DataLoadError, match="no such file"):
        run("gpt2-tiny", dataset=str(tmp_path / "nope.jsonl"), out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_a_malformed_line_past_the_first_chunk_is_a_data_error(tmp_path):
    """HF datasets reads 10 MB at a time: a bad line further on surfaces while streaming, named."""
    path = tmp_path / "late.jsonl"
    good = json.dumps({"text": "fine " * 100}) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(good * ((12 << 20) // len(good)))
        f.write('{"text": broken\n')
    rows = iter_texts(dataset=str(path))  # opens: the first chunk is fine
    with pytest.raises(DataLoadError, match=r"could not read .*late.jsonl with the 'json' builder \(ArrowInvalid"):
        for _ in rows:
            pass

"""Every Python block of README.md and docs/*.md runs as pasted into a fresh interpreter, on the zoo models,
and each expression it shows gives a value, not None.

A block that needs a GPU, the network, a real model or torch.distributed says so on the line before it:
``<!-- snippet: skip (why) -->``; it is skipped by that name, and there are few. Each block runs alone, in
a fresh process in an empty folder, as a reader pasting it would run it (README blocks 2-4 once failed so:
``NameError: tok``), unless its first line says it goes on from the block before it
(``# continues the block above``): then it runs after that one, in its process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((.+?)\)\s*-->")
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
CONTINUES = "# continues the block above"  # a block's first line, when it uses the names of the one before

# Files whose blocks start a vLLM engine: they run in CI's vllm environment (`-m vllm`) and skip, saying
# why, where vllm is not installed (EIGENHOOKS_REQUIRE_VLLM=1 makes that a failure, as in tests/vllm/).
VLLM_FILES = {"docs/vllm.md"}
_HAS_VLLM = getattr(importlib.util.find_spec("vllm"), "origin", None) is not None  # tests/vllm is a namespace


def _param(name: str):
    if name not in VLLM_FILES:
        return name
    absent = not _HAS_VLLM and os.environ.get("EIGENHOOKS_REQUIRE_VLLM") != "1"
    why = f"{name} starts a vLLM engine: vllm is not installed here (CI's vllm environment runs it)"
    return pytest.param(name, marks=[pytest.mark.vllm, pytest.mark.skipif(absent, reason=why)])


def blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, why skipped or None) of each ```python block."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        skip = SKIP.search(before[-1]) if before else None
        out.append((text[: m.start()].count("\n") + 1, m.group(1), skip.group(1) if skip else None))
    return out


# Runs in the fresh interpreter: each top-level expression is evaluated and its value checked, as a
# notebook would show it; everything else is executed.
RUNNER = r"""
import ast, dataclasses, json, sys, traceback

# fields that are None by definition where they do not apply: a limit's angle exists only for a rotation
MAY_BE_NONE = {"Limit": {"angle"}}

def nones(v, depth=0):
    if v is None:
        return ["None"]
    if depth > 1:
        return []
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        free = MAY_BE_NONE.get(type(v).__name__, set())
        return [f.name for f in dataclasses.fields(v) if getattr(v, f.name) is None and f.name not in free]
    if isinstance(v, (tuple, list)) and len(v) <= 64:
        return [f"[{i}]: {n}" for i, x in enumerate(v) for n in nones(x, depth + 1)]
    if hasattr(v, "empty") and hasattr(v, "columns") and v.empty:
        return ["an empty DataFrame"]
    return []

space, results = {"__name__": "__main__"}, []
for line, code in json.load(open(sys.argv[1])):
    res = {"line": line, "error": None, "nones": []}
    try:
        for node in ast.parse(code).body:
            call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            # a call done for its effect, which promises no value: print(...), an engine's ....shutdown()
            is_print = call and (getattr(node.value.func, "id", "") == "print" or getattr(node.value.func, "attr", "") == "shutdown")
            if isinstance(node, ast.Expr) and not is_print:
                value = eval(compile(ast.Expression(node.value), f"<block at line {line}>", "eval"), space)
                res["nones"] += [f"line {line + node.lineno}: {ast.unparse(node)[:60]} -> {n}" for n in nones(value)]
            else:
                exec(compile(ast.Module([node], []), f"<block at line {line}>", "exec"), space)
    except Exception:
        res["error"] = traceback.format_exc(limit=3)[-1500:]
    results.append(res)
    if res["error"]:
        break  # later blocks of the chain build on this one
json.dump(results, open(sys.argv[2], "w"))
"""


def chains(todo: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The blocks grouped as a reader runs them: a block alone, or after the one it says it continues."""
    out: list[list[tuple[int, str]]] = []
    for line, code in todo:
        if code.lstrip().startswith(CONTINUES) and out:
            out[-1].append((line, code))
        else:
            out.append([(line, code)])
    return out


def _run(blocks_to_run, tmp_path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    src, out = tmp_path / "blocks.json", tmp_path / "results.json"
    src.write_text(json.dumps(blocks_to_run))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EIGENHOOKS_CACHE": str(tmp_path / "cache"), "MPLBACKEND": "Agg"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", EIGENHOOKS_PROGRESS="0")
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.run(
        [sys.executable, "-c", RUNNER, str(src), str(out)], cwd=work, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [_param(n) for n in FILES])
def test_every_python_block_runs_and_gives_values(name, tmp_path):
    found = blocks((ROOT / name).read_text(encoding="utf-8"))
    todo = [(line, code) for line, code, why in found if why is None]
    if not todo:
        pytest.skip(f"{name} has no Python block to run ({len(found)} marked to skip)")
    results = []
    for k, chain in enumerate(chains(todo)):  # each in a fresh interpreter
        results += _run(chain, tmp_path / str(k))
    failed = [f"{name}:{r['line']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "\n".join(failed)
    assert len(results) == len(todo)
    empty = [n for r in results for n in r["nones"]]
    assert not empty, f"{name}: expressions that promise a value gave None: {empty}"


def test_few_blocks_are_skipped_and_each_says_why():
    skipped = [
        (name, line, why)
        for name in FILES
        for line, _, why in blocks((ROOT / name).read_text(encoding="utf-8"))
        if why is not None
    ]
    total = sum(len(blocks((ROOT / n).read_text(encoding="utf-8"))) for n in FILES)
    assert total >= 7 and len(skipped) <= 3, skipped
    assert all(re.search(r"GPU|network|real model|torch\.distributed", why) for _, _, why in skipped), skipped


def test_a_block_runs_alone_unless_it_says_what_it_continues():
    first, alone, after = (1, "x = 1\nx"), (5, "x"), (9, CONTINUES + "\nx + 1")
    assert chains([first, alone, after]) == [[first], [alone, after]]
    assert chains([first, after]) == [[first, after]]


def test_the_runner_catches_none_and_errors(tmp_path):
    """The check itself: a block whose expression is None, one with a None field, one that raises."""
    code = (
        "import dataclasses\n"
        "@dataclasses.dataclass\nclass R:\n    a: float = 1.0\n    b: float | None = None\n"
        "x = None\nx\nR()\n(1, None)\n"
    )
    results = _run([(1, code), (20, "1 / 0"), (30, "never_run")], tmp_path)
    assert [r["line"] for r in results] == [1, 20]  # stops at the failing block
    assert len(results[0]["nones"]) == 3 and "-> b" in results[0]["nones"][1]
    assert "ZeroDivisionError" in results[1]["error"]


# how the README names a [dev] requirement, where it is not the requirement's own name
SPOKEN = {"transformer-lens": "TransformerLens", "wandb": "Weights & Biases", "mlflow": "MLflow"}


def test_readme_says_what_dev_installs_and_how_long_the_suite_takes():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    names = [re.split(r"[<>=!;\s\[]", req, maxsplit=1)[0] for req in dev]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = readme[readme.index("`[dev]`") :].split("\n\n")[0].lower()  # the paragraph on [dev]
    missing = [n for n in names if SPOKEN.get(n, n).lower() not in said]
    assert not missing, f"README's [dev] paragraph does not name {missing}"
    assert re.search(r"about\s+\S+\s+minutes\s+on\s+2\s+cores", said)

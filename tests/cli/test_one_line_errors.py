"""CLI errors are one line that names the file or the flag (issue 29, item 9).

Bad text files given to ``run --dataset`` (no library log line before ours), bad ``.npy`` files
given to ``steer --toward`` (never numpy's advice to unpickle), and library messages that name
a Python argument (``allow_shared=True``) where the command line has a flag (``--allow-shared``).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from eigenhooks.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
D = 128  # gpt2-tiny's width


def _write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


DATASETS = {
    "bad.jsonl": '{"text": "fine"}\n{"text": broken\n',
    "late.jsonl": '{"text": "a line of text"}\n' * 3000 + "{not json}\n",
    "list.jsonl": "[1, 2, 3]\n",
    "bad.parquet": b"PAR1 this is no parquet file PAR1",
    "bad.csv": 'text,b\n"unclosed,1\n',
    "cut.json": '[{"text": "x"}, ',
    "latin1.txt": b"caf\xe9 au lait\n",
}


@pytest.mark.parametrize("name", DATASETS)
def test_bad_dataset_files_are_one_line_naming_the_file(tmp_path, name):
    pytest.importorskip("datasets", reason="--dataset reads files with the 'datasets' package (the [dev] extra)")
    path = _write(tmp_path / name, DATASETS[name])
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--dataset", str(path), "--max-tokens", "64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([*cmd, "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=120)
    err = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 1 and len(err) == 1, res.stderr  # a library's log line first makes two
    assert err[0].startswith("eigenhooks: error:") and str(path) in err[0], err


def _npy(path: Path, a, **kw) -> Path:
    with open(path, "wb") as f:  # np.save(path) would add .npy to u.NPY
        np.save(f, a, **kw)
    return path


def _npz(path: Path) -> Path:
    np.savez(path, u=_unit())
    return path


def _unit(n: int = D, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).standard_normal(n)
    return u / np.linalg.norm(u)


NPY = {
    "garbage": lambda p: _write(p, b"hello, I am not an array"),
    "empty": lambda p: _write(p, b""),
    "cut short": lambda p: _write(p, _npy(p, _unit()).read_bytes()[:-100]),
    "pickled objects": lambda p: _npy(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
    "strings": lambda p: _npy(p, np.array(["a"] * D)),
    "complex": lambda p: _npy(p, _unit() + 0.5j),
    "bool": lambda p: _npy(p, np.ones(D, dtype=bool)),
    "2-D": lambda p: _npy(p, _unit(2 * D).reshape(2, D)),
    "wrong width": lambda p: _npy(p, _unit(16)),
    "scalar": lambda p: _npy(p, np.float64(1.0)),
    "nan": lambda p: _npy(p, np.full(D, np.nan)),
    "zero": lambda p: _npy(p, np.zeros(D)),
    "not unit": lambda p: _npy(p, 3 * _unit()),
    "npz inside": lambda p: _write(p, _npz(p.with_suffix(".npz")).read_bytes()),
    "a folder": lambda p: (p.mkdir(), p)[1],
    "missing": lambda p: p,
}


@pytest.mark.parametrize("case", NPY)
def test_bad_npy_directions_are_one_line_naming_the_file(tmp_path, case):
    path = NPY[case](tmp_path / "u.npy")
    r = runner.invoke(app, ["steer", "--toward", str(path), "--top-k", "2"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"--toward {path}" in r.output, r.output
    for python in ("allow_pickle", "unsafely", "pickle.load", "Traceback", "u.norm()"):
        assert python not in r.output, r.output


def test_a_good_npy_direction_steers_and_a_file_that_is_no_npy_is_refused(tmp_path):
    r = runner.invoke(app, ["steer", "--toward", str(_npy(tmp_path / "u.NPY", _unit().astype(np.float32)))])
    assert r.exit_code == 0 and "cos(v1', u) 1.0000" in r.output, r.output
    txt = _write(tmp_path / "u.txt", "0.1 0.2")
    r = runner.invoke(app, ["steer", "--toward", str(txt)])
    assert r.exit_code == 1 and f"--toward {txt} is a file" in r.output and ".npy" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


# (command line, the flag the error must name): each reaches a library check that names its Python argument
FLAG_CASES = [
    (["steer", "albert-tiny", "--gap-ratio", "0.5"], "--allow-shared"),
    (["steer", "--gap-ratio", "2"], "--gap-ratio"),
    (["steer", "--alpha", "nan"], "--alpha"),
    (["steer", "--alpha", "1", "--gap-ratio", "0.1"], "--alpha and --gap-ratio"),
    (["steer", "--mode", "x"], "--mode"),
    (["steer", "--method", "x"], "--method"),
    (["iterate", "--steps", "0"], "--steps"),
    (["iterate", "--mode", "x"], "--mode"),
    (["spectrum", "--variant", "x"], "--variant"),
    (["spectrum", "--rank", "x"], "--rank"),
    (["spectrum", "--backend", "x"], "--backend"),
    (["run", "--null-draws", "0"], "--null-draws"),
    (["run", "--null-stride", "0"], "--null-stride"),
    (["run", "--fnull-draws", "-1"], "--fnull-draws"),
    (["run", "--eig-top", "-1"], "--eig-top"),
    (["run", "--backend", "x", "--max-tokens", "64"], "--backend"),
]


def _python_spellings(output: str, command: str) -> list[str]:
    """The command's options as a Python caller spells them (gap_ratio, allow_shared=True, mode must ...)."""
    cmd = typer.main.get_command(app).commands[command]
    found = re.findall(r"(?<![-\w])\w+=(?:True|False)\b", output)
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        n = re.escape(p.name)
        if re.search(rf"(?<![-\w]){n}(?:=|\s+must\b)", output) or ("_" in p.name and re.search(rf"\b{n}\b", output)):
            found.append(p.name)
    return found


@pytest.mark.parametrize("args, flag", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_cli_errors_name_the_flag_not_the_python_argument(tmp_path, args, flag):
    r = runner.invoke(app, [*args, *(["--out", str(tmp_path / "o")] if args[0] == "run" else [])])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert flag in r.output and not _python_spellings(r.output, args[0]), r.output


def test_flag_names_change_only_where_they_name_an_argument():
    from eigenhooks.cli import _as_flags

    prose = "the text is empty after tokenization; layer 3 in mode 'edit' of the model"
    assert _as_flags(prose, "run") == _as_flags(prose, "steer") == prose
    assert _as_flags("text must be a str, got 3", "run") == "--text must be a str, got 3"
    assert _as_flags("null_stride must be positive", "spectrum") == "null_stride must be positive"  # not its flag
    assert _as_flags("pass direction=u or allow_shared=True", "steer") == "pass --toward u or --allow-shared"

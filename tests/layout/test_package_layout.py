"""The package's layout: wings on a ladder, imports pointing down it, no circle anywhere.

docs/design.md, "Architecture": cli -> (run, integrations) -> (monitor, steer, dynamics) -> plots -> spectra -> zoo -> models -> linalg -> (data, progress).
An AST walk over eigenhooks/ maps every file to its wing and every import (module-level or
inside a function: a lazy import closes a circle just as well) to the file it loads.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

import eigenhooks as eh

ROOT = Path(eh.__file__).resolve().parent

# Higher imports lower; wings on one rung may import each other as long as no circle forms.
RANK = {
    "top": 8,  # eigenhooks/__init__.py (the public names), cli.py, __main__.py, _startup.py
    "run": 7,
    "integrations": 7,  # the HF Trainer callback: beside run, above the monitor it drives
    "engines": 6.5,  # serving engines (vLLM): the glue above the monitor it drives, below run
    "monitor": 6,
    "plots": 5.5,  # figures: the monitor (Monitor.plot) and run draw through it
    "steer": 6,
    "dynamics": 6,
    "spectra": 5,
    "zoo": 4,
    "models": 3,
    "linalg": 2,
    "data": 1,
    "progress": 1,  # progress bars for long steps: imports nothing of eigenhooks
}


def _module_of(path: Path, root: Path, pkg: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([pkg, *parts])


def _wing(module: str, files: dict[str, Path]) -> str:
    """The subpackage a module sits in; the package itself and its plain top-level files are "top"."""
    parts = module.split(".")
    head = ".".join(parts[:2])
    if len(parts) == 1 or files[head].name != "__init__.py":
        return "top"
    return parts[1]


def collect(root: Path, pkg: str) -> tuple[dict[str, Path], list[tuple[str, str]]]:
    """Every module of the package, and every (importer, imported module) edge inside it."""
    files = {_module_of(p, root, pkg): p for p in root.rglob("*.py")}
    edges = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                frm = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:  # `from x import y`: y is a submodule, or a name defined in x
                    sub = f"{frm}.{a.name}"
                    targets.append(sub if sub in files else frm)
            for t in targets:
                if t == pkg or t.startswith(pkg + "."):
                    edges.append((mod, t))
    return files, edges


def _loads(target: str, importer: str) -> list[str]:
    """The modules an import of ``target`` runs: it and its packages, less the importer's own packages."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if target == importer.split(".")[0]:  # `import eigenhooks` or `from eigenhooks import x`: the facade itself
        return [target]
    mine = importer.split(".")
    ancestors = {".".join(mine[:i]) for i in range(1, len(mine) + 1)}
    return [m for m in chain if m not in ancestors]


def violations(files: dict[str, Path], edges: list[tuple[str, str]], rank: dict[str, int]) -> list[str]:
    """Upward imports, circles between wings, circles between files: one line each."""
    bad = []
    file_graph: dict[str, set[str]] = {m: set() for m in files}
    wing_graph: dict[str, set[str]] = {}
    for src, dst in edges:
        for loaded in _loads(dst, src):
            if loaded not in files:
                continue
            file_graph[src].add(loaded)
            ws, wd = _wing(src, files), _wing(loaded, files)
            if ws == wd:
                continue
            if wd == "top" or rank.get(wd, 99) > rank.get(ws, 0):
                bad.append(f"upward import: {src} ({ws}) imports {loaded} ({wd})")
            wing_graph.setdefault(ws, set()).add(wd)
    for kind, graph in (("wings", wing_graph), ("files", file_graph)):
        cycle = _find_cycle(graph)
        if cycle:
            bad.append(f"circle between {kind}: {' -> '.join(cycle)}")
    return bad


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_every_file_belongs_to_a_known_wing():
    files, _ = collect(ROOT, "eigenhooks")
    unknown = sorted(m for m in files if _wing(m, files) not in RANK)
    assert not unknown, f"modules outside every wing (add them to a wing or to RANK): {unknown}"
    top = sorted(m for m in files if _wing(m, files) == "top")
    assert top == ["eigenhooks", "eigenhooks.__main__", "eigenhooks._startup", "eigenhooks.cli"], top


def test_imports_point_down_the_ladder_with_no_circle():
    files, edges = collect(ROOT, "eigenhooks")
    assert len(edges) > 100  # the walk really saw the package's imports
    assert violations(files, edges, RANK) == []


def _fake(tmp_path: Path, sources: dict[str, str]) -> tuple[dict, list]:
    for rel, text in sources.items():
        p = tmp_path / "fakepkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return collect(tmp_path / "fakepkg", "fakepkg")


FAKE_RANK = {"top": 8, "high": 6, "side": 6, "low": 2}


def test_the_check_catches_an_upward_import_a_lazy_circle_and_a_wing_circle(tmp_path):
    files, edges = _fake(
        tmp_path,
        {
            "__init__.py": "",
            "high/__init__.py": "from .a import f\n",
            "high/a.py": "from ..low.x import g\ndef f():\n    from ..side import s\n",
            "side/__init__.py": "def s():\n    from ..high import a\n",
            "low/__init__.py": "",
            "low/x.py": "def g():\n    from ..high.a import f\n",  # lazy, and upward
            "low/y.py": "def h():\n    import fakepkg as fp\n",  # the facade, from below it
        },
    )
    bad = violations(files, edges, FAKE_RANK)
    assert "upward import: fakepkg.low.y (low) imports fakepkg (top)" in bad, bad
    assert any(b.startswith("upward import: fakepkg.low.x (low) imports fakepkg.high") for b in bad), bad
    assert any(b.startswith("circle between wings:") for b in bad), bad
    assert any(b.startswith("circle between files:") for b in bad), bad


def test_a_clean_fake_ladder_passes(tmp_path):
    files, edges = _fake(
        tmp_path,
        {
            "__init__.py": "from .high import f\n",
            "high/__init__.py": "from ..low import g as f\n",
            "low/__init__.py": "g = 1\n",
        },
    )
    assert violations(files, edges, FAKE_RANK) == []


def test_the_wings_that_are_functions_are_callable_wings_after_every_module_is_imported():
    """`monitor`, `spectra`, `steer`: each name is one thing, its wing, which calls its function; importing
    its modules leaves it so, and ``import eigenhooks.monitor.reduce as R`` works (issue 48)."""
    import inspect

    for info in pkgutil.walk_packages(eh.__path__, "eigenhooks."):
        if info.name != "eigenhooks.__main__":
            importlib.import_module(info.name)
    for name in ("monitor", "spectra", "steer"):
        wing = getattr(eh, name)
        assert wing is importlib.import_module(f"eigenhooks.{name}") and callable(wing), name
        assert inspect.signature(wing) == inspect.signature(getattr(wing, name)), name
    for name in ("iterate", "load_model", "verify"):
        assert callable(getattr(eh, name)) and not isinstance(getattr(eh, name), types.ModuleType), name
    assert isinstance(eh.direction, types.ModuleType) and isinstance(eh.planted, types.ModuleType)
    assert eh.zoo.load("gpt2-tiny")[0].config.n_layer == 4
    import eigenhooks.monitor.reduce as R
    import eigenhooks.spectra.compute as C

    assert R.reduce_many and C.spectra is eh.spectra.spectra
    assert eh.spectra(eh.zoo.load("gpt2-tiny")[0])[0].kind == eh.spectra.spectra(eh.zoo.load("gpt2-tiny")[0])[0].kind


@pytest.mark.parametrize("old", ["metrics", "spectrum", "steering", "api", "io", "reducer", "monitor_state", "rundir"])
def test_the_old_flat_module_paths_are_gone(old):
    """No release was ever made with them: neither an attribute nor an import path, and no alias left."""
    eh.__dict__.pop(old, None)
    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(eh, old)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"eigenhooks.{old}")
    assert not hasattr(importlib.import_module("eigenhooks.monitor.reduce"), "LayerReducer")
    assert not hasattr(importlib.import_module("eigenhooks"), "_Package")


def test_importing_the_package_loads_no_torch_and_not_the_cli():
    """`import eigenhooks` is light: public names load on first use, and the CLI's start-up is the CLI's."""
    import subprocess
    import sys

    code = "import sys, eigenhooks; print('torch' in sys.modules, 'eigenhooks._startup' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], out
    code = "import eigenhooks as eh; print(callable(eh.spectra), type(eh.zoo).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "module"], out


def test_the_monitor_wing_exports_what_the_monitor_module_did():
    from eigenhooks.monitor import MeasurementWarning, Monitor, check_nulls, monitor

    assert eh.monitor.monitor is monitor and Monitor is eh.Monitor and callable(check_nulls)
    # calling the wing goes through the engines registered with it (eigenhooks.engines: a vllm.LLM gets the
    # engine monitor), with monitor()'s signature
    assert eh.monitor.__signature__ == inspect.signature(monitor)
    assert issubclass(MeasurementWarning, UserWarning)


# Files once allowed over 500 lines while they were split (none left: every file is within 500 lines).
GRANDFATHERED: dict[str, int] = {}


def test_no_file_is_over_500_lines_and_the_old_long_ones_do_not_grow():
    long = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > GRANDFATHERED.get(rel, 500):
            long[rel] = n
    assert not long, f"files over their limit (500 lines, or GRANDFATHERED's): {long}"
    assert all(not p.startswith("monitor/") for p in GRANDFATHERED)


def test_every_wing_says_what_it_owns():
    for wing in [w for w in RANK if w not in ("top",)]:
        doc = importlib.import_module(f"eigenhooks.{wing}").__doc__ or ""
        assert len(doc.split()) >= 15, f"eigenhooks/{wing}/__init__.py needs a docstring saying what it owns"
        if wing != "data":
            assert "import" in doc, f"eigenhooks/{wing}/__init__.py should say what it may import"

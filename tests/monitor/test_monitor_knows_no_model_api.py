"""The monitor's code names no model API: TransformerLens's ``hook_dict`` / ``hook_name`` and HF's call
keywords live in the adapters (``eigenhooks/models/``), which attach; docstrings and comments may name
them. Read from the code's syntax tree, so a string key, an attribute and a keyword all count."""

from __future__ import annotations

import ast
from pathlib import Path

import eigenhooks

BANNED = {"hook_dict", "hook_name", "input_ids", "inputs_embeds", "hidden_states"}
MONITOR = Path(eigenhooks.__file__).parent / "monitor"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def names_in(source: str) -> set[str]:
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found |= {b for b in BANNED if b in node.value}
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
    return found & BANNED


def test_the_check_sees_each_kind_of_use():
    assert names_in('x = kw.get("input_ids")') == {"input_ids"}
    assert names_in("m = model.hook_dict[t.hook_name]") == {"hook_dict", "hook_name"}
    assert names_in("f(hidden_states=x)") == {"hidden_states"}
    assert names_in('def f():\n    """reads input_ids"""\n    # hook_dict\n') == set()


def test_no_monitor_file_names_a_model_api():
    files = sorted(MONITOR.rglob("*.py"))
    assert len(files) > 20
    found = {str(p.relative_to(MONITOR)): names_in(p.read_text()) for p in files}
    assert not {f: n for f, n in found.items() if n}

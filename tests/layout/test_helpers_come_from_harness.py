"""Tests take their helpers from ``harness``, never from ``conftest``.

Every folder's conftest.py is imported under the one module name ``conftest``; which of them a
``from conftest import ...`` finds depends on which pytest loaded last. An import at a test's run time
(inside a function) found tests/vllm/conftest.py in CI and failed there only.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_imports_a_conftest_by_name():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n and n.split(".")[-1] == "conftest" for n in names):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not found, f"import from harness instead: {found}"

"""``pytest -q`` prints dots and the summary, nothing else (issue 58: a stray ``[zoo albert, … agree False]``).

A test's figures go to its captured output (shown with ``-rP``, or when it fails), never past the capture.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_prints_past_pytest_s_capture():
    pattern = re.compile(r"\bcap(sys|fd)\.disabled\(")
    found = [
        f"{p.relative_to(TESTS)}:{i}"
        for p in sorted(TESTS.rglob("*.py"))
        if p.name != Path(__file__).name
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"these print past the capture, into every -q run: {found}"

"""`eigenhooks steer --prompt A --prompt B` steers every prompt, as one batch (issue 58).

It used only the first prompt. Now the prompts run right-padded as one batch and each probability is read at
each prompt's own last token, then averaged: the same numbers as each prompt run alone, averaged. The output
says so, and counts the prompts whose --toward probability rose.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app

runner = CliRunner()
# a short prompt and a longer one: in a batch the first is right-padded, and its last column is a pad
PROMPTS = ["def f(x):", "import numpy as np\nx = np.zeros(3)\nfor i in range(3):\n   "]
P_LINE = re.compile(r"p\(' return'\) (.*): (\S+) -> (\S+)(?: \(rose in (\d+) of (\d+)\))?$", re.M)


def _steer(prompts: list[str]) -> tuple[str, str]:
    args = ["steer", "gpt2-tiny", "--toward", " return", "--top-k", "3"]
    r = runner.invoke(app, args + [a for p in prompts for a in ("--prompt", p)], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    return r.output, P_LINE.search(r.output)


def test_every_prompt_is_steered_and_each_is_read_at_its_last_token():
    alone = [_steer([p])[1] for p in PROMPTS]
    assert [m.group(1) for m in alone] == ["at the prompt's last token"] * 2
    before = [float(m.group(2)) for m in alone]
    after = [float(m.group(3)) for m in alone]
    assert abs(before[0] - before[1]) > 0.1 * max(before)  # the prompts differ: the first alone is not the mean

    text, both = _steer(PROMPTS)
    assert both.group(1) == "mean over the 2 prompts, each at its last token"
    assert float(both.group(2)) == pytest.approx(sum(before) / 2, rel=1e-2)
    assert float(both.group(3)) == pytest.approx(sum(after) / 2, rel=1e-2)
    rose = sum(a > b for a, b in zip(after, before, strict=True))
    assert (int(both.group(4)), int(both.group(5))) == (rose, 2)
    assert "prompts (2):\n" in text and all(f"  {p!r}\n" in text for p in PROMPTS)  # each prompt named
    # the table says where its p are read and why its rows are in their order
    flat = " ".join(text.split())
    assert "most probable after steering first; p: mean over the 2 prompts, each at its last token" in flat
    row = next(line for line in text.splitlines() if "(--toward)" in line)
    p_before, p_after = (float(x) for x in re.findall(r"\d\.\d{3}", row)[:2])
    assert p_before == pytest.approx(sum(before) / 2, abs=6e-4) and p_after == pytest.approx(sum(after) / 2, abs=6e-4)

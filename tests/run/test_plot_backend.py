"""Plots pick Agg only where no matplotlib backend was chosen, so notebooks keep theirs."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'eigenhooks[plot]')")

SCRIPT = """
import matplotlib
{setup}
from eigenhooks.plots import figures
figures._plt()
print(matplotlib.get_backend().lower())
"""


def _backend_after_plot(setup: str, env_backend: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    if env_backend is not None:
        env["MPLBACKEND"] = env_backend
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup)], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_unchosen_backend_becomes_agg():
    assert _backend_after_plot("") == "agg"


@pytest.mark.parametrize("how", ["use", "env"])
def test_chosen_backend_is_left_alone(how):
    # svg stands in for a notebook's inline backend: both are non-GUI backends chosen before plotting
    if how == "use":
        got = _backend_after_plot("matplotlib.use('svg')")
    else:
        got = _backend_after_plot("", env_backend="svg")
    assert got == "svg"

"""Ctrl-C that lands while a compiled module is first imported: the run still ends as an interrupted run.

A Ctrl-C that cut pandas' (or pyarrow's) first import short left it half made, and writing the run folder
with it afterwards killed the process with SIGSEGV in pandas' CSV reader (a real Ctrl-C 3.8 s into
`eigenhooks run` did it). The signal is sent from an import hook, so it lands inside that import every time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

_KICK = textwrap.dedent(
    """
    import os, signal, sys

    MODULE, OUT = sys.argv[1:3]

    class Kick:  # sends the process a real SIGINT when the named module starts importing, once
        done = False

        def find_spec(self, name, path=None, target=None):
            if name == MODULE and not Kick.done:
                Kick.done = True
                os.kill(os.getpid(), signal.SIGINT)

    sys.meta_path.insert(0, Kick())
    sys.argv = ["eigenhooks", "run", "--max-tokens", "64", "--out", OUT]
    from eigenhooks import cli

    cli.main()
    """
)


def _as_foreground() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal (a background job ignores SIGINT)


@pytest.mark.parametrize("module", ["pandas.core.reshape.merge", "pyarrow.compute", "scipy.stats._stats_py"])
def test_a_ctrl_c_inside_an_import_is_an_interrupted_run(tmp_path, module):
    out = tmp_path / "o"
    p = subprocess.run(
        [sys.executable, "-c", _KICK, module, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_as_foreground,
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 130 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert lines[0].startswith("eigenhooks: interrupted at stage load"), lines
    assert json.loads((out / "meta.json").read_text())["status"] == "interrupted"

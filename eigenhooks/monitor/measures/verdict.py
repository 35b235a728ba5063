"""The verdict's settings, registered as a measure: its numbers are computed at ``summary()`` from the kept tokens.

The verdict's null (directions drawn from the stream's own covariance) is drawn from the tokens themselves, so it
cannot be projected in the forward as the Haar null is: the monitor keeps a bounded sample of readings instead
(``monitor/verdict/sample.py``) and tests on it when the table is made (``monitor/verdict/__init__.py``). This entry
puts its settings where every measure's are read from: the fingerprint (two states merge only if they agree), the
main job's null settings and the CLI. It has no state fields and no slice of the fast reduction.
"""

from __future__ import annotations

from .base import Builtin


class VerdictSettings(Builtin):
    name = "verdict"
    settings = ("verdict_tokens", "verdict_draws", "sample_seed")


VERDICT = VerdictSettings()

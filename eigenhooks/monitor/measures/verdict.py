"""The verdict's null family: directions drawn from the stream's own covariance, tested when the table is made.

The verdict's null is drawn from the tokens themselves, so it cannot be projected in the forward as the Haar null
is: the monitor keeps a bounded sample of readings instead (``monitor/verdict/sample.py``) and tests on it when the
table is made (``monitor/verdict/__init__.py``). This entry puts its settings where every measure's are read from
(the fingerprint: two states merge only if they agree; the main job's null settings; the CLI) and its columns over
the table: each row's tilt and static columns (``verdict.COLUMNS``), q_tilt and q_static (BH per question over the
table's hypotheses), ``verdict`` and ``verdict_static``, and ``detectable_tilt``; they lead the table (``first``).
It has no state fields and no slice of the fast reduction.
"""

from __future__ import annotations

from .. import verdict as V
from .base import Builtin


class VerdictNull(Builtin):
    name = "verdict"
    settings = ("verdict_tokens", "verdict_draws", "sample_seed")
    table_columns = V.SAMPLE_COLUMNS
    # what a reader needs first, after the row's keys: what was decided, the tested effect and its interval, q
    first = (
        "verdict", "tilt", "tilt_ci_lo", "tilt_ci_hi", "q_tilt", "tilt_null_lo", "tilt_null_hi", "verdict_static",
        "static", "static_ci_lo", "static_ci_hi", "q_static", "static_null_lo", "static_null_hi", "p_tilt",
        "p_static", "tilt_lift", "static_lift", "eig_tilt_percentile", "detectable_tilt", "verdict_sequences",
        "verdict_tokens",
    )  # fmt: skip

    def table(self, df, at) -> None:
        """The kept tokens' columns (``verdict.COLUMNS``), q_tilt and q_static, ``verdict`` and ``verdict_static``.

        BH runs per question (docs/concepts.md). A layer where a call hangs on the draws (a q within Monte-Carlo
        error of 0.05, ``verdict.unsure``) is scored again on ``EXTEND`` times the draws, and q computed again.
        Each row's tilt draws are left in ``at.scratch`` for ``power``."""
        config, blocks = at.config, {}
        for _ in range(2):
            vcols = at.verdict(config, blocks) if at.verdict is not None else {}
            got, nulls = [], []
            for layer, lp in sorted(at.plan.layers.items()):
                for ti in range(len(lp.targets)):
                    v = dict(vcols[layer][ti]) if vcols.get(layer) else V.nan_columns(K=config.verdict_draws)
                    nulls.append(v.pop("_null", None))
                    got.append(v)
            for c in V.COLUMNS:
                df[c] = [v[c] for v in got]
            for p, q in (("p_tilt", "q_tilt"), ("p_static", "q_static")):
                df[p] = at.shared(df[p].tolist())
                df[q] = at.q(df[p].tolist())
            more = {
                int(r.layer): V.EXTEND
                for r in df[["layer", "p_tilt", "q_tilt", "p_static", "q_static", "verdict_draws"]].itertuples()
                if V.unsure(r.p_tilt, r.q_tilt, r.verdict_draws) or V.unsure(r.p_static, r.q_static, r.verdict_draws)
            }
            if not more.keys() - blocks.keys():
                break
            blocks.update(more)
        at.scratch[self.name] = nulls
        df["static_lift"] = df["static"] - df["static_null_median"]
        for name, q, lift in (("verdict", "q_tilt", "tilt_lift"), ("verdict_static", "q_static", "static_lift")):
            df[name] = [
                V.verdict(qv, lv, n, at.read_mid) for qv, lv, n in zip(df[q], df[lift], df["verdict_sequences"])
            ]

    def power(self, df, at) -> None:
        """``detectable_tilt``: the smallest lift of the tilt above its null's median each row would have been
        called at with 80% power, alone among its family's m hypotheses (those with a p_tilt), its own error across
        sequences included (``verdict.detectable``)."""
        import numpy as np

        first, families = at.first, at.families
        ok = df["p_tilt"].notna().to_numpy()
        m = {f: sum(1 for i, j in enumerate(first) if i == j and families[i] == f and ok[i]) for f in set(families)}
        df["detectable_tilt"] = [
            V.detectable(nl, se, m[f]) if o and nl is not None else np.nan
            for nl, se, f, o in zip(at.scratch[self.name], df["tilt_se"], families, ok)
        ]


VERDICT = VerdictNull()

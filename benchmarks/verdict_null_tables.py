"""The markdown tables of docs/findings.md's "The verdict's null" section, from verdict_null.py's printed logs.

    python benchmarks/verdict_null_tables.py LOG [LOG ...]

verdict_null.py prints one line per (part, layer); this reads those lines back and prints, for each log: the acid
test per layer (calibration), v_1's per-layer test on each half beside each other (replication), or the per-layer
test of a control. Nothing is computed here but counts and maxima of what the logs say.
"""

from __future__ import annotations

import re
import sys

ROW = re.compile(
    r"\[(?P<part>[^\]]+)\] layer +(?P<layer>\d+) k=(?P<k>\d) Δγ (?P<dg>[-+.\d]+) \[(?P<lo>[-+.\d]+), (?P<hi>[-+.\d]+)\] "
    r"null (?P<nlo>[-+.\d]+)\.\.(?P<nhi>[-+.\d]+) p (?P<p>[.\d]+) \| γpre (?P<g>[.\d]+) p (?P<ps>[.\d]+) \| eig2-16 "
    r"called (?P<eig>[.\d]+) v1 pct among them (?P<pct>[.\d]+) \| haar called (?P<haar>[.\d]+)"
)
CAL = re.compile(r"(tilt|static) \.05 ([\d.]+) \(ub ([\d.]+)\) \.01 ([\d.]+) \(ub ([\d.]+)\)")
CALLS = re.compile(r"\[(?P<part>[^\]]+)\] tilt calls: (?P<calls>.*)")


def parse(path: str):
    rows, cal, calls = {}, {}, {}
    for line in open(path, encoding="utf-8"):
        m = ROW.search(line)
        if m:
            rows.setdefault(m["part"], []).append(m.groupdict())
            for q, a, ua, b, ub in CAL.findall(line):
                cal.setdefault(q, []).append((int(m["layer"]), float(a), float(ua), float(b), float(ub)))
        m = CALLS.search(line)
        if m:
            calls[m["part"]] = dict(x.split(":") for x in m["calls"].split(", ") if ":" in x)
    return rows, cal, calls


def calibration(cal: dict) -> str:
    out = ["| question | layers | share p < 0.05: mean, min–max | layers whose 95% upper bound > 6% | share p < 0.01: "
           "mean, min–max | layers whose 95% upper bound > 1.5% |", "|---|---|---|---|---|---|"]  # fmt: skip
    for q, v in cal.items():
        a, b = [x[1] for x in v], [x[3] for x in v]
        over5 = [f"{x[0]} ({x[2]:.2%})" for x in v if x[2] > 0.06]
        over1 = [f"{x[0]} ({x[4]:.2%})" for x in v if x[4] > 0.015]
        out.append(
            f"| {q} | {len(v)} | {sum(a) / len(a):.2%}, {min(a):.2%}–{max(a):.2%} | {', '.join(over5) or 'none'} | "
            f"{sum(b) / len(b):.2%}, {min(b):.2%}–{max(b):.2%} | {', '.join(over1) or 'none'} |"
        )
    return "\n".join(out)


def per_layer(rows: dict, calls: dict, parts: list[str]) -> str:
    head = (
        "| layer | k | "
        + " | ".join(f"{p}: Δγ [95% CI], null 95%, p, call" for p in parts)
        + " | v_1's Δγ percentile among F's 2–16 | F's 2–16 called |"
    )
    out = [head, "|" + "---|" * (len(parts) + 4)]
    by = {p: {int(r["layer"]): r for r in rows[p]} for p in parts}
    for layer in sorted(by[parts[0]]):
        cells = []
        for p in parts:
            r = by[p][layer]
            cells.append(
                f"{r['dg']} [{r['lo']}, {r['hi']}], {r['nlo']}…{r['nhi']}, {r['p']}, {calls.get(p, {}).get(str(layer), '–')}"
            )
        r0 = by[parts[0]][layer]
        out.append(f"| {layer} | {r0['k']} | " + " | ".join(cells) + f" | {r0['pct']} | {r0['eig']} |")
    return "\n".join(out)


def main() -> None:
    for path in sys.argv[1:]:
        rows, cal, calls = parse(path)
        print(f"<!-- {path} -->")
        if cal:
            print(calibration(cal) + "\n")
        parts = [p for p in rows if p.startswith("half")] or [p for p in rows if "calibration" not in p]
        if parts:
            print(per_layer(rows, calls, parts) + "\n")


if __name__ == "__main__":
    main()

"""The learning-margins table from the rows scripts/learning_margins.sh collected (one JSON a line:
test, metric, value, threshold, seed, cpu, threads): per test and metric, the minimum, median and
maximum over the variants, the smallest margin and the variant that gave it, and any variant below
its threshold. Prints Markdown (docs/learning-margins.md holds a copy).

    python scripts/margins_table.py outputs/learning-margins/margins.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def table(rows: list[dict]) -> str:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["test"], r["metric"])].append(r)
    out = ["| test | asserted value | threshold | variants | min | median | max | min margin | lowest variant |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    below = []
    for (test, metric), rs in sorted(groups.items()):
        vals = [r["value"] for r in rs]
        low = min(rs, key=lambda r: r["value"])
        thr = rs[0]["threshold"]
        variants = len({(r["cpu"], r["threads"], r["seed"]) for r in rs})
        out.append(f"| {test} | {metric} | {thr:g} | {variants} | {min(vals):.3f} | {statistics.median(vals):.3f} | "
                   f"{max(vals):.3f} | {low['value'] - thr:+.3f} | {_variant(low)} |")
        below += [f"{test} {metric} {r['value']:.3f} < {thr:g} at {_variant(r)}" for r in rs if r["value"] < thr]
    if below:
        out += ["", "Below the threshold:", *[f"- {b}" for b in below]]
    return "\n".join(out)


def _variant(r: dict) -> str:
    return f"{r['cpu'] or 'native'}/{r['threads'] or '-'}t/seed {r['seed'] or 'default'}"


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "outputs/learning-margins/margins.jsonl"
    with open(path) as f:
        print(table([json.loads(x) for x in f if x.strip()]))

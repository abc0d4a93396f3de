"""rows.jsonl → the markdown table of docs/algorithms.md ("Async rollouts"):

    python bench/results/2026-12-02-async-hybrid/table.py bench/results/2026-12-02-async-hybrid/rows.jsonl
"""
import json
import sys

rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
by = {(r["algo"], r["async_steps"]): r for r in rows}
print("| algo | final fifth, sync | final fifth, async | async − sync | gain, sync | gain, async | "
      "async/generate_s | async/overlap_s | step s, sync | step s, async |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for algo in dict.fromkeys(r["algo"] for r in rows):
    a, b = by.get((algo, 0)), by.get((algo, 1))
    if a is None or b is None:
        continue
    name = algo + (" (dynamic_sampling off)" if b["extra"] else "")
    print(f"| {name} | {a['final_fifth']:.3f} | {b['final_fifth']:.3f} | {b['final_fifth'] - a['final_fifth']:+.3f} | "
          f"{a['gain']:.3f} | {b['gain']:.3f} | {b['async_generate_s']:.3f} | {b['overlap_s']:.3f} | "
          f"{a['step_s']:.2f} | {b['step_s']:.2f} |")

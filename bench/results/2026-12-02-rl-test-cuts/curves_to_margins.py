"""The rows tests/helpers.py:record_learning would write (test, metric, value, threshold, seed, cpu,
threads) for the test runs that curves.jsonl holds, read at the step count each test runs; then
scripts/margins_table.py makes the table. Also prints, per run, the last-5 mean at other lengths.

    python bench/results/2026-12-02-rl-test-cuts/curves_to_margins.py curves.jsonl 'ppo-p16:120' ... > margins.jsonl
"""
import json
import sys

curves = [json.loads(x) for x in open(sys.argv[1])]
want = dict(a.split(":") for a in sys.argv[2:])  # label -> steps the test runs
for c in curves:
    if c["label"] not in want or c["code"] != 0:
        continue
    k, r = int(want[c["label"]]), c["reward"]
    if len(r) < k:
        continue
    algo = c["label"].split("-")[0]
    last, first = sum(r[k - 5:k]) / 5, sum(r[:5]) / 5
    assert first < 0.2, c["label"]
    metric = "reward, last 5 steps" + (f" ({k} steps)" if k != 120 else "")
    print(json.dumps({"test": f"rl/{algo}", "metric": metric, "value": round(last, 4), "threshold": 0.8,
                      "seed": c["seed"], "cpu": c["cap"], "threads": "1"}))
    print(c["label"], c["cap"], c["seed"], " ".join(f"{j}:{sum(r[j - 5:j]) / 5:.3f}" for j in range(100, len(r) + 1, 10)),
          file=sys.stderr)

"""Per-step table of a GRPO run's metrics.jsonl (phase times, weight sync, memory, mismatch).

    python -m bench.grpo_report outputs/run/metrics.jsonl hybrid
"""

from __future__ import annotations

import json
import statistics
import sys

from bench.checks import record, write_json_out

COLS = [
    ("time/step", "step s", "{:.2f}"),
    ("time/generate", "gen", "{:.2f}"),
    ("time/reward", "rew", "{:.2f}"),
    ("time/to_train", "to_train", "{:.2f}"),
    ("time/reference", "ref", "{:.2f}"),
    ("time/old_logp", "old_lp", "{:.2f}"),
    ("time/update", "update", "{:.2f}"),
    ("time/sync", "sync", "{:.2f}"),
    ("sync/seconds", "xfer s", "{:.3f}"),
    ("sync/gbps", "GB/s", "{:.1f}"),
    ("mismatch/logp_abs_mean", "|dlogp|", "{:.4f}"),
    ("memory/vllm_freed_fraction", "freed", "{:.3f}"),
    ("memory/vllm_freed_gib", "freed GiB", "{:.1f}"),
    ("memory/train_peak_reserved_gib", "train GiB", "{:.1f}"),
    ("reward/mean", "reward", "{:.3f}"),
]


def main() -> None:
    path, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "run")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        print("no steps in", path)
        return
    print(f"\nGRPO {mode}: {len(rows)} steps ({path})")
    print("step " + " ".join(f"{h:>9}" for _, h, _ in COLS))
    for r in rows:
        cells = [(f.format(r[k]) if k in r else "-") for k, _, f in COLS]
        print(f"{r['step']:>4} " + " ".join(f"{c:>9}" for c in cells))
    steady = rows[1:] or rows  # the first step includes warm-up (graph capture, allocator growth)
    summary = {k: statistics.median([r[k] for r in steady if k in r]) for k, _, _ in COLS
               if any(k in r for r in steady)}
    summary["mismatch/logp_abs_mean_max"] = max((r.get("mismatch/logp_abs_mean", 0.0) for r in rows), default=0.0)
    summary["memory/vllm_freed_fraction_min"] = min((r.get("memory/vllm_freed_fraction", 1.0) for r in rows), default=1.0)
    summary["steps"] = len(rows)
    print("median of steps 2..: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items()))
    record(f"grpo_{mode}", **summary)
    write_json_out(f"bench_grpo_{mode}.json", {"mode": mode, "summary": summary, "steps": rows})


if __name__ == "__main__":
    main()

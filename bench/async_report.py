"""Hybrid placement with and without async rollouts on one GPU (scripts/async_gpu.sh's two runs).

    python -m bench.async_report /tmp/rlhf-gpu/runs/grpo-hybrid-async0 /tmp/rlhf-gpu/runs/grpo-hybrid-async1

For each run dir: the median over steps 2.. of the step and its phases (for ``time/generate`` also
each of those steps' figure and their mean), the async figures
(``async/overlap_s``: the part of the prefetched generation hidden behind the update), the plan's
phase figures and the larger of them (``<dir>.plan.txt``, what ``--plan`` printed) against the GPU's measured peak
(``<dir>.smi``: nvidia-smi's memory.used in MiB every 0.5 s, every process on the GPU), and the
async run's step time as a share of the synchronous one's. Each run is one ``RESULT`` row.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from bench.checks import record, write_json_out

KEYS = ("time/step", "time/generate", "time/reward", "time/to_train", "time/reference", "time/old_logp",
        "time/update", "time/sync", "async/generate_s", "async/overlap_s", "async/staleness",
        "actor/tis_weight_mean", "mismatch/logp_abs_mean", "reward/mean")


def planned_gb(plan: Path) -> dict[str, float]:
    """The plan's per-GPU figures (``name: = X of M``), GB."""
    out = {}
    for line in plan.read_text().splitlines() if plan.exists() else []:
        m = re.match(r"\s+(training phase|generation phase):.*= (\d+\.\d) of", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def measured_peak_gb(smi: Path) -> float | None:
    """The largest memory.used nvidia-smi sampled (MiB → GB)."""
    vals = [float(x) for x in smi.read_text().split() if x.strip()] if smi.exists() else []
    return max(vals) * 2**20 / 1e9 if vals else None


def summary(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "metrics.jsonl").exists() else []
    steady = rows[1:] or rows  # step 1 holds the warm-up (graph capture, allocator growth)
    out: dict = {"steps": len(rows)}
    for k in KEYS:
        vals = [r[k] for r in steady if k in r]
        if vals:
            out[k] = statistics.median(vals)
    # how steady the phase that the engine comparisons rest on was: every step's figure and their mean
    gen = [r["time/generate"] for r in steady if "time/generate" in r]
    if gen:
        out["time/generate_steps"] = gen
        out["time/generate_mean"] = statistics.fmean(gen)
    plan = planned_gb(Path(f"{run}.plan.txt"))
    out["plan_training_phase_gb"] = plan.get("training phase")
    out["plan_generation_phase_gb"] = plan.get("generation phase")
    # the GPU's peak is the larger phase: generation without async (vLLM awake, states resident or
    # not), the training phase with it (the update beside the awake engine)
    out["plan_peak_gb"] = max(plan.values()) if plan else None
    out["measured_peak_gb"] = measured_peak_gb(Path(f"{run}.smi"))
    if out["measured_peak_gb"] and out["plan_peak_gb"]:
        out["plan_minus_measured_gb"] = out["plan_peak_gb"] - out["measured_peak_gb"]
    return out


def _shown(k: str, v) -> str:
    if isinstance(v, float):
        return f"{k}={v:.4g}"
    if isinstance(v, list):
        return f"{k}=[" + ", ".join(f"{x:.3g}" for x in v) + "]"
    return f"{k}={v}"


def summarize_runs(runs: list[Path], prefix: str) -> tuple[dict, bool]:
    """``summary`` of each run dir, printed and recorded as ``<prefix>_<name>``; ok: every run has steps."""
    results = {}
    for run in runs:
        s = summary(run)
        results[run.name] = s
        print(f"{run.name}: " + ", ".join(_shown(k, v) for k, v in s.items()))
        record(f"{prefix}_{run.name}", **s)
    return results, bool(results) and all(s["steps"] > 0 for s in results.values())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runs = [Path(a) for a in argv]
    results, ok = summarize_runs(runs, "async_hybrid")
    if len(runs) == 2 and ok:
        a, b = (results[r.name] for r in runs)
        if "time/step" in a and "time/step" in b:
            ratio = b["time/step"] / a["time/step"]
            print(f"step time, async / sync: {ratio:.3f} ({b['time/step']:.2f} s against {a['time/step']:.2f} s)")
            record("async_hybrid_ratio", step_ratio=ratio, sync_step_s=a["time/step"], async_step_s=b["time/step"])
    write_json_out("bench_async_hybrid.json", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One rollout engine per GPU against two (scripts/engines_gpu.sh's runs, ``placement.rollout.engines_per_device``).

    python -m bench.engines_report /tmp/rlhf-gpu/runs/engines-qwen2.5-0.5b-e1 /tmp/rlhf-gpu/runs/engines-qwen2.5-0.5b-e2 [...]

For each run dir the figures of ``bench.async_report.summary`` (medians over steps 2.. of the step,
its phases and ``mismatch/logp_abs_mean``; the plan's phase figures against the GPU's measured peak),
one ``RESULT`` row each; then each later run against the first: its generation speed-up
(``time/generate`` of the first / of it: the acceptance of issue 33 item 2 is ≥ 1.5; also by the
means, and the first run's fastest step against the median, which say how robust it is), its step
time ratio, and its mismatch as a share of the first's (≈ 1: the same bf16 agreement).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.async_report import summarize_runs
from bench.checks import record, write_json_out


def compare(a: dict, b: dict) -> dict:
    """The second run against the first: generation speed-up, step ratio, mismatch ratio (what both have)."""
    out: dict = {}
    if a.get("time/generate") and b.get("time/generate"):
        out["generate_speedup"] = a["time/generate"] / b["time/generate"]
        if a.get("time/generate_mean") and b.get("time/generate_mean"):
            out["generate_speedup_mean"] = a["time/generate_mean"] / b["time/generate_mean"]
        if a.get("time/generate_steps"):  # the first run at its fastest step against the second's median
            out["generate_speedup_first_best"] = min(a["time/generate_steps"]) / b["time/generate"]
    if a.get("time/step") and b.get("time/step"):
        out["step_ratio"] = b["time/step"] / a["time/step"]
    if a.get("mismatch/logp_abs_mean") and b.get("mismatch/logp_abs_mean") is not None:
        out["mismatch_ratio"] = b["mismatch/logp_abs_mean"] / a["mismatch/logp_abs_mean"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runs = [Path(a) for a in argv]
    results, ok = summarize_runs(runs, "engines_per_device")
    if len(runs) >= 2 and ok:
        a = results[runs[0].name]
        for run in runs[1:]:
            c = compare(a, results[run.name])
            results["compare" if len(runs) == 2 else f"compare_{run.name}"] = c
            print(f"{run.name} against {runs[0].name}: " + ", ".join(f"{k}={v:.3f}" for k, v in c.items()))
            record(f"engines_per_device_{run.name}_vs_{runs[0].name}", **c)
    write_json_out("bench_engines_per_device.json", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

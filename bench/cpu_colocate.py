"""CPU hybrid runs: one process per device (the default) vs one process per role.

    .venv/bin/python -m bench.cpu_colocate --steps 10 --repeats 2

Each trial starts a fresh local Ray, runs GRPO on the built-in task (tiny model) for ``--steps``
steps in-process, and shuts Ray down; the modes alternate so that drifting machine load hits
both. Reported per mode: the median wall time of the run (cluster start included). The per-role
mode is the launcher with ``can_colocate`` patched to False: the same code as GPU placement.

Measured 2026-11-30 on the 2-core CPU machine (10 steps, 2 trials per mode): 25.8 s per device vs
50.7 s per role, 1.97x.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def trial(colocate: bool, steps: int, out: str) -> float:
    import ray

    import rlhf.launch.cluster as cluster
    from rlhf.cli import build_spec, compose
    from rlhf.run import run

    cluster.can_colocate = (lambda spec, _orig=trial.orig: _orig(spec)) if colocate else (lambda spec: False)
    overrides = [f"train.steps={steps}", f"output_dir={out}", "tracking.console=plain"]
    spec = build_spec(compose(overrides), overrides, plan=False)
    t0 = time.perf_counter()
    code = run(spec)
    wall = time.perf_counter() - t0
    if ray.is_initialized():
        ray.shutdown()
    if code != 0:
        raise SystemExit(f"run failed with exit code {code}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import rlhf.launch.cluster as cluster

    trial.orig = cluster.can_colocate
    results: dict[str, list[float]] = {"process per device": [], "process per role": []}
    with tempfile.TemporaryDirectory() as tmp:
        trial(True, 1, f"{tmp}/warm")  # builds the tiny model and data once; not counted
        for r in range(args.repeats):
            for colocate in (True, False) if r % 2 == 0 else (False, True):
                name = "process per device" if colocate else "process per role"
                results[name].append(trial(colocate, args.steps, f"{tmp}/{name.replace(' ', '_')}_{r}"))
    print(f"\nGRPO, builtin tiny task, {args.steps} steps, {args.repeats} trials per mode (median)")
    print(f"{'mode':<20} {'wall s':>8}")
    med = {name: statistics.median(rows) for name, rows in results.items()}
    for name, wall in med.items():
        print(f"{name:<20} {wall:8.1f}")
    print(f"ratio per-role / per-device: {med['process per role'] / med['process per device']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

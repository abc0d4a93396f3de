"""CPU hybrid runs: one process per device (the default) vs one process per role.

    .venv/bin/python -m bench.cpu_colocate --steps 10 --repeats 2

Each trial starts a fresh local Ray, runs GRPO on the built-in task (tiny model) for ``--steps``
steps in-process, and shuts Ray down; the modes alternate so that drifting machine load hits
both. Reported per mode: wall time of the run, and CPU seconds of the whole process tree (driver,
Ray's daemons and every worker, read from ``getrusage`` once Ray's processes have exited), which
is what a 2-core machine pays. The per-role mode is the launcher with ``can_colocate`` patched
to False: the same code as GPU placement.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time


def cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def trial(colocate: bool, steps: int, out: str) -> tuple[float, float]:
    import ray

    import rlhf.launch.cluster as cluster
    from rlhf.cli import build_spec, compose
    from rlhf.run import run

    cluster.can_colocate = (lambda spec, _orig=trial.orig: _orig(spec)) if colocate else (lambda spec: False)
    overrides = [f"train.steps={steps}", f"output_dir={out}", "tracking.console=plain"]
    spec = build_spec(compose(overrides), overrides, plan=False)
    c0, t0 = cpu_seconds(), time.perf_counter()
    code = run(spec)
    wall = time.perf_counter() - t0
    if ray.is_initialized():
        ray.shutdown()
    time.sleep(2)  # let Ray's daemons exit and be reaped, so their CPU time is counted
    if code != 0:
        raise SystemExit(f"run failed with exit code {code}")
    return wall, cpu_seconds() - c0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import rlhf.launch.cluster as cluster

    trial.orig = cluster.can_colocate
    results: dict[str, list[tuple[float, float]]] = {"process per device": [], "process per role": []}
    with tempfile.TemporaryDirectory() as tmp:
        trial(True, 1, f"{tmp}/warm")  # builds the tiny model and data once; not counted
        for r in range(args.repeats):
            for colocate in (True, False) if r % 2 == 0 else (False, True):
                name = "process per device" if colocate else "process per role"
                results[name].append(trial(colocate, args.steps, f"{tmp}/{name.replace(' ', '_')}_{r}"))
    print(f"\nGRPO, builtin tiny task, {args.steps} steps, {args.repeats} trials per mode (median)")
    print(f"{'mode':<20} {'wall s':>8} {'cpu s':>8}")
    med = {}
    for name, rows in results.items():
        med[name] = (statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows))
        print(f"{name:<20} {med[name][0]:8.1f} {med[name][1]:8.1f}")
    a, b = med["process per device"], med["process per role"]
    print(f"ratio per-role / per-device: wall {b[0] / a[0]:.2f}x, cpu {b[1] / a[1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

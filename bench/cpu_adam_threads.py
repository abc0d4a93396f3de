"""DeepSpeed's CPU Adam step in a process that starts as Ray starts a GPU worker (OMP_NUM_THREADS=1),
with and without what ``rlhf.workers.base.Worker`` does for a worker that steps an offloaded
optimizer (``host_optimizer_threads``: the variable and torch's thread count set before the op loads).
Each side in its own fresh process, both in one run:

    python -m bench.cpu_adam_threads                 # 50M parameters, 5 timed steps a side
    python -m bench.cpu_adam_threads --params 2e8 --threads 8

The first call builds the op (a minute, cached by torch's extension cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _side(params: int, steps: int, threads: int) -> dict:
    """One side, in this (fresh) process: threads > 0 applies the worker's setting first."""
    import torch

    from rlhf.workers.base import use_cpu_threads

    if threads > 0:  # what Worker.__init__ does
        use_cpu_threads(threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True)
    opt.step()  # the first step allocates the moments
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    import ctypes

    omp = ctypes.CDLL("libgomp.so.1").omp_get_max_threads()
    return {"threads_set": threads, "omp_max_threads": omp, "torch_threads": torch.get_num_threads(),
            "step_s": (time.perf_counter() - t) / steps, "params": params}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="the worker's setting (default: this machine's cores)")
    ap.add_argument("--side", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help="also write the result here (JSON)")
    a = ap.parse_args(argv)
    if a.side is not None:
        print(json.dumps(_side(int(a.params), a.steps, a.side)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    rows = []
    for threads in (0, a.threads):  # 0: as Ray leaves it
        cmd = [sys.executable, "-m", "bench.cpu_adam_threads", "--side", str(threads), "--params", str(a.params),
               "--steps", str(a.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base, fixed = rows
    result = {"ray_default": base, "worker_setting": fixed, "speedup": base["step_s"] / fixed["step_s"],
              "steps": a.steps}
    print(f"CPU Adam, {int(a.params):,} parameters: OMP_NUM_THREADS=1 (Ray's) {base['step_s'] * 1e3:.1f} ms/step "
          f"(OpenMP threads {base['omp_max_threads']}); the worker's setting {fixed['step_s'] * 1e3:.1f} ms/step "
          f"(OpenMP threads {fixed['omp_max_threads']}); {result['speedup']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

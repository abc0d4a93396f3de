"""Reward curves behind the step / batch choices of tests/rl (docs/learning-margins.md, twelfth
session). Each run is what the tests run (tests.helpers.run_rl under the Ray settings of
tests/conftest.py's rl_env); every step's metrics are kept, so one run of N steps gives the value a
test of k <= N steps asserts (the RL learning rate is constant after warm-up and each step's prompts
and sampling seeds depend on the step alone; checked against the pytest runs' recorded values).
From the repository root:

    ATEN_CPU_CAPABILITY=default PYTHONPATH=$PWD python bench/results/2026-12-02-rl-test-cuts/run_curves.py \
        TAG ALGOS SEEDS OVERRIDE...      # e.g. p16 ppo,grpo 0,1,2 tracking=none train.prompts_per_step=16

Appends one line per run to $OUT/curves.jsonl: label, seed, kernel path, overrides, every step's
reward/mean, per algorithm (and the extra keys named in $KEYS, comma-separated).
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import ray  # noqa: E402

from rlhf.launch.group import REPO_ROOT  # noqa: E402

ROOT = os.environ.get("OUT", "outputs/rl-test-cuts")
cache = os.environ.setdefault("RLHF_CACHE", os.path.abspath(f"{ROOT}/cache"))
os.environ.setdefault("RLHF_TRACKING_DIR", os.path.abspath(f"{ROOT}/tracking"))
ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"RLHF_CACHE": cache, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}},
         _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
from tests.helpers import run_rl  # noqa: E402

tag, algos, seeds, extra = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4:]
keys = [k for k in os.environ.get("KEYS", "").split(",") if k]
cap = os.environ.get("ATEN_CPU_CAPABILITY", "native")
for seed, algo in [(s, a) for s in seeds for a in algos]:
    label, overrides = f"{algo}-{tag}", [f"algo={algo}", *extra]
    out = Path(f"{ROOT}/runs/{cap}/{label}-s{seed}")
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.environ["RLHF_TEST_SEED"] = seed
    t = time.time()
    code, rows = run_rl(list(overrides), out)
    line = {"label": label, "seed": seed, "cap": cap, "overrides": overrides, "code": code,
            "secs": round(time.time() - t, 1), "reward": [round(r["reward/mean"], 5) for r in rows],
            **{k: [r.get(k) for r in rows] for k in keys}}
    r = line["reward"]
    print(label, seed, cap, code, line["secs"], "first5", round(sum(r[:5]) / 5, 3),
          {k: round(sum(r[k - 5:k]) / 5, 3) for k in range(40, len(r) + 1, 10)}, flush=True)
    with open(f"{ROOT}/curves.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")

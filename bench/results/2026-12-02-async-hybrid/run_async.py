"""The runs behind rows.jsonl: every RL algorithm preset at the tiny defaults (CPU, hybrid placement,
the HF engine), once with algo.async_steps=0 and once with algo.async_steps=1, same seed, same
algo.tis_cap=2.0 in both (async needs it; on-policy it weighs every token ~1), so the only difference
is that the batch of step t+1 is sampled during step t's update with the policy before it. DAPO runs
with algo.dynamic_sampling=false in both (async does not support it). Each run is tests.helpers.run_rl
(the Ray settings of tests/conftest.py's rl_env). From the repository root:

    PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-02-async-hybrid/run_async.py grpo,ppo 60 1

One line per run: the reward's first and final fifth, the gain, the step time and the async metrics'
means, and the whole reward curve.
"""
import json, os, sys, time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import ray
from rlhf.launch.group import REPO_ROOT

ROOT = os.environ.get("OUT", "outputs/async-hybrid")
cache = os.environ.setdefault("RLHF_CACHE", os.path.abspath(f"{ROOT}/cache"))
os.environ.setdefault("RLHF_TRACKING_DIR", os.path.abspath(f"{ROOT}/tracking"))
ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"RLHF_CACHE": cache, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}})
from tests.helpers import fifth_means, run_rl

algos = sys.argv[1].split(",")
steps = int(sys.argv[2])
seed = sys.argv[3]
out_file = os.environ.get("ROWS", f"{ROOT}/rows.jsonl")


def mean(rows, key, skip=0):
    vals = [r[key] for r in rows[skip:] if key in r]
    return round(sum(vals) / len(vals), 4) if vals else None


for algo in algos:
    for k in map(int, os.environ.get("ARMS", "0,1").split(",")):  # ARMS=1: the async run alone
        extra = ["algo.dynamic_sampling=false"] if algo == "dapo" else []
        out = Path(f"{ROOT}/runs/{algo}-a{k}-s{seed}")
        if out.exists():
            import shutil; shutil.rmtree(out)
        t = time.time()
        code, rows = run_rl([f"algo={algo}", "tracking=none", f"train.steps={steps}", f"train.seed={seed}",
                             "algo.tis_cap=2.0", f"algo.async_steps={k}", *extra], out)
        first, last = fifth_means(rows) if rows else (float("nan"), float("nan"))
        line = {"algo": algo, "async_steps": k, "seed": int(seed), "steps": steps, "extra": extra, "code": code,
                "secs": round(time.time() - t, 1), "first_fifth": round(first, 4), "final_fifth": round(last, 4),
                "gain": round(last - first, 4), "step_s": mean(rows, "time/step", 1),
                "generate_s": mean(rows, "time/generate", 1), "update_s": mean(rows, "time/update", 1),
                "async_generate_s": mean(rows, "async/generate_s", 1), "overlap_s": mean(rows, "async/overlap_s", 1),
                "staleness": mean(rows, "async/staleness", 1),
                "tis_weight_mean": mean(rows, "actor/tis_weight_mean"),
                "reward": [round(r["reward/mean"], 4) for r in rows]}
        print(json.dumps({k2: v for k2, v in line.items() if k2 != "reward"}), flush=True)
        with open(out_file, "a") as f:
            f.write(json.dumps(line) + "\n")

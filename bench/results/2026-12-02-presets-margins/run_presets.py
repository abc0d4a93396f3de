"""The runs behind curves.jsonl and the 1-thread rows of margins.jsonl: each is the run of
tests/rl/test_rl_learning.py (tests.helpers.run_rl, the Ray settings of tests/conftest.py's rl_env), so
it gives the test's numbers (checked: the pytest runs recorded the same values), kept with its
metrics.jsonl to read the reward at any step. From the repository root:

    ATEN_CPU_CAPABILITY=default PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-02-presets-margins/run_presets.py gspo,cispo,sapo 0,1,2
    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-02-presets-margins/run_presets.py dapo 0,1,2 train.steps=200
"""
import json, os, sys, time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import ray
from rlhf.launch.group import REPO_ROOT

ROOT = os.environ.get("OUT", "outputs/presets-curves")
cache = os.environ.setdefault("RLHF_CACHE", os.path.abspath(f"{ROOT}/cache"))
os.environ.setdefault("RLHF_TRACKING_DIR", os.path.abspath(f"{ROOT}/tracking"))
ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"RLHF_CACHE": cache, "OMP_NUM_THREADS": "1",
                                   "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}})
from tests.helpers import run_rl

algos = sys.argv[1].split(",")
seeds = sys.argv[2].split(",")
extra = sys.argv[3:]
tag = f"{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}-{os.environ.get('RLHF_CPU_THREADS', '1')}t"
for seed in seeds:
    for algo in algos:
        out = Path(f"{ROOT}/runs/{tag}/{algo}-s{seed}{'-' + '_'.join(extra).replace('=', '-') if extra else ''}")
        if (out / "metrics.jsonl").exists():
            import shutil; shutil.rmtree(out)
        os.environ["RLHF_TEST_SEED"] = seed
        t = time.time()
        code, rows = run_rl([f"algo={algo}", "tracking=none", *extra], out)
        dt = time.time() - t
        r = [x["reward/mean"] for x in rows]
        def last5(k): return sum(r[k-5:k]) / 5 if len(r) >= k else float("nan")
        line = {"algo": algo, "seed": seed, "tag": tag, "extra": extra, "code": code, "secs": round(dt, 1), "first5": round(sum(r[:5]) / 5, 4),
                **{f"at{k}": round(last5(k), 4) for k in (40, 60, 80, 90, 100, 110, 120, 140, 160, 180, 200)}}
        if "data/sampling_rounds" in (rows[0] if rows else {}):
            line["rounds_mean"] = round(sum(x["data/sampling_rounds"] for x in rows) / len(rows), 2)
            line["filled_last"] = rows[-1]["data/filled_groups"]
        print(json.dumps(line), flush=True)
        with open(f"{ROOT}/curves.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

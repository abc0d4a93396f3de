"""Long-run memory check: many toy RL steps, driver and worker RSS sampled as it goes.

    .venv/bin/python bench/longrun.py --steps 500 --out /tmp/longrun      # ~CPU, toy size

Runs ``rlhf.run.run`` in-process (GRPO on the built-in task, tiny model, prompts_per_step 4,
group 2, 1-token responses, tracking on) while a thread samples every ``--every`` seconds the RSS
of the driver and of each Ray worker process (``ray::`` processes that descend from this one) and
the number of finished steps (lines of metrics.jsonl). Writes ``rss.jsonl`` and ``summary.json``
into ``--out``: RSS of each process at 10% of the run (after warm-up) and at the end, and the
growth between. ``--max-growth-mb`` makes the exit code 1 when a process grew more than that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def ray_workers(root: int) -> dict[int, str]:
    """pid -> title of every ``ray::`` process below ``root``."""
    import psutil

    out = {}
    try:
        for p in psutil.Process(root).children(recursive=True):
            try:
                title = " ".join(p.cmdline())[:80]
            except psutil.Error:
                continue
            if title.startswith("ray::"):
                out[p.pid] = title
    except psutil.Error:
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default="/tmp/rlhf_longrun")
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--max-growth-mb", type=float, default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "outputs" / "run"
    overrides = ["algo=grpo", f"train.steps={args.steps}", "train.prompts_per_step=4", "algo.group_size=2",
                 "train.micro_batch_size=8", "rollout.max_response_tokens=1", "tracking.console=none",
                 f"output_dir={run_dir}"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlhf.cli import build_spec, compose
    from rlhf.run import run

    spec = build_spec(compose(overrides), overrides, plan=False)
    samples: list[dict] = []
    done = threading.Event()
    me = os.getpid()

    def sample() -> None:
        with open(out / "rss.jsonl", "w") as f:
            while not done.is_set():
                metrics = run_dir / "metrics.jsonl"
                steps = sum(1 for _ in open(metrics)) if metrics.exists() else 0
                row = {"t": time.time(), "steps": steps, "driver": rss_mb(me),
                       "workers": {str(p): [t, rss_mb(p)] for p, t in ray_workers(me).items()}}
                samples.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                done.wait(args.every)

    th = threading.Thread(target=sample, daemon=True)
    t0 = time.time()
    th.start()
    code = run(spec)
    done.set()
    th.join()
    wall = time.time() - t0
    ran = [s for s in samples if s["steps"] > 0]
    warm = [s for s in ran if s["steps"] >= max(1, args.steps // 10)]
    summary: dict = {"command": " ".join(sys.argv), "exit_code": code, "steps": args.steps,
                     "wall_s": round(wall, 1), "samples": len(samples)}
    if warm:
        a, b = warm[0], ([s for s in warm if s["workers"]] or warm)[-1]  # the last sample before shutdown
        summary["from_step"], summary["to_step"] = a["steps"], b["steps"]
        procs = {"driver": (a["driver"], b["driver"])}
        for pid, (title, r) in b["workers"].items():
            if pid in a["workers"]:
                procs[f"{title.split()[0]} ({pid})"] = (a["workers"][pid][1], r)
        summary["rss_mb"] = {k: {"at_from": round(x, 1), "at_end": round(y, 1), "growth": round(y - x, 1),
                                 "peak": round(max([s["driver"] if k == "driver" else
                                                    s["workers"].get(k.split("(")[-1].rstrip(")"), [0, 0])[1]
                                                    for s in warm]), 1)}
                             for k, (x, y) in procs.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if code != 0:
        return code
    if args.max_growth_mb is not None and any(v["growth"] > args.max_growth_mb for v in summary.get("rss_mb", {}).values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

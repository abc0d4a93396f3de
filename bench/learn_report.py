"""Held-out reward after SFT against after GRPO / PPO (scripts/learn_gpu.sh's runs).

    python -m bench.learn_report /tmp/rlhf-gpu/learn --margin 0.10

Reads each run's metrics.jsonl: the SFT model's held-out sampled and greedy rewards (``eval_before/...``:
the RL runs evaluate their starting policy before the first step), the RL runs' last held-out rewards, their reward
curves and the trainer-vs-vLLM log-prob mismatch over the run. Exit 1 when an RL run does not beat
the SFT model's held-out sampled reward by ``--margin`` (stated before the run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the criterion: held-out reward of responses sampled at the rollout temperature (what RL raises); an
# SFT model on this task's demonstrations can already be right under greedy decoding while its
# sampled responses are mostly wrong, so greedy is printed beside it but decides nothing
KEY = "eval/sampled/reward_mean"
GREEDY = "eval/greedy/reward_mean"


def rows(path: Path) -> list[dict]:
    f = path / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def last(rs: list[dict], key: str):
    vals = [r[key] for r in rs if key in r]
    return vals[-1] if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--margin", type=float, default=0.10)
    a = ap.parse_args(argv)
    d = Path(a.dir)
    ok = True
    for run in ("grpo", "ppo"):
        rs = rows(d / run)
        base = last(rs, KEY.replace("eval/", "eval_before/"))
        print(f"{run}: held-out sampled reward of the SFT model (before the first step): {base} "
              f"(greedy {last(rs, GREEDY.replace('eval/', 'eval_before/'))})")
        final = last(rs, KEY)
        mm = [r["mismatch/logp_abs_mean"] for r in rs if "mismatch/logp_abs_mean" in r]
        curve = [(r["step"], round(r[KEY], 3)) for r in rs if KEY in r]
        passed = final is not None and base is not None and final >= base + a.margin
        ok = ok and passed
        print(f"{run}: {len(rs)} steps, held-out sampled reward {final} (greedy {last(rs, GREEDY)}) ({'≥' if passed else '<'} SFT + {a.margin}), "
              f"curve {curve}, train reward first {rs[0]['reward/mean'] if rs else None:} last "
              f"{rs[-1]['reward/mean'] if rs else None}, mismatch mean {sum(mm) / len(mm) if mm else None} "
              f"max {max(mm) if mm else None}")
    print("RESULT " + json.dumps({"name": "learn_gpu", "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The agentic GPU recipe's report (scripts/agent_gpu.sh's runs under one directory).

    python -m bench.agent_report /tmp/rlhf-gpu/agent --margin 0.10 [--json summary.json]

Reads ``<dir>/{sft,lookup,notools,slow}/metrics.jsonl``:

* learning: the lookup run's held-out reward of sampled responses before its first step (the SFT
  model, ``eval_before/sampled/reward_mean``) and after its last (``eval/sampled/reward_mean``),
  greedy beside it (it decides nothing), the training reward's curve; the margin is stated before
  the run (``--margin``);
* step time: seconds per step (``time/step``, which leaves evaluation out) and of its generate phase,
  the median over steps ``--from``..``--to`` (default 2..6: the first step pays one-time costs),
  for the tool run, the no-tool run (the same prompts offering no tool: one turn) and the run whose
  tool is slow on 1 call in N; with the agent metrics over the same steps (turns, tool calls, tool
  errors, latency p50/p99, truncated).

Exit 1 when the lookup run misses the margin or did not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

KEY = "eval/sampled/reward_mean"
GREEDY = "eval/greedy/reward_mean"
RUNS = ("lookup", "notools", "slow")
AGENT_KEYS = ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_error_frac", "agent/tool_latency_p50",
              "agent/tool_latency_p99", "agent/truncated_frac", "agent/total_tokens_mean", "agent/wall_s_max")


def rows(path: Path) -> list[dict]:
    f = path / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def last(rs: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rs if key in r]
    return vals[-1] if vals else None


def _median(rs: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rs if key in r]
    return round(statistics.median(vals), 4) if vals else None


def timing(rs: list[dict], lo: int, hi: int) -> dict:
    """Medians over steps lo..hi (1-based, as logged)."""
    window = [r for r in rs if lo <= r.get("step", 0) <= hi]
    out = {"steps": [r["step"] for r in window], "s_per_step": _median(window, "time/step"),
           "generate_s": _median(window, "time/generate"), "update_s": _median(window, "time/update"),
           "reward_mean": _median(window, "reward/mean")}
    out.update({k.split("/", 1)[1]: _median(window, k) for k in AGENT_KEYS})
    return out


def report(d: Path, margin: float, lo: int = 2, hi: int = 6) -> dict:
    look = rows(d / "lookup")
    before = last(look, KEY.replace("eval/", "eval_before/"))
    after = last(look, KEY)
    learning = {
        "sampled_before": before, "sampled_after": after,
        "gain": None if before is None or after is None else round(after - before, 4), "margin": margin,
        "greedy_before": last(look, GREEDY.replace("eval/", "eval_before/")), "greedy_after": last(look, GREEDY),
        "curve": [(r["step"], round(r[KEY], 3)) for r in look if KEY in r],
        "train_reward": [round(r["reward/mean"], 3) for r in look],
        "steps": len(look),
        "s_per_step_all": _median([r for r in look if r.get("step", 0) >= lo], "time/step"),
    }
    # vLLM's sampled-token log-probs against the trainer's on the same ids: the multi-turn sequences
    # the trainer scores are the ones the engine sampled (a re-tokenised seam would show here)
    mm = [r["mismatch/logp_abs_mean"] for r in look if "mismatch/logp_abs_mean" in r]
    learning["mismatch_mean"] = round(sum(mm) / len(mm), 6) if mm else None
    learning["mismatch_max_step"] = round(max(mm), 6) if mm else None
    learning["passed"] = learning["gain"] is not None and learning["gain"] >= margin
    sft = rows(d / "sft")
    losses = [r["eval/loss"] for r in sft if "eval/loss" in r]
    return {
        "learning": learning,
        "sft": {"steps": sum(1 for r in sft if "train/loss" in r), "eval_loss_first": losses[0] if losses else None,
                "eval_loss_last": losses[-1] if losses else None},
        "timing": {run: timing(rows(d / run), lo, hi) for run in RUNS},
        "window": [lo, hi],
    }


def brief(run_dir: Path) -> str:
    """One line on a run as soon as it ends: steps, s/step, held-out reward before → after."""
    rs = rows(run_dir)
    if not rs:
        return f"{run_dir.name}: no metrics"
    line = f"{run_dir.name}: {len(rs)} rows"
    if any("time/step" in r for r in rs):
        line += (f", s/step median {_median([r for r in rs if r.get('step', 0) >= 2], 'time/step')} "
                 f"(step 1: {rs[0].get('time/step', 0):.2f}), generate {_median(rs, 'time/generate')} s, "
                 f"training reward {rs[0].get('reward/mean', 0):.3f} → {rs[-1].get('reward/mean', 0):.3f}, "
                 f"tool calls {_median(rs, 'agent/tool_calls_mean')}, latency p99 {_median(rs, 'agent/tool_latency_p99')} s")
    b, a = last(rs, KEY.replace("eval/", "eval_before/")), last(rs, KEY)
    if b is not None or a is not None:
        line += f", held-out sampled {b} → {a} (greedy {last(rs, GREEDY.replace('eval/', 'eval_before/'))} → {last(rs, GREEDY)})"
    losses = [r["eval/loss"] for r in rs if "eval/loss" in r]
    if losses:
        line += f", held-out loss {losses[0]:.3f} → {losses[-1]:.3f}"
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--brief", action="store_true", help="one line on the run in dir (as a stage ends)")
    ap.add_argument("--margin", type=float, default=0.10)
    ap.add_argument("--from", dest="lo", type=int, default=2)
    ap.add_argument("--to", dest="hi", type=int, default=6)
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--stages", default="", help="the script's stage exit codes, recorded as given")
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--elapsed", type=float, default=None)
    a = ap.parse_args(argv)
    if a.brief:
        print(brief(Path(a.dir)))
        return 0
    out = report(Path(a.dir), a.margin, a.lo, a.hi)
    out["stages"] = dict(s.split("=", 1) for s in a.stages.split() if "=" in s)
    out["budget_s"], out["elapsed_s"] = a.budget, a.elapsed
    L = out["learning"]
    print(f"SFT: {out['sft']['steps']} steps, held-out loss {out['sft']['eval_loss_first']} -> "
          f"{out['sft']['eval_loss_last']}")
    print(f"lookup (GRPO with the tool): held-out sampled reward {L['sampled_before']} -> {L['sampled_after']} "
          f"(gain {L['gain']}, margin {L['margin']}: {'PASS' if L['passed'] else 'MISS'}); greedy "
          f"{L['greedy_before']} -> {L['greedy_after']}; curve {L['curve']}; training reward {L['train_reward']}; "
          f"engine-trainer log-prob mismatch, mean over steps {L['mismatch_mean']} (worst step {L['mismatch_max_step']})")
    lo, hi = out["window"]
    print(f"step time, median of steps {lo}..{hi}:")
    print("| run | s/step | generate s | update s | turns | tool calls | tool errors | latency p50 / p99 s | "
          "truncated |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run, t in out["timing"].items():
        print(f"| {run} | {t['s_per_step']} | {t['generate_s']} | {t['update_s']} | {t['turns_mean']} | "
              f"{t['tool_calls_mean']} | {t['tool_error_frac']} | {t['tool_latency_p50']} / {t['tool_latency_p99']} | "
              f"{t['truncated_frac']} |")
    print(f"lookup s/step over steps {lo}..{L['steps']}: {L['s_per_step_all']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print("RESULT " + json.dumps({"name": "agent_gpu", "ok": bool(L["passed"]), "gain": L["gain"],
                                  "s_per_step": {r: out["timing"][r]["s_per_step"] for r in RUNS}}))
    return 0 if L["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The GPU scale matrix: every cell planned, then run if the plan says it fits.

    python -m bench.matrix                       # every cell not yet in the results file
    python -m bench.matrix --cells 05b-grpo,7b-lora-grpo --budget-s 500
    python -m bench.matrix --list                # the cells and their overrides

A cell is a set of ``rlhf-run`` overrides on a random-weight model of a preset's shape
(``bench.make_model``). For each cell:

1. ``--plan``: does it fit, and the plan's training/generation figures (GB per GPU);
2. fits → 2 RL steps (or a short supervised run), a checkpoint and the final HF export; recorded:
   exit code, seconds per step, the measured peak memory (``memory/*`` metrics) against the plan,
   the trainer-vs-vLLM log-prob mismatch, whether ``final/hf`` was written;
3. does not fit → the same command without ``--plan`` must stop before anything starts (exit 2,
   within seconds, no Ray cluster); then the plan's own fix ("→ a setting that fits: ...") is
   planned and run as in 2 when it needs no other hardware (``suggested_run``): every fix the plan
   suggests must work.

Results are appended as JSON lines to ``--results`` (one line a cell, newest last), so a matrix
larger than one stretch of GPU time is run over several and each run skips the cells done.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.common import kill_tagged
from rlhf import storage
from rlhf.spec.tokens import PAIRED

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("RLHF_GPU_MODELS", "/tmp/rlhf-gpu/models"))
RUNS = Path("/tmp/rlhf-gpu/matrix")
SMALL = ["train.steps=2", "train.prompts_per_step=8", "algo.group_size=4", "rollout.max_response_tokens=256",
         "checkpoint.every=2", "tracking=none", "tracking.console=plain",
         "reward.functions=[{fn: bench.rewards:letters}]"]
SUPERVISED = ["tracking=none", "tracking.console=plain", "algo.epochs=1", "train.prompts_per_step=16",
              "checkpoint.every=2"]


def _rl(preset: str, *extra: str) -> list[str]:
    return [f"model={preset}", "hardware=1xh200", "placement=hybrid", *SMALL, *extra]


# cells whose question is the training side start vLLM without CUDA graphs: about a minute less
# of device time a cell (graph capture and compile), the training phase unchanged
EAGER = "rollout.enforce_eager=true"


# name -> (preset, overrides); the presets are conf/model/<preset>.yaml
CELLS: dict[str, tuple[str, list[str]]] = {
    "05b-grpo": ("qwen2.5-0.5b", _rl("qwen2.5-0.5b", "algo=grpo")),
    "05b-grpo-offload": ("qwen2.5-0.5b", _rl("qwen2.5-0.5b", EAGER, "algo=grpo", "placement.offload_train_state=true")),
    "05b-ppo": ("qwen2.5-0.5b", _rl("qwen2.5-0.5b", EAGER, "algo=ppo")),
    "05b-grpo-lora": ("qwen2.5-0.5b", _rl("qwen2.5-0.5b", EAGER, "algo=grpo", "model.lora.rank=16", "model.lora.alpha=32")),
    "15b-grpo": ("qwen2.5-1.5b", _rl("qwen2.5-1.5b", "algo=grpo")),
    "15b-ppo": ("qwen2.5-1.5b", _rl("qwen2.5-1.5b", "algo=ppo")),
    "15b-grpo-zero3": ("qwen2.5-1.5b", _rl("qwen2.5-1.5b", EAGER, "algo=grpo", "train.zero_stage=3")),
    # DeepSpeed's CPU Adam on the GPU machine (7B's optimizer offload needs more host memory than it has)
    "15b-grpo-optoff": ("qwen2.5-1.5b", _rl("qwen2.5-1.5b", EAGER, "algo=grpo", "train.offload_optimizer=true")),
    "7b-lora-grpo": ("qwen2.5-7b", _rl("qwen2.5-7b", "algo=grpo", "model.lora.rank=16", "model.lora.alpha=32")),
    "7b-lora-grpo-offload": ("qwen2.5-7b", _rl("qwen2.5-7b", EAGER, "algo=grpo", "model.lora.rank=16",
                                               "model.lora.alpha=32", "placement.offload_train_state=true")),
    "7b-grpo": ("qwen2.5-7b", _rl("qwen2.5-7b", "algo=grpo")),
    "7b-grpo-optoff": ("qwen2.5-7b", _rl("qwen2.5-7b", EAGER, "algo=grpo", "train.offload_optimizer=true")),
    "15b-sft": ("qwen2.5-1.5b", ["algo=sft", "model=qwen2.5-1.5b", "hardware=1xh200", *SUPERVISED]),
    "15b-rm": ("qwen2.5-1.5b", ["algo=rm", "model=qwen2.5-1.5b", "hardware=1xh200", *SUPERVISED]),
    "15b-dpo": ("qwen2.5-1.5b", ["algo=dpo", "model=qwen2.5-1.5b", "hardware=1xh200", *SUPERVISED]),
    # sequences cut at data.max_length (long_rows): every micro-batch holds the tokens the plan sizes
    # it for (8 × 2048, 8 pairs × 2 × 1024), the plan checked at its own budget; DPO's with the
    # reference released before the update
    "15b-sft-long": ("qwen2.5-1.5b", ["algo=sft", "model=qwen2.5-1.5b", "hardware=1xh200", *SUPERVISED,
                                      "data.max_length=2048"]),
    "15b-dpo-long": ("qwen2.5-1.5b", ["algo=dpo", "model=qwen2.5-1.5b", "hardware=1xh200", *SUPERVISED,
                                      "data.max_length=1024"]),
}
LONG_DATA = {"15b-sft-long", "15b-dpo-long"}

FIGURE = re.compile(r"^\s*(training phase|generation phase|actor|rollout|host memory per node):.*= ([0-9.]+) of ([0-9.]+)",
                    re.M)
PEAK_KEYS = ("memory/train_peak_reserved_gib", "memory/critic_peak_reserved_gib", "memory/reference_peak_reserved_gib",
             "memory/reward_peak_reserved_gib")
# what the tensors held at most (reserved minus this is the caching allocator's own share)
ALLOCATED_KEYS = tuple(k.replace("_reserved_", "_allocated_") for k in PEAK_KEYS)
# what each training process keeps on the GPU while vLLM generates (actor, critic, reference, reward model)
RESIDENT_KEYS = tuple(k.replace("_peak_reserved_", "_resident_") for k in PEAK_KEYS)
MEMORY_KEYS = (*RESIDENT_KEYS, "memory/vllm_freed_gib", *PEAK_KEYS, *ALLOCATED_KEYS)
# a cell's run at the most seen (Ray, vLLM start, 2 steps, a checkpoint and the export at 1.5B: 100-200 s
# on one H200); one started with less may be killed at the budget part way, which tells nothing
MIN_CELL_S = 200
# below this much free disk, model dirs that no later cell of the run needs are deleted (a 7B one is 15 GB)
LOW_DISK_GB = 60


def say(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_dir(preset: str) -> Path:
    d = MODELS / f"{preset}-random"
    if not (d / "config.json").exists():
        t = time.time()
        subprocess.run([sys.executable, "-m", "bench.make_model", preset, str(d)], cwd=ROOT, check=True)
        say(f"built {d} in {time.time() - t:.0f} s")
    return d


def supervised_data(kind: str, long: bool = False) -> list[str]:
    """Tiny local data sets for the supervised cells, made by rlhf-data (no hub); ``long``: rows
    longer than any cell's data.max_length (long_rows)."""
    what = "sft" if kind == "sft" else "preference"
    d = RUNS / "data" / (f"{what}-long" if long else what)
    f = d / "train.jsonl"
    if long:
        long_rows(d, what)
    elif not f.exists():
        subprocess.run([sys.executable, "-m", "rlhf.data.cli", "make", what, "--out", str(d), "--n", "64"], cwd=ROOT,
                       check=True)
    # both files: the default eval set is the RL task's prompts, which a supervised run cannot read
    return [f"data.train_files=[{f}]", f"data.eval_files=[{d / 'eval.jsonl'}]"]


def long_rows(d: Path, what: str, n: int = 64, n_eval: int = 16, seed: int = 0) -> None:
    """train.jsonl / eval.jsonl of random five-letter words (about 5.5 tokens each with the random
    models' tokenizer): a 100-word prompt and 400-word responses, about 2,750 tokens a sequence,
    which the run cuts at data.max_length (the default right truncation keeps the prompt)."""
    import random

    if (d / "train.jsonl").exists() and (d / "eval.jsonl").exists():
        return
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(k))

    def row() -> dict:
        if what == "sft":
            return {"prompt": words(100), "response": words(400)}
        return {"prompt": words(100), "chosen": words(400), "rejected": words(400)}

    d.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.jsonl", n), ("eval.jsonl", n_eval)):
        (d / name).write_text("".join(json.dumps(row()) + "\n" for _ in range(count)))


def plan_cli(args: list[str]) -> tuple[int, str]:
    """``rlhf-run <args> --plan`` in this process: what a subprocess prints, without its 15 s of
    imports per call (the plan touches no GPU: it is arithmetic on the spec). An exception the CLI
    lets out is exit code 1 with its traceback, as a subprocess would show it."""
    import contextlib
    import io
    import traceback

    from rlhf import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = cli.main([*args, "--plan"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - one cell's broken plan must not end the matrix
            traceback.print_exc()
            rc = 1
    return rc, buf.getvalue()


def run_cli(args: list[str], timeout: float, log: Optional[Path] = None) -> tuple[int, str, float]:
    """``rlhf-run <args>`` in a subprocess: (exit code, its output, seconds); 124 at the timeout.
    The whole output goes to ``log`` when given (a failure's cause is rarely in its last lines).
    Every process the run started (its Ray cluster's included) is ended after it returns, found by
    a tag in its environment: a run killed at its timeout must not hold GPU memory in the next cell."""
    t = time.time()
    tag = f"{os.getpid()}-{time.time_ns()}"
    try:
        r = subprocess.run([sys.executable, "-m", "rlhf.cli", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, "RLHF_MATRIX_RUN": tag})
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:  # its output so far arrives as bytes
        rc, out = 124, "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                               for x in (e.stdout, e.stderr))
    finally:
        kill_tagged("RLHF_MATRIX_RUN", tag)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out[-400_000:])
    return rc, out, time.time() - t


def free_gb(path: Path) -> float:
    return round((storage.free_bytes(path) or 0) / 1e9, 1)


def free_models(keep: set[str]) -> None:
    """Delete the model dirs of presets not in ``keep`` when the disk runs low: a cell's checkpoint
    (actor and critic states: 14 B per parameter each) must not fail on what an earlier cell left."""
    if not MODELS.exists() or free_gb(MODELS) >= LOW_DISK_GB:
        return
    for d in MODELS.glob("*-random"):
        if d.name.removesuffix("-random") not in keep:
            shutil.rmtree(d, ignore_errors=True)
            say(f"deleted {d} ({free_gb(MODELS)} GB free now)")


def run_cell(name: str, deadline: float, logs: Optional[Path] = None) -> dict:
    """Plan cell ``name``, then run it, or check its refusal and run the plan's fix (module doc).
    ``logs``: the folder for each run's whole output (``<cell>.log``, ``<cell>.refused.log``,
    ``<cell>.suggested.log``)."""
    preset, overrides = CELLS[name]
    path = model_dir(preset)
    out_dir = RUNS / name
    shutil.rmtree(out_dir, ignore_errors=True)
    args = [*overrides, f"model.path={path}", f"output_dir={out_dir}"]
    if overrides[0] in ("algo=sft", "algo=rm", "algo=dpo"):
        args += supervised_data(overrides[0].split("=")[1], long=name in LONG_DATA)
    rec: dict = {"cell": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "overrides": overrides,
                 "disk_free_gb": free_gb(RUNS.parent)}
    text = plan_into(rec, args)
    if rec["plan_fits"]:
        return run_fitting(rec, args, out_dir, deadline, logs and logs / f"{name}.log")
    rc, out, dt = run_cli(args, 120, logs and logs / f"{name}.refused.log")
    rec.update(run_rc=rc, run_s=round(dt, 1), refused_before_start=rc == 2 and "Started a local Ray" not in out,
               last_line=out.strip().splitlines()[-1][:300] if out.strip() else "")
    # the plan's own fix, when this machine can run it (not another hardware): it must fit and run
    fix = suggested_fix(text)
    rec["suggested"] = fix
    if fix and not any(f.startswith("hardware") for f in fix) and time.time() < deadline - 120:
        sub: dict = {"overrides": fix}
        plan_into(sub, args + fix)
        if sub["plan_fits"]:
            run_fitting(sub, args + fix, out_dir, deadline, logs and logs / f"{name}.suggested.log")
        rec["suggested_run"] = sub
    return rec


def plan_into(rec: dict, args: list[str]) -> str:
    """``--plan`` of ``args``: its exit code, verdict, figures and key lines into ``rec``; its text."""
    rc, text = plan_cli(args)
    rec["plan_rc"] = rc
    rec["plan_fits"] = "✓ fits" in text
    rec["plan"] = {m.group(1): float(m.group(2)) for m in FIGURE.finditer(text)}
    rec["plan_lines"] = [ln for ln in text.splitlines() if ln.startswith(("steps:", "epochs:", "batch:", "✗", "!", "✓", "→",
                                                                          "  training", "  generation"))]
    return text


def suggested_fix(plan_text: str) -> list[str]:
    """The overrides of the plan's "→ a setting that fits: ..." line ([] when it has none)."""
    m = re.search(r"^→ a setting that fits: (.+)$", plan_text, re.M)
    return m.group(1).split() if m else []


def run_fitting(rec: dict, args: list[str], out_dir: Path, deadline: float, log: Optional[Path] = None) -> dict:
    """Run a cell the plan calls fitting: exit code, step time, peaks against the plan, export."""
    shutil.rmtree(out_dir, ignore_errors=True)
    left = deadline - time.time()
    rc, text, dt = run_cli(args, max(left, 60), log)
    rec.update(run_rc=rc, run_s=round(dt, 1), last_lines=text.strip().splitlines()[-3:])
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if rows:
        last = rows[-1]
        rec["step_s"] = last.get("time/step")
        rec["times"] = {k: v for k, v in last.items() if k.startswith("time/")}  # the last step's phases
        rec["mismatch"] = last.get("mismatch/logp_abs_mean")
        rec["mfu"] = last.get("perf/mfu")
        rec["micro_batch_tokens_max"] = max((r.get("perf/micro_batch_tokens_max", 0) for r in rows), default=0)
        for k in MEMORY_KEYS:
            vals = [r[k] for r in rows if k in r]
            if vals:
                rec[k] = max(vals)
                rec.setdefault("last_step", {})[k] = vals[-1]  # steady state: no first-step compiles
    rec["exported"] = (out_dir / "final" / "hf" / "config.json").exists()
    rec["checkpointed"] = any((out_dir / "checkpoints").glob("step_*")) if (out_dir / "checkpoints").exists() else False
    # the generation phase: what the training processes keep on the GPU and what vLLM frees when it
    # sleeps (its KV cache and weights; its CUDA context and graphs are not in it)
    gen_gb, last = rec["plan"].get("generation phase"), rec.get("last_step", {})
    if gen_gb and last.get("memory/vllm_freed_gib"):
        held = last["memory/vllm_freed_gib"] + sum(last.get(k, 0.0) for k in RESIDENT_KEYS)
        rec["generation_measured_gb"] = round(held * 2**30 / 1e9, 2)
        rec["generation_measured_over_plan"] = round(rec["generation_measured_gb"] / gen_gb, 3)
    train_gb = rec["plan"].get("training phase") or rec["plan"].get("actor")
    # every training process's peak on the GPU (actor, critic, reference: one GPU in hybrid)
    peaks = [rec[k] for k in PEAK_KEYS if rec.get(k)]
    if train_gb and peaks:
        measured = sum(peaks) * 2**30 / 1e9
        rec["train_measured_gb"] = round(measured, 2)
        rec["train_measured_over_plan"] = round(measured / train_gb, 3)
        last = [rec.get("last_step", {}).get(k) for k in PEAK_KEYS]
        if any(last):
            rec["train_measured_last_gb"] = round(sum(v for v in last if v) * 2**30 / 1e9, 2)
            rec["train_measured_last_over_plan"] = round(rec["train_measured_last_gb"] / train_gb, 3)
        held = [rec[k] for k in ALLOCATED_KEYS if rec.get(k)]
        if held:
            rec["train_allocated_gb"] = round(sum(held) * 2**30 / 1e9, 2)
            rec["train_allocated_over_plan"] = round(rec["train_allocated_gb"] / train_gb, 3)
        # the plan again at the largest micro-batch the run packed, the run's ZeRO and offload
        # pinned: the formulas' error apart from the margin of a token budget the prompts did not fill
        tokens = int(rec.get("micro_batch_tokens_max") or 0)
        at = tokens_overrides(args, rec["plan_lines"], tokens) if tokens else []
        if at:  # none: a supervised plan without its batch line, nothing to plan again at
            _, again = plan_cli(args + at + plan_choices(rec["plan_lines"]))
            figures = {m.group(1): float(m.group(2)) for m in FIGURE.finditer(again)}
            gb_at_tokens = figures.get("training phase") or figures.get("actor")
            if gb_at_tokens:
                rec["plan_at_measured_tokens_gb"] = gb_at_tokens
                rec["train_measured_over_plan_at_tokens"] = round(measured / gb_at_tokens, 3)
    shutil.rmtree(out_dir, ignore_errors=True)  # a 7B export is 15 GB: the disk is 64 GB
    return rec


def tokens_overrides(args: list[str], plan_lines: list[str], tokens: int) -> list[str]:
    """Overrides that plan a run of ``args`` again at ``tokens`` per micro-batch: RL's token budget; for
    sft/rm/dpo, which do not read it, the sequence length at which their micro-batch (plan's
    ``batch:`` line) holds that many (rlhf.spec.tokens)."""
    algo = next((o.split("=", 1)[1] for o in args if o.startswith("algo=")), "")
    if algo not in ("sft", "rm", "dpo"):
        return [f"train.max_tokens_per_micro_batch={tokens}"]
    batch = next((ln for ln in plan_lines if ln.startswith("batch:")), "")
    m = re.search(r"\(micro (\d+) ×", batch)
    per = 2 if algo in PAIRED else 1
    return [f"data.max_length={math.ceil(tokens / (int(m.group(1)) * per))}"] if m else []


def plan_choices(plan_lines: list[str]) -> list[str]:
    """The ZeRO stage and optimizer offload the plan chose (its ``steps:`` line, ``epochs:`` for
    sft/rm/dpo), and whether its training phase holds vLLM asleep or awake (the plan keeps it awake
    where there is room, which a smaller token budget can make), as overrides."""
    steps = next((ln for ln in plan_lines if ln.startswith(("steps:", "epochs:"))), "")
    m = re.search(r"ZeRO-(\d)", steps)
    out = [f"train.zero_stage={m.group(1)}"] if m else []
    out.append(f"train.offload_optimizer={'true' if 'optimizer offloaded' in steps else 'false'}")
    train = next((ln for ln in plan_lines if ln.strip().startswith("training phase:")), "")
    if "vLLM (awake)" in train or "vLLM asleep" in train:
        out.append(f"placement.sleep_rollout={'false' if 'vLLM (awake)' in train else 'true'}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all not yet done)")
    ap.add_argument("--results", default=os.environ.get("RLHF_MATRIX_RESULTS", "/tmp/rlhf-gpu/matrix.jsonl"))
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("JOB_TIMEOUT_S", 540)))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--redo", action="store_true", help="run cells already in the results file again")
    a = ap.parse_args(argv)
    if a.list:
        for n, (p, o) in CELLS.items():
            print(f"{n:<24} {' '.join(o)}")
        return 0
    deadline = time.time() + a.budget_s - 20
    results = Path(a.results)
    done = set()
    if results.exists() and not a.redo:
        done = {json.loads(x)["cell"] for x in results.read_text().splitlines() if x.strip()}
    names = [n for n in (a.cells.split(",") if a.cells else CELLS) if n]
    unknown = [n for n in names if n not in CELLS]
    if unknown:  # before any cell spends GPU time
        print(f"unknown cell(s) {', '.join(map(repr, unknown))}; --list shows them", file=sys.stderr)
        return 2
    for n in (n for n in names if n in done):
        say(f"{n}: done earlier (--redo runs it again)")
    names = [n for n in names if n not in done]
    for i, n in enumerate(names):
        left = deadline - time.time()
        if left < MIN_CELL_S:
            say(f"{n}: skipped, budget spent ({left:.0f} s left, a cell takes {MIN_CELL_S} s or more)")
            continue
        say(f"{n}: start")
        free_models({CELLS[m][0] for m in names[i:]})
        rec = run_cell(n, deadline, results.parent / "cell_logs")
        results.parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print("RESULT " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

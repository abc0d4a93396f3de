"""The disk a run writes under output_dir (rlhf.plan.disk): the formula against hand arithmetic and
against real DeepSpeed checkpoints and HF exports written by the workers' own save calls on CPU;
the plan's line, its "does not fit" line whose every suggestion fits when planned again, and the
start of a run refusing (exit 2, one line, nothing made) what the plan refuses."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf import cli, storage
from rlhf.plan import disk
from rlhf.plan.memory import GB
from tests.helpers import planned_spec

ROOT = Path(__file__).resolve().parents[2]
EXTRA = disk.CHECKPOINT_EXTRA_BYTES
# Qwen2.5-1.5B's shape (conf/model/qwen2.5-1.5b.yaml): tied embeddings
H, L, I, HEADS, KV, V = 1536, 28, 8960, 12, 2, 151936
# the GPU machine's 15b-ppo cell (bench/matrix.py)
PPO = ["algo=ppo", "model=qwen2.5-1.5b", "hardware=1xh200", "train.prompts_per_step=8", "algo.group_size=4",
       "rollout.max_response_tokens=256"]


def _qwen15_params() -> tuple[int, int]:
    """(policy, value model) parameters by hand: embeddings, layers (q,o h²; k,v h·(h/heads)·kv;
    the MLP 3hI; two norms), the final norm; tied head; a value head of h."""
    layer = 2 * H * H + 2 * H * (H // HEADS) * KV + 3 * H * I + 2 * H
    body = V * H + L * layer + H
    return body, body + H


def _hf(params: int, b: int = 2) -> int:
    return b * params + disk.TOKENIZER_BYTES_PER_TOKEN * V + disk.CONFIG_BYTES


def test_ppo_cell_of_the_gpu_machine_by_hand():
    """15b-ppo (full fine-tune, ZeRO-2, bf16, checkpoint.every=2, train.steps=2): one save, so
    one checkpoint (actor and critic: 14 B per parameter each, and their HF exports) and the
    final export beside it."""
    spec = planned_spec([*PPO, "train.zero_stage=2", "train.offload_optimizer=false", "checkpoint.every=2",
                         "train.steps=2"])
    p, pv = _qwen15_params()
    need = disk.need(spec)
    ckpt = (14 * p + EXTRA) + _hf(p) + (14 * pv + EXTRA) + _hf(pv)
    assert need.saves == 1 and need.checkpoints == 1
    assert need.total * GB == pytest.approx(ckpt + _hf(p) + _hf(pv), rel=1e-12)
    assert 50 < need.total < 60  # the ~30 GB that machine had free is not enough


@pytest.mark.parametrize("overrides,per_param,alive", [
    # GRPO, 12 saves, keep_last 2: three on disk while the third is written
    (["checkpoint.every=10", "train.steps=120"], 14, 3),
    # ZeRO-3 writes no 16-bit weights (its weights are the fp32 partition); keep_last 1 + best: 3
    (["train.zero_stage=3", "train.offload_optimizer=true", "checkpoint.every=10", "checkpoint.keep_last=1",
      "checkpoint.best_metric=eval/greedy/reward_mean"], 12, 3),
    # float32 at ZeRO-1: weights 4 B and the optimizer's fp32 copy, m, v
    (["model.dtype=float32", "train.zero_stage=1", "train.offload_optimizer=true", "checkpoint.every=25",
      "train.steps=100"], 16, 3),
])
def test_checkpoints_alive_at_the_peak_by_hand(overrides, per_param, alive):
    spec = planned_spec(["model=qwen2.5-1.5b", "hardware=1xh200", "checkpoint.save_hf=false", *overrides])
    p, _ = _qwen15_params()
    b = 4 if spec.model.dtype == "float32" else 2
    need = disk.need(spec)
    assert need.checkpoints == alive and not need.final  # the checkpoints, not the export, are the peak
    assert need.total * GB == pytest.approx(alive * (per_param * p + EXTRA), rel=1e-12)
    # the other candidate for the peak, after the last save: one fewer checkpoint and the final
    # export, whose size the code gets right (so losing to the checkpoints above is a fair verdict)
    assert disk.hf_export_gb(spec, "actor", p, p) * GB == pytest.approx(_hf(p, b), rel=1e-12)


def test_lora_checkpoints_hold_the_adapters_and_exports_the_merged_model():
    """LoRA: the DeepSpeed checkpoint has the adapters only (14 B each); the HF export the merged
    weights and the adapter; SFT with checkpoint.every > 0 on rows not counted (a Hub data set):
    as many checkpoints as rotation keeps, plus the one being written."""
    spec = planned_spec(["algo=sft", "model=qwen2.5-1.5b", "hardware=1xh200", "model.lora.rank=8",
                         "model.lora.alpha=16", "checkpoint.every=100", "data.train_files=[hub:org/sft:train]"])
    p, _ = _qwen15_params()
    kv = H // HEADS * KV
    lora = L * 8 * (2 * (H + H) + 2 * (H + kv) + 2 * (H + I) + (I + H))  # q,o; k,v; gate,up; down
    assert tuple(spec.model.lora.target_modules) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj")
    need = disk.need(spec)
    assert need.saves is None and need.checkpoints == spec.checkpoint.keep_last + 1
    one = 14 * lora + EXTRA + _hf(p) + 2 * lora
    assert need.per_checkpoint * GB == pytest.approx(one, rel=1e-12)


# ----------------------------------------------------------------------------- real checkpoints

SHAPE = ["model.hidden=256", "model.intermediate=704", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2"]
MEASURED = {
    "bf16-zero2": ["model.dtype=bfloat16", "train.zero_stage=2"],
    "bf16-zero3": ["model.dtype=bfloat16", "train.zero_stage=3"],
    "fp32-zero0": ["model.dtype=float32", "train.zero_stage=0"],
    "bf16-zero0-lora": ["model.dtype=bfloat16", "train.zero_stage=0", "model.lora.rank=8", "model.lora.alpha=16"],
    "ppo-critic-bf16-zero1": ["algo=ppo", "model.dtype=bfloat16", "train.zero_stage=1"],
}


def measure_checkpoints() -> None:
    """In a fresh process (it initialises torch.distributed): for each case a worker of the
    run's own class set up on one CPU rank (builtin:tiny at a 2.8 M-parameter shape), one
    optimizer step (Adam's m and v exist from then on), then its ``save_state`` and ``save_hf``, as
    ``rlhf.ckpt.training.save`` calls them. Prints {case: [measured bytes, planned bytes]} for
    the DeepSpeed state and the HF export."""
    import socket
    import tempfile

    import torch

    from rlhf.workers.critic import CriticWorker
    from rlhf.workers.policy import PolicyWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = {}
    for name, overrides in MEASURED.items():
        # console verbose: a worker made in this process leaves its stdout (this function's answer) alone
        spec = planned_spec(SHAPE + overrides + ["tracking.console=verbose"])
        role, cls = ("critic", CriticWorker) if "critic" in name else ("actor", PolicyWorker)
        w = cls(spec, role, 0, 1)
        w.init_distributed("127.0.0.1", port)
        ids = torch.randint(0, spec.model.vocab, (1, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(spec.batch.grad_accum):  # one optimizer step
            w.engine.backward(w.engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().mean())
            w.engine.step()
        folder = Path(tempfile.mkdtemp())
        w.save_state(str(folder))
        w.save_hf(str(folder / role / "hf"))
        trained, full = disk.trained_params(spec)[role]
        ds = sum(storage.dir_bytes(p) for p in (folder / role).iterdir() if p.name not in ("hf", "adapter"))
        hf = storage.dir_bytes(folder / role / "hf") + storage.dir_bytes(folder / role / "adapter")
        out[name] = {"ds": [ds, disk.deepspeed_checkpoint_gb(trained, spec.model.dtype, spec.train.zero_stage) * GB],
                     "hf": [hf, disk.hf_export_gb(spec, role, trained, full) * GB], "trained": trained}
    print("MEASURED " + json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def measured(rlhf_cache) -> dict:
    code = "from tests.spec.test_spec_disk import measure_checkpoints as m; m()"
    env = {**os.environ, "RLHF_CACHE": rlhf_cache, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                       timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("MEASURED ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
    return json.loads(line[len("MEASURED "):])


@pytest.mark.parametrize("case", MEASURED)
def test_formula_against_checkpoints_the_workers_write(measured, case):
    """Planned ≥ written (the safe side), and within the per-rank allowance plus 0.5 % of it."""
    m = measured[case]
    (ds, ds_plan), (hf, hf_plan) = m["ds"], m["hf"]
    assert ds <= ds_plan <= 1.005 * ds + EXTRA, (case, ds, ds_plan, ds / m["trained"])
    # the export: weights (and adapter) in the training dtype, tokenizer and config files
    assert hf_plan - 20_000 <= hf <= hf_plan + 20_000, (case, hf, hf_plan)
    # the optimizer's bytes per trained parameter, which the allowance does not hide
    per = {"bf16-zero2": 14, "bf16-zero3": 12, "fp32-zero0": 12, "bf16-zero0-lora": 14, "ppo-critic-bf16-zero1": 14}
    assert per[case] * m["trained"] <= ds <= per[case] * m["trained"] * 1.06 + 50_000, (case, ds / m["trained"])


# ----------------------------------------------------------------------------- the plan and the run

def _free(monkeypatch, gb: float) -> None:
    monkeypatch.setattr(storage, "free_bytes", lambda path: int(gb * GB))


def _plan(capsys, argv: list[str]) -> str:
    assert cli.main([*argv, "--plan"]) == 0
    return capsys.readouterr().out


def _disk_refusal(out: str):
    return re.search(r"^✗ does not fit: the disk at (\S+) needs ~([\d.]+) GB .*?, ([\d.]+) GB free there", out,
                     flags=re.M)


def _disk_tips(out: str) -> list[list[str]]:
    line = next(ln for ln in out.splitlines() if ln.startswith("✗ does not fit: the disk at"))
    tips = line.split(", or set ", 1)[1].rstrip(".").split("; ") if ", or set " in line else []
    return [t.split(" (")[0].split() for t in tips]


def test_plan_with_room_prints_the_line_and_fits(real_disk, monkeypatch, capsys, tmp_path):
    _free(monkeypatch, 1000)
    out = _plan(capsys, [*PPO, "checkpoint.every=2", "train.steps=2", f"output_dir={tmp_path / 'run'}"])
    line = next(ln for ln in out.splitlines() if ln.startswith("disk at "))
    assert line.startswith(f"disk at {tmp_path / 'run'} (output_dir): 1 checkpoint (actor 21.6 + actor HF 3.1 + "
                           "critic 21.6 + critic HF 3.1) + final export (actor 3.1 + critic 3.1) = ")
    assert line.endswith(" GB of 1000.0 GB free")
    assert not _disk_refusal(out) and out.rstrip().endswith("✓ fits")


def test_plan_measures_the_run_dir_a_run_would_get(real_disk, monkeypatch, capsys, tmp_path):
    """Without output_dir the plan measures hydra.run.dir (the dir the run would write to), not
    some default, and does not create it."""
    seen = []
    monkeypatch.setattr(storage, "free_bytes", lambda path: seen.append(Path(path)) or 7 * GB)
    where = tmp_path / "elsewhere" / "run"
    out = _plan(capsys, ["train.steps=2", f"hydra.run.dir={where}"])
    line = next(ln for ln in out.splitlines() if ln.startswith("disk at "))
    assert line.startswith(f"disk at {where} (hydra.run.dir): ") and line.endswith(" of 7.0 GB free"), line
    assert seen == [where] and not where.parent.exists()


@pytest.mark.parametrize("free,extra", [
    (30, ["checkpoint.every=2", "train.steps=2"]),  # the GPU machine's cell
    (70, ["checkpoint.every=1", "train.steps=4"]),  # four saves, three alive at once
    (130, ["checkpoint.every=1", "train.steps=4", "checkpoint.best_metric=eval/greedy/reward_mean"]),
])
def test_small_disk_refuses_and_every_suggestion_fits_when_planned_again(real_disk, monkeypatch, capsys, free, extra):
    _free(monkeypatch, free)
    argv = [*PPO, *extra]
    out = _plan(capsys, argv)
    refused = _disk_refusal(out)
    assert refused and float(refused.group(2)) > 0.95 * free and float(refused.group(3)) == free, out
    assert f"Give output_dir= a path on a disk with ≥ {math.ceil(float(refused.group(2)) / 0.95)} GB free" in out
    assert out.rstrip().endswith("✗ does not fit (see above)")
    tips = _disk_tips(out)
    for overrides in tips:
        again = _plan(capsys, argv + overrides)
        assert not _disk_refusal(again) and again.rstrip().endswith("✓ fits"), (overrides, again)
    fix = re.search(r"^→ a setting that fits: (.+)$", out, flags=re.M)
    assert fix and _plan(capsys, argv + fix.group(1).split()).rstrip().endswith("✓ fits"), out
    if free >= 70:  # a setting of the checkpoints alone is enough there
        assert any(all(o.startswith("checkpoint.") for o in t) for t in tips), tips


def test_dropping_the_intermediate_checkpoints_is_the_last_resort(real_disk, monkeypatch, capsys):
    """Four saves of the PPO cell (49.4 GB each): checkpoint.every=0 alone fits 95 GB (55.6 GB),
    but so do keep_last=1 with save_hf=false (two checkpoints of 43.2 GB), which keep a checkpoint
    to resume from: that pair is named first and is the setting that fits."""
    _free(monkeypatch, 95)
    out = _plan(capsys, [*PPO, "checkpoint.every=1", "train.steps=4"])
    tips = _disk_tips(out)
    pair = ["checkpoint.keep_last=1", "checkpoint.save_hf=false"]
    assert tips and tips[0] == pair and ["checkpoint.every=0"] in tips, out
    fix = re.search(r"^→ a setting that fits: (.+)$", out, flags=re.M)
    assert fix and fix.group(1).split() == pair, out


def test_only_settings_that_fit_are_suggested(real_disk, monkeypatch, capsys):
    """At 1 GB free nothing but another disk does: no setting is offered, and no fix named."""
    _free(monkeypatch, 1)
    out = _plan(capsys, [*PPO, "checkpoint.every=1", "train.steps=4"])
    assert _disk_refusal(out) and _disk_tips(out) == [] and "→ a setting that fits" not in out


def test_run_refuses_before_anything_starts(real_disk, monkeypatch, capsys, tmp_path, rlhf_cache):
    """The CLI's run path: exit 2, one line (the plan's), no run dir made (so no Ray, no tracker);
    with the real free space the same tiny CPU run passes the check (it needs about a megabyte)."""
    from rlhf.run import check_before_run
    from tests.helpers import make_spec

    argv = ["train.steps=2", "checkpoint.every=1", "tracking.backend=none"]
    room = make_spec([*argv, f"output_dir={tmp_path / 'room'}"], tmp_path / "room")
    assert disk.need(room).total < 0.01
    assert check_before_run(room) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    monkeypatch.setattr(storage, "free_bytes", lambda path: 1000)
    assert cli.main([*argv, f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: does not fit: the disk at {out} needs ~"), err
    assert "Give output_dir= a path on a disk with" in lines[0] and "--plan shows every figure" in lines[0]
    assert ", 1.0 kB free there" in lines[0], lines[0]  # amounts as rlhf.storage.human writes them
    assert not out.exists()


def test_a_run_dirs_own_checkpoints_count_as_room(real_disk, monkeypatch, tmp_path):
    """Resuming into a run dir: its checkpoints and export are part of the need (rotated, rewritten),
    so their bytes count beside the free space."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001" / "driver.pt").write_bytes(b"x" * 3000)
    (run / "final" / "hf").mkdir(parents=True)
    (run / "final" / "hf" / "model.safetensors").write_bytes(b"x" * 500)
    (run / "metrics.jsonl").write_bytes(b"x" * 70)  # not the run's to rotate
    monkeypatch.setattr(storage, "free_bytes", lambda path: 10_000)
    spec = planned_spec([f"output_dir={run}"])
    assert disk.available_bytes(spec) == 13_500


@pytest.mark.parametrize("every, steps, stop, over_fresh", [(16, 32, 5, True), (2, 2, 1, True), (10, 120, 115, False)])
def test_a_resumed_run_plans_the_stop_checkpoint_it_resumes_from(tmp_path, every, steps, stop, over_fresh):
    """A run stopped (Ctrl-C) at step ``stop`` writes a checkpoint off the ``every`` grid; resumed,
    it saves on the grid and at the end while rotation (keep_last 2) keeps the stop's beside them.
    The most checkpoints on disk at once, counted with the real CheckpointManager, is at most what
    the resumed run's plan says, and in the first two cases more than the fresh run's plan (which
    is why a resumed run counts one save more)."""
    from rlhf.ckpt.manager import CheckpointManager

    args = ["model=qwen2.5-0.5b", f"checkpoint.every={every}", f"train.steps={steps}", "checkpoint.keep_last=2"]
    fresh, resumed = planned_spec(args), planned_spec([*args, f"resume={tmp_path}"])
    ckpt = CheckpointManager(tmp_path, every=every, keep_last=2)
    peak = 0

    def save(step: int) -> None:
        nonlocal peak
        tmp = ckpt.begin(step)
        peak = max(peak, len(ckpt.complete()) + 1)  # the one being written, beside the complete ones
        ckpt.commit(tmp, step)

    save(stop)  # the stop checkpoint of the first run
    for step in range(stop + 1, steps + 1):  # the resumed run
        if ckpt.due(step, steps):
            save(step)
    assert peak <= disk.need(resumed).checkpoints
    assert (peak > disk.need(fresh).checkpoints) == over_fresh

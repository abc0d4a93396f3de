"""bench.matrix reads the plan's printed figures and choices: checked against real --plan output
of matrix cells (planned on CPU for one H200; nothing runs)."""

from __future__ import annotations

import json
import re

import pytest

from bench.matrix import CELLS, FIGURE, plan_choices, suggested_fix
from rlhf import cli

QWEN05 = {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
QWEN15 = {"num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


@pytest.mark.parametrize("cell,config,zero,offload", [
    ("05b-grpo", QWEN05, "1", "false"),  # one rank: ZeRO-1 (BENCHMARKS §12)
    ("15b-ppo", QWEN15, None, None),  # as the plan decides (ZeRO-2 with the optimizer offloaded, else ZeRO-1)
])
def test_matrix_parses_the_plan_it_gets(tmp_path, capsys, cell, config, zero, offload):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    _, overrides = CELLS[cell]
    assert cli.main([*overrides, f"model.path={model}", f"output_dir={tmp_path / 'run'}", "--plan"]) == 0
    text = capsys.readouterr().out
    figures = {m.group(1): float(m.group(2)) for m in FIGURE.finditer(text)}
    assert set(figures) >= {"training phase", "generation phase"}, text
    assert all(0 < v < 150.7 for v in figures.values()), figures  # under the H200's total
    steps = [ln for ln in text.splitlines() if ln.startswith("steps:")]
    pinned = plan_choices(text.splitlines())
    offloaded = "optimizer offloaded" in steps[0]
    assert pinned[0] == f"train.zero_stage={zero or (2 if offloaded else 1)}"
    want = offload or ("true" if offloaded else "false")
    assert pinned[1] == f"train.offload_optimizer={want}"
    # the engine as the training phase holds it (at the cells' 2,048-token sequences: asleep)
    assert pinned[2:] == ["placement.sleep_rollout=true"] and "vLLM asleep" in text
    # pinning the choices and planning at fewer tokens gives a smaller training figure (unpinned, the
    # plan would keep vLLM awake in the room fewer tokens leave: a larger figure)
    assert cli.main([*overrides, f"model.path={model}", f"output_dir={tmp_path / 'run'}", *pinned,
                     "train.max_tokens_per_micro_batch=2048", "--plan"]) == 0
    again = {m.group(1): float(m.group(2)) for m in FIGURE.finditer(capsys.readouterr().out)}
    assert again["training phase"] < figures["training phase"]


QWEN7 = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
         "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def test_the_fix_the_matrix_runs_for_a_refused_cell_fits(tmp_path, capsys):
    """7b-grpo does not fit one H200; the matrix runs the plan's "→ a setting that fits" instead,
    which must be a machine-local change that the plan then calls fitting."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN7))
    (model / "model.safetensors").write_bytes(b"")
    _, overrides = CELLS["7b-grpo"]
    args = [*overrides, f"model.path={model}", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(args + ["--plan"]) == 0
    fix = suggested_fix(capsys.readouterr().out)
    assert fix and not any(f.startswith("hardware") for f in fix), fix
    assert cli.main(args + fix + ["--plan"]) == 0
    assert "✓ fits" in capsys.readouterr().out


@pytest.mark.parametrize("cell,keys", [("15b-sft", {"prompt", "response"}), ("15b-dpo", {"prompt", "chosen", "rejected"})])
def test_supervised_cells_train_and_evaluate_on_their_own_data(tmp_path, monkeypatch, cell, keys):
    """A supervised cell's run reads both data files the matrix gives it: the default eval set
    is the RL task's prompts, which SFT/RM/DPO cannot read (the cells failed so on the GPU)."""
    import bench.matrix as matrix

    monkeypatch.setattr(matrix, "RUNS", tmp_path)
    _, overrides = CELLS[cell]
    args = matrix.supervised_data(overrides[0].split("=")[1])
    files = {a.split("=", 1)[0]: a.split("=", 1)[1].strip("[]") for a in args}
    assert set(files) == {"data.train_files", "data.eval_files"}
    for f in files.values():
        row = json.loads(open(f).readline())
        assert keys <= set(row), (f, row)


def test_a_fitting_cells_peaks_max_last_and_allocated_against_the_plan(tmp_path, monkeypatch):
    """run_fitting's record from a run's metrics (the run itself stood in for): the largest and
    the last step's reserved peaks, the allocated peak, each over the plan's training figure."""
    import bench.matrix as matrix

    out_dir = tmp_path / "cell"
    gib = 2**30 / 1e9
    steps = [{"memory/train_peak_reserved_gib": 30.0, "memory/train_peak_allocated_gib": 20.0,
              "memory/reference_peak_reserved_gib": 2.0, "perf/micro_batch_tokens_max": 0},
             {"memory/train_peak_reserved_gib": 25.0, "memory/train_peak_allocated_gib": 22.0,
              "memory/reference_peak_reserved_gib": 2.0, "perf/micro_batch_tokens_max": 0,
              "memory/train_resident_gib": 8.0, "memory/critic_resident_gib": 7.0, "memory/vllm_freed_gib": 60.0}]

    def fake_cli(args, timeout, log=None):
        out_dir.mkdir(exist_ok=True)
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        return 0, "done", 1.0

    monkeypatch.setattr(matrix, "run_cli", fake_cli)
    monkeypatch.setattr(matrix.shutil, "rmtree", lambda *a, **k: None)
    rec = matrix.run_fitting({"plan": {"training phase": 50.0, "generation phase": 90.0}, "plan_lines": []}, [],
                             out_dir, deadline=1e12)
    assert rec["train_measured_gb"] == pytest.approx((30 + 2) * gib, abs=0.01)
    assert rec["train_measured_last_gb"] == pytest.approx((25 + 2) * gib, abs=0.01)
    assert rec["train_measured_last_over_plan"] == pytest.approx((25 + 2) * gib / 50, abs=0.001)
    assert rec["train_allocated_gb"] == pytest.approx(22 * gib, abs=0.01)  # the reference logged no allocated peak
    assert rec["train_allocated_over_plan"] == pytest.approx(22 * gib / 50, abs=0.001)
    # the generation phase: every training process's resident state (the critic's too) and vLLM's
    assert rec["generation_measured_gb"] == pytest.approx((8 + 7 + 60) * gib, abs=0.01)
    assert rec["generation_measured_over_plan"] == pytest.approx((8 + 7 + 60) * gib / 90, abs=0.001)


def test_a_runs_whole_output_is_kept(tmp_path, monkeypatch):
    import subprocess

    import bench.matrix as matrix

    text = "start\n" + "the cause, far from the end\n" + "noise\n" * 50
    monkeypatch.setattr(matrix.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout=text, stderr=""))
    rec = matrix.run_fitting({"plan": {}, "plan_lines": []}, [], tmp_path / "cell", deadline=1e12,
                             log=tmp_path / "cell_logs" / "c1.log")
    assert rec["run_rc"] == 1 and "the cause" not in " ".join(rec["last_lines"])
    assert "the cause, far from the end" in (tmp_path / "cell_logs" / "c1.log").read_text()


def test_a_plan_that_raises_is_exit_code_1_with_its_traceback(monkeypatch):
    import bench.matrix as matrix
    from rlhf import cli

    def broken(argv):
        raise RuntimeError("a bug in the plan")

    monkeypatch.setattr(cli, "main", broken)
    rc, text = matrix.plan_cli(["model=x"])
    assert rc == 1 and "RuntimeError: a bug in the plan" in text


def test_unknown_cells_stop_the_matrix_before_any_cell_runs(tmp_path, monkeypatch, capsys):
    import bench.matrix as matrix

    monkeypatch.setattr(matrix, "run_cell", lambda *a, **k: pytest.fail("a cell ran"))
    assert matrix.main(["--cells", "05b-grpo,no-such-cell", "--results", str(tmp_path / "m.jsonl")]) == 2
    assert "'no-such-cell'" in capsys.readouterr().err


@pytest.mark.parametrize("free,deleted", [(100.0, set()), (20.0, {"qwen2.5-7b-random"})])
def test_model_dirs_no_later_cell_needs_go_when_the_disk_runs_low(tmp_path, monkeypatch, free, deleted):
    import bench.matrix as matrix

    for name in ("qwen2.5-0.5b-random", "qwen2.5-7b-random"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(matrix, "MODELS", tmp_path)
    monkeypatch.setattr(matrix, "free_gb", lambda path: free)
    matrix.free_models({"qwen2.5-0.5b"})
    assert {d.name for d in tmp_path.iterdir()} == {"qwen2.5-0.5b-random", "qwen2.5-7b-random"} - deleted


def test_what_a_run_leaves_running_is_ended_by_its_tag():
    """A process that carries the run's tag (as a Ray worker inherits it) is gone after kill_tagged
    returns; one with another tag is not touched."""
    import os
    import subprocess
    import sys
    import time
    import uuid

    from bench.common import kill_tagged

    mine, theirs = uuid.uuid4().hex, uuid.uuid4().hex
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    tagged = subprocess.Popen(sleep, env={**os.environ, "RLHF_MATRIX_RUN": mine})
    other = subprocess.Popen(sleep, env={**os.environ, "RLHF_MATRIX_RUN": theirs})
    try:
        end, killed = time.time() + 10, 0
        while not killed and time.time() < end:  # until the child has exec'd with its own environment
            killed = kill_tagged("RLHF_MATRIX_RUN", mine)
            time.sleep(0.02)
        assert killed == 1
        assert tagged.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        tagged.kill()
        other.kill()


@pytest.mark.parametrize("cell,per_unit", [("15b-sft", 1), ("15b-dpo", 2)])
def test_a_supervised_cell_is_planned_again_at_the_tokens_it_packed(tmp_path, cell, per_unit):
    """sft/dpo do not read the RL token budget: the matrix plans them again at the sequence length
    that makes their micro-batch hold the tokens the run packed, their ZeRO stage and optimizer
    offload (the plan's ``epochs:`` line) pinned."""
    import math

    import bench.matrix as matrix

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN15))
    (model / "model.safetensors").write_bytes(b"")
    _, overrides = CELLS[cell]
    args = [*overrides, f"model.path={model}", f"output_dir={tmp_path / 'run'}"]
    rec = {"overrides": overrides}
    matrix.plan_into(rec, args)
    micro = int(re.search(r"\(micro (\d+) ×", next(x for x in rec["plan_lines"] if x.startswith("batch:"))).group(1))
    packed = 150
    pinned = matrix.tokens_overrides(args, rec["plan_lines"], packed)
    length = math.ceil(packed / (micro * per_unit))
    assert pinned == [f"data.max_length={length}"]
    choices = plan_choices(rec["plan_lines"])
    assert choices[0].startswith("train.zero_stage=") and choices[1].startswith("train.offload_optimizer=")
    _, again = matrix.plan_cli(args + pinned + choices)
    assert f"≤ {micro * per_unit * length} tokens per micro-batch" in again
    figures = {m.group(1): float(m.group(2)) for m in FIGURE.finditer(again)}
    assert figures["training phase"] < rec["plan"]["training phase"]


@pytest.mark.parametrize("args,want", [
    (["algo=grpo"], "train.max_tokens_per_micro_batch=4000"),
    # a refused cell's fix runs with the cell's own overrides first: its algo is read from them
    (["algo=dpo", "checkpoint.keep_last=1"], "data.max_length=250"),
])
def test_a_fitting_run_is_planned_again_at_its_packed_tokens(tmp_path, monkeypatch, args, want):
    """run_fitting's second plan: pinned at the tokens the run packed (RL: the budget; dpo: the
    sequence length of 8 pairs × 2 holding them), the run's ZeRO stage and offload pinned too."""
    import bench.matrix as matrix

    out_dir = tmp_path / "cell"
    steps = [{"memory/train_peak_reserved_gib": 30.0, "perf/micro_batch_tokens_max": 4000}]

    def fake_cli(a, timeout, log=None):
        out_dir.mkdir(exist_ok=True)
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        return 0, "done", 1.0

    planned = []

    def fake_plan(a):
        planned.append(a)
        return 0, "  training phase:   actor weights 3.1 + activations 8.0 = 40.0 of 150.7\n✓ fits\n"

    monkeypatch.setattr(matrix, "run_cli", fake_cli)
    monkeypatch.setattr(matrix, "plan_cli", fake_plan)
    length = "steps: 2" if args[0] == "algo=grpo" else "epochs: 1"
    lines = ["batch: 16 pairs per optimizer step (micro 8 × 1 accum × 1 ranks) · ≤ 32768 tokens per micro-batch",
             f"{length} · ZeRO-2 · seed 0"]
    rec = matrix.run_fitting({"plan": {"training phase": 50.0}, "plan_lines": lines}, args, out_dir, deadline=1e12)
    assert planned[0] == [*args, want, "train.zero_stage=2", "train.offload_optimizer=false"]
    assert rec["plan_at_measured_tokens_gb"] == 40.0
    assert rec["train_measured_over_plan_at_tokens"] == pytest.approx(30 * 2**30 / 1e9 / 40, abs=0.001)


@pytest.mark.parametrize("cell", ["15b-sft-long", "15b-dpo-long"])
def test_a_long_cells_sequences_fill_the_length_the_plan_sizes_it_for(tmp_path, monkeypatch, cell):
    """The *-long cells check the plan at its own budget: every row, tokenised by the random models'
    tokenizer, is longer than the cell's data.max_length, so each sequence is cut to exactly it."""
    import bench.matrix as matrix
    from bench.common import build_tokenizer

    monkeypatch.setattr(matrix, "RUNS", tmp_path)
    _, overrides = CELLS[cell]
    length = int(next(o for o in overrides if o.startswith("data.max_length=")).split("=")[1])
    args = matrix.supervised_data(overrides[0].split("=")[1], long=True)
    files = {a.split("=", 1)[0]: a.split("=", 1)[1].strip("[]") for a in args}
    tok = build_tokenizer()
    for f in files.values():
        rows = [json.loads(x) for x in open(f)]
        assert len(rows) >= 16
        for r in rows[:4]:
            prompt = len(tok(r["prompt"])["input_ids"])
            for key in ("response", "chosen", "rejected"):
                if key in r:
                    assert prompt < length < prompt + len(tok(r[key])["input_ids"]), (f, key)

"""bench.matrix reads the plan's printed figures and choices: checked against real --plan output
of matrix cells (planned on CPU for one H200; nothing runs)."""

from __future__ import annotations

import json

import pytest

from bench.matrix import CELLS, FIGURE, plan_choices, suggested_fix
from rlhf import cli

QWEN05 = {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
QWEN15 = {"num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


@pytest.mark.parametrize("cell,config,zero,offload", [
    ("05b-grpo", QWEN05, "2", "false"),
    ("15b-ppo", QWEN15, "2", None),  # offload as the plan decides: parsed, whichever it is
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
    assert all(0 < v < 141 for v in figures.values()), figures
    steps = [ln for ln in text.splitlines() if ln.startswith("steps:")]
    pinned = plan_choices(steps)
    assert pinned[0] == f"train.zero_stage={zero}"
    want = offload or ("true" if "optimizer offloaded" in steps[0] else "false")
    assert pinned[1] == f"train.offload_optimizer={want}"
    # pinning the choices and planning at fewer tokens gives a smaller training figure
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

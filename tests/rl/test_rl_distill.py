"""On-policy distillation end to end (algo=opd; rlhf/algos/distill.py), toy size on CPU.

The teacher is the tiny model after SFT on the built-in task (recipe pipeline_sft); the student a
smaller model of the same tokenizer (1 layer, hidden 32, against the teacher's 2 layers, hidden 64)
from random weights. Distillation uses no reward: the student learns only from the teacher's
log-probs of its own samples. Held out (builtin:keymap/eval, greedy), the student must close at
least GAP_CLOSED of the gap between where it started and the teacher's reward; the margin was set
before the first run.

One Ray session (tests/conftest.py ``rl_env``) and one SFT run (module fixture) serve every test:
the teacher's own held-out reward comes from a one-step opd run of the teacher against itself,
which also checks that a student identical to its teacher sees a reverse KL of 0. That run is the
other placement and the other kind of student (the student run is hybrid, every weight trained):
disaggregated (the student, its rollout engine and the teacher each in a process of its own) with a
LoRA student on the teacher's weights (its adapters start at zero, so it is still the teacher).
"""

from __future__ import annotations

import pytest

from tests.helpers import make_spec, record_learning, run_rl, with_test_seed

GAP_CLOSED = 0.6  # share of the held-out gap to the teacher the student closes (set before running)
STUDENT = ["model.n_layers=1", "model.hidden=32", "model.intermediate=64", "model.n_heads=2", "model.n_kv_heads=1"]
EVAL = ["eval.before_training=true", "eval.max_prompts=64", "tracking=none", "tracking.console=plain",
        "checkpoint.save_hf=false"]
STEPS, EVERY = 120, 40
LR = ["algo.lr=3.0e-3"]  # the smaller student takes a larger step than the tiny model's default 1e-3
GREEDY = "eval/greedy/reward_mean"
# the teacher-against-itself run: actor, rollout engine and teacher on a device (a CPU process) each; two
# epochs, so that the student's log-probs of its samples come from the LoRA trainer's own pass (old_logp)
LORA_DISAGGREGATED = ["placement=disaggregated", "hardware.devices_per_node=3", "model.lora.rank=4", "algo.epochs=2"]


@pytest.fixture(scope="module")
def teacher(rl_env, tmp_path_factory):
    """The SFT teacher's final HF export (recipe pipeline_sft, its own defaults)."""
    from rlhf.cli import main

    root = tmp_path_factory.mktemp("distill")
    args = with_test_seed(["recipe=pipeline_sft", f"output_dir={root / 'sft'}", "tracking=none",
                           "tracking.console=plain"])
    assert main(args) == 0
    return root / "sft" / "final" / "hf"


@pytest.fixture(scope="module")
def teacher_eval(teacher, tmp_path_factory):
    """One opd step of the teacher against itself: its held-out reward (eval before training). The
    student is the teacher with LoRA adapters, in disaggregated placement (see the module's text)."""
    out = tmp_path_factory.mktemp("teacher_eval")
    code, rows = run_rl(with_test_seed(["algo=opd", f"model.path={teacher}", f"algo.teacher.path={teacher}",
                                        *LORA_DISAGGREGATED, "train.steps=1", "eval.every=1", *EVAL]), out)
    assert code == 0
    return {"rows": rows, "spec": make_spec(["algo=opd", f"model.path={teacher}", f"algo.teacher.path={teacher}",
                                             *LORA_DISAGGREGATED], out / "probe")}


@pytest.fixture(scope="module")
def student(teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    code, rows = run_rl(with_test_seed(["algo=opd", f"algo.teacher.path={teacher}", *STUDENT, *LR,
                                        f"train.steps={STEPS}", f"eval.every={EVERY}", *EVAL]), out)
    assert code == 0
    return rows


def test_a_student_identical_to_its_teacher_sees_no_divergence(teacher_eval):
    """A LoRA student (its trainer and its rollout engine) and the teacher, three processes in
    disaggregated placement, give the same log-probs to the student's samples (fp32 on CPU: 1e-4)."""
    spec = teacher_eval["spec"]
    roles = spec.layout.roles
    assert spec.layout.mode == "disaggregated" and spec.model.lora.rank == 4
    devices = [set(roles[r]) for r in ("actor", "rollout", "teacher")]
    assert all(devices) and sum(map(len, devices)) == len(set().union(*devices)), roles  # none shared
    row = teacher_eval["rows"][0]
    print(f"opd, LoRA student = teacher, disaggregated: reverse KL {row['distill/reverse_kl']:.2e}, engine-trainer "
          f"log-prob gap max {row['mismatch/logp_abs_max']:.2e}")
    assert row["time/teacher"] > 0 and row["time/old_logp"] > 0, row  # the student's log-probs: the trainer's
    assert abs(row["distill/reverse_kl"]) < 1e-4, row
    assert abs(row["advantages/abs_mean"]) < 1e-4, row
    assert row["mismatch/logp_abs_max"] < 1e-4, row  # the rollout engine's agree with the LoRA trainer's


def test_student_closes_most_of_the_held_out_gap_to_the_teacher(teacher_eval, student):
    t = teacher_eval["rows"][0][f"eval_before/{GREEDY[5:]}"]
    before = student[0][f"eval_before/{GREEDY[5:]}"]
    after = [r[GREEDY] for r in student if GREEDY in r][-1]
    closed = (after - before) / (t - before)
    kl = [r["distill/reverse_kl"] for r in student]
    print(f"opd: held-out greedy reward {before:.3f} -> {after:.3f}, teacher {t:.3f}: {closed:.2f} of the gap; "
          f"reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}")
    record_learning("rl/opd", "held-out gap to the teacher closed", closed, GAP_CLOSED)
    assert t > before + 0.2, (t, before)  # the teacher knows the task; the fresh student does not
    assert closed >= GAP_CLOSED, (before, after, t)
    assert kl[-1] < 0.5 * kl[0], kl  # the student moved towards the teacher, as measured on its own samples

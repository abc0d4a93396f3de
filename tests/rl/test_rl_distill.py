"""On-policy distillation end to end (algo=opd; rlhf/algos/distill.py), toy size on CPU.

The teacher is the tiny model after SFT on the built-in task (recipe pipeline_sft); the student a
smaller model of the same tokenizer (1 layer, hidden 32, against the teacher's 2 layers, hidden 64)
from random weights. Distillation uses no reward: the student learns only from the teacher's
log-probs of its own samples. Held out (builtin:keymap/eval, greedy), the student must close at
least GAP_CLOSED of the gap between where it started and the teacher's reward; the margin was set
before the first run.

One Ray session (tests/conftest.py ``rl_env``) and one SFT run (module fixture) serve every test:
the teacher's own held-out reward comes from a one-step opd run of the teacher against itself,
which also checks that a student identical to its teacher sees a reverse KL of 0.
"""

from __future__ import annotations

import pytest

from tests.helpers import read_metrics, record_learning, run_rl, with_test_seed

GAP_CLOSED = 0.6  # share of the held-out gap to the teacher the student closes (set before running)
STUDENT = ["model.n_layers=1", "model.hidden=32", "model.intermediate=64", "model.n_heads=2", "model.n_kv_heads=1"]
EVAL = ["eval.before_training=true", "eval.max_prompts=64", "tracking=none", "tracking.console=plain",
        "checkpoint.save_hf=false"]
STEPS, EVERY = 120, 40
LR = ["algo.lr=3.0e-3"]  # the smaller student takes a larger step than the tiny model's default 1e-3
GREEDY = "eval/greedy/reward_mean"


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
    """One opd step of the teacher against itself: its held-out reward (eval before training)."""
    out = tmp_path_factory.mktemp("teacher_eval")
    code, rows = run_rl(with_test_seed(["algo=opd", f"model.path={teacher}", f"algo.teacher.path={teacher}",
                                        "train.steps=1", "eval.every=1", *EVAL]), out)
    assert code == 0
    return rows


@pytest.fixture(scope="module")
def student(teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    code, rows = run_rl(with_test_seed(["algo=opd", f"algo.teacher.path={teacher}", *STUDENT, *LR,
                                        f"train.steps={STEPS}", f"eval.every={EVERY}", *EVAL]), out)
    assert code == 0
    return rows


def test_a_student_identical_to_its_teacher_sees_no_divergence(teacher_eval):
    row = teacher_eval[0]
    assert abs(row["distill/reverse_kl"]) < 1e-4, row
    assert abs(row["advantages/abs_mean"]) < 1e-4, row


def test_student_closes_most_of_the_held_out_gap_to_the_teacher(teacher_eval, student):
    t = teacher_eval[0][f"eval_before/{GREEDY[5:]}"]
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

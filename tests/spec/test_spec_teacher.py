"""On-policy distillation's teacher in the spec and the plan (no Ray, no torch runs): the role,
its validation lines, where the layout puts it, and the memory figures that count it."""

from __future__ import annotations

import json

import pytest

from rlhf.spec.errors import SpecError
from tests.helpers import assert_clear, planned_spec

# a 1.5B-shaped teacher beside the 0.5B student (Qwen2.5 shapes, the same vocabulary)
QWEN15 = ["algo.teacher.n_layers=28", "algo.teacher.hidden=1536", "algo.teacher.intermediate=8960",
          "algo.teacher.n_heads=12", "algo.teacher.n_kv_heads=2", "algo.teacher.vocab=151936"]


@pytest.fixture
def teacher_dir(tmp_path):
    """A teacher checkpoint's config.json (the plan reads its shape; nothing loads it here)."""
    d = tmp_path / "teacher"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 22, "tie_word_embeddings": False}))
    return d


def _problems(overrides):
    with pytest.raises(SpecError) as e:
        planned_spec(overrides)
    return e.value.problems


def test_opd_has_a_teacher_role_and_no_reference(teacher_dir):
    spec = planned_spec(["algo=opd", f"algo.teacher.path={teacher_dir}"])
    assert spec.roles == ("actor", "teacher", "rollout")
    assert spec.algo.estimator == "distill" and spec.algo.kl.coef == 0


def test_validation_lines(teacher_dir):
    (msg,) = _problems(["algo=opd"])
    assert_clear(msg, "algo.estimator=distill", "algo.teacher.path=")
    (msg,) = _problems(["algo=grpo", f"algo.teacher.path={teacher_dir}"])
    assert_clear(msg, "algo.teacher.path", "algo.estimator=grpo", "algo=opd")
    (msg,) = _problems(["algo=opd", f"algo.teacher.path={teacher_dir}", "algo.teacher.divergence=jsd",
                        "algo.teacher.beta=1.0"])
    assert_clear(msg, "algo.teacher.beta=1.0", "reverse_kl")
    (msg,) = _problems(["algo=opd", f"algo.teacher.path={teacher_dir}", "algo.teacher.divergence=fwd"])
    assert_clear(msg, "algo.teacher.divergence='fwd'", "reverse_kl, jsd")
    (msg,) = _problems(["algo=opd", f"algo.teacher.path={teacher_dir}", "algo.teacher.vocab=100"])
    assert_clear(msg, "100 tokens", "the student's tokenizer")


def test_the_plan_counts_the_teacher_in_both_placements(teacher_dir):
    from rlhf.plan.memory import estimate, host_gb, param_count, teacher_of
    from rlhf.plan.render import render_plan

    base = ["algo=opd", f"algo.teacher.path={teacher_dir}", "model=qwen2.5-0.5b", *QWEN15]
    hybrid = planned_spec([*base, "hardware=1xh200"])
    tm = teacher_of(hybrid)
    assert tm.n_layers == 28 and param_count(tm) > 3 * param_count(hybrid.model)
    gb = 2 * param_count(tm) / 1e9  # bf16 weights, one rank
    est = estimate(hybrid)
    assert est.figures["training phase"]["teacher weights"] == pytest.approx(gb, rel=0.08)
    assert est.figures["training phase"]["teacher pass"] > 0
    assert est.figures["generation phase"]["teacher weights (resident)"] == pytest.approx(gb, rel=0.08)
    text = render_plan(hybrid)
    assert "teacher:" in text and "resident" in text and "teacher weights" in text

    offloaded = planned_spec([*base, "hardware=1xh200", "algo.teacher.offload=true"])
    est = estimate(offloaded)
    assert "teacher weights (resident)" not in est.figures["generation phase"]
    assert host_gb(offloaded)["teacher (offloaded)"] == pytest.approx(gb, rel=0.08)
    assert "offloaded to host memory" in render_plan(offloaded)

    dis = planned_spec([*base, "hardware=8xh100", "placement=disaggregated", "placement.teacher=2"])
    assert len(dis.layout.roles["teacher"]) == 2 and not set(dis.layout.roles["teacher"]) & set(dis.layout.roles["actor"])
    fig = estimate(dis).figures["teacher"]
    assert fig["teacher weights"] == pytest.approx(gb, rel=0.08) and fig["teacher pass"] > 0
    assert "device 4-5: teacher" in render_plan(dis) or "teacher" in render_plan(dis).split("placement")[1]


def test_lora_student_keeps_the_teacher(teacher_dir):
    spec = planned_spec(["algo=opd", f"algo.teacher.path={teacher_dir}", "model.lora.rank=4"])
    assert "teacher" in spec.roles and "reference" not in spec.roles


@pytest.mark.parametrize("placement", [[], ["placement=disaggregated", "hardware.devices_per_node=3"]],
                         ids=["hybrid", "disaggregated"])
def test_the_cpu_plan_counts_the_teacher(teacher_dir, capsys, placement):
    """`rlhf-run algo=opd --plan` on CPU (the default hardware) prints one host-memory line; the
    teacher's weights and pass are in it in either placement (disaggregated: each role's process)."""
    import re

    from rlhf import cli
    from rlhf.plan.memory import estimate, param_count, teacher_of

    # a 1.5B-shaped teacher (the student's 22-token vocabulary): its fp32 weights, ~5 GB, dwarf the student
    args = ["algo=opd", f"algo.teacher.path={teacher_dir}", *[o for o in QWEN15 if "vocab" not in o], *placement]
    spec = planned_spec(args)
    assert spec.layout.one_pool == (not placement)
    weights = 4 * param_count(teacher_of(spec)) / 1e9
    assert weights > 4
    assert cli.main([*args, "--plan"]) == 0
    out = capsys.readouterr().out
    assert ("resident" if not placement else "own devices [1]") in out
    (host,) = re.findall(r"memory: CPU run; model states ~([0-9.]+) GB of host memory", out)
    figures = estimate(spec).figures
    parts = figures["training phase"] if not placement else {**figures["actor"], **figures["teacher"]}
    assert float(host) == pytest.approx(sum(parts.values()), abs=0.006)  # printed to 2 decimals
    assert parts["teacher weights"] == pytest.approx(weights, rel=0.01) and float(host) > weights

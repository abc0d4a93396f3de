"""The validation rules, one section at a time (rlhf.spec.rules): each rule called alone on the
typed sections of a composed config, silent on the defaults, one message naming the key, the value
and a fix for a bad value; and how rlhf.spec.validate chains them."""

from dataclasses import replace

import pytest

from rlhf.config import compose
from rlhf.spec.build import needed_roles, typed_config
from rlhf.spec.rules import algo, data, model, placement, rollout, run, train
from rlhf.spec.validate import validate

RL_ROLES = ("actor", "reference", "rollout")


def sections(*overrides: str) -> dict:
    return typed_config(compose(list(overrides)))


def with_(s: dict, section: str, **values) -> dict:
    return {**s, section: replace(s[section], **values)}


def roles_of(s: dict) -> tuple[str, ...]:
    return needed_roles(s["algo"], s["reward"], s["model"].lora.rank)


@pytest.fixture(scope="module")
def rl():
    return sections()


@pytest.fixture(scope="module")
def dpo():
    return sections("algo=dpo")


def test_the_defaults_break_no_rule(rl, dpo):
    for s in (rl, dpo):
        roles = roles_of(s)
        assert algo.problems(s, roles) == []
        assert model.problems(s) == []
        assert placement.device_counts(s) == [] and placement.problems(s, roles) == []
        assert rollout.problems(s, roles) == [] and rollout.env_problems(s) == []
        assert train.problems(s, roles) == []
        assert data.problems(s) == [] and data.reward_problems(s) == []
        assert run.problems(s) == []
        assert validate(s, roles) == []


def test_algo_rules(rl, dpo):
    assert algo.problems(with_(rl, "algo", estimator="nope"), RL_ROLES)[0].startswith("algo.estimator='nope'")
    [msg] = algo.problems(with_(rl, "algo", group_size=1), RL_ROLES)
    assert "algo.group_size=1" in msg and "at least 2" in msg
    [msg] = algo.problems(with_(rl, "algo", async_steps=1, tis_cap=None), RL_ROLES)
    assert "algo.async_steps=1" in msg and "algo.tis_cap" in msg
    [msg] = algo.problems(with_(rl, "algo", lr=0.0), RL_ROLES)
    assert msg == "algo.lr=0.0 must be > 0."
    [msg] = algo.problems(with_(dpo, "algo", beta=0.0), ("actor", "reference"))
    assert msg.startswith("algo.beta=0.0 must be > 0")
    [msg] = algo.problems(with_(dpo, "algo", loss_type="nope"), ("actor", "reference"))
    assert msg == "algo.loss_type='nope' is not valid. Choose one of: sigmoid, ipo, hinge, kto, orpo, simpo."


def test_model_rules(rl):
    [msg] = model.problems(with_(rl, "model", dtype="float8"))
    assert msg == "model.dtype='float8' is not valid. Choose one of: bfloat16, float16, float32."
    [msg] = model.problems(with_(rl, "model", dtype="float16"))  # the default hardware is a CPU
    assert "float16 is not supported on CPU" in msg
    [msg] = model.problems(with_(rl, "model", liger_kernels=True))
    assert "model.liger_kernels=true needs a CUDA GPU" in msg
    [msg] = model.problems(with_(rl, "model", lora=replace(rl["model"].lora, rank=-1)))
    assert msg.startswith("model.lora.rank=-1 must be >= 0")
    rm = sections("algo=rm")
    [msg] = model.lora_problems(with_(rm, "model", lora=replace(rm["model"].lora, rank=8)))
    assert "Set model.lora.rank=0" in msg


def test_rollout_and_env_rules(rl):
    [msg] = rollout.problems(with_(rl, "rollout", temperature=0.0), RL_ROLES)
    assert msg.startswith("rollout.temperature=0.0 must be > 0")
    assert rollout.problems(with_(rl, "rollout", temperature=0.0), ("actor",)) == []  # no sampling, no rule
    [msg] = rollout.problems(with_(rl, "rollout", engine="nope"), RL_ROLES)
    assert msg.startswith("rollout.engine='nope' is not valid. Choose one of: auto, ")
    [msg] = rollout.engine_problems(with_(rl, "rollout", engine="vllm"))
    assert "rollout.engine=vllm needs GPUs" in msg
    s = with_(rl, "env", fn="envs.keymap", max_turns=0)
    assert [m.split("=")[0] for m in rollout.env_problems(s)] == ["env.fn", "env.max_turns"]


def test_placement_rules(rl):
    [msg] = placement.device_counts(with_(rl, "hardware", nodes=0))
    assert "hardware.nodes=0" in msg
    [msg] = placement.problems(with_(rl, "hardware", host_memory_gb=-1), RL_ROLES)
    assert msg.startswith("hardware.host_memory_gb=-1 must be >= 0")
    [msg] = placement.problems(with_(rl, "placement", mode="nope"), RL_ROLES)
    assert msg.startswith("placement.mode='nope' is not valid")


def test_train_rules(rl):
    [msg] = train.problems(with_(rl, "train", steps=0), RL_ROLES)
    assert msg == "train.steps=0 must be >= 1."
    [msg] = train.problems(with_(rl, "train", zero_stage=5), RL_ROLES)
    assert msg.startswith("train.zero_stage=5 is not a ZeRO stage")
    [msg] = train.problems(with_(rl, "train", compile_logprobs=True), RL_ROLES)
    assert "train.compile_logprobs=true needs a CUDA GPU" in msg
    seq = rl["rollout"].max_prompt_tokens + rl["rollout"].max_response_tokens
    [msg] = train.problems(with_(rl, "train", max_tokens_per_micro_batch=seq - 1), RL_ROLES)
    assert f"Use train.max_tokens_per_micro_batch={seq} or more" in msg


def test_batch_math(rl):
    """2 ranks: 3 prompts × 4 samples split, 3 × 1 do not; a micro-batch must divide a rank's share."""
    two = with_(rl, "hardware", devices_per_node=2)
    assert train.batch_problems(with_(two, "train", prompts_per_step=3), RL_ROLES) == []
    odd = with_(with_(two, "train", prompts_per_step=3), "algo", group_size=1)
    [msg] = train.batch_problems(odd, RL_ROLES)
    assert "do not split evenly over the actor's 2 data-parallel ranks" in msg
    assert "Use train.prompts_per_step=2 (or 4)" in msg
    share = rl["train"].prompts_per_step * rl["algo"].group_size // 2
    micro = next(m for m in range(2, share) if share % m)
    [msg] = train.batch_problems(with_(two, "train", micro_batch_size=micro), RL_ROLES)
    assert f"train.micro_batch_size={micro} does not divide the {share} samples" in msg
    # with the batch math off (the placement failed), only the section's own keys
    assert train.problems(odd, RL_ROLES, batch_math=False) == []


def test_data_and_reward_rules(rl):
    [msg] = data.problems(with_(rl, "data", train_files=()))
    assert msg.startswith("data.train_files is empty")
    [msg] = data.problems(with_(rl, "data", columns=("question",)))
    assert msg.startswith("data.columns[0]='question' must be old:new")
    [msg] = data.reward_problems(with_(rl, "reward", functions=(), model_path=None, remote=None))
    assert msg.startswith("this RL run has no reward")
    [msg] = data.reward_problems(with_(rl, "reward", timeout_s=0))
    assert msg == "reward.timeout_s=0 must be > 0."
    [msg] = data.reward_problems(with_(rl, "reward", memory_gb=-1.0))
    assert msg.startswith("reward.memory_gb=-1.0 must be >= 0")
    assert data.reward_problems(with_(rl, "reward", memory_gb=0.0)) == []
    for isolate in ("auto", True, False):
        assert data.reward_problems(with_(rl, "reward", isolate=isolate)) == []
    [msg] = data.reward_problems(with_(rl, "reward", isolate="yes"))
    assert msg.startswith("reward.isolate='yes' is not valid. Use auto (your functions in a process of their own")


def test_run_rules(rl):
    [msg] = run.problems(with_(rl, "tracking", console="fancy"))
    assert msg == "tracking.console='fancy' is not valid. Choose one of: rich, plain, verbose, none."
    [msg] = run.problems(with_(rl, "checkpoint", keep_last=0))
    assert msg == "checkpoint.keep_last=0 must be >= 1."
    [msg] = run.eval_problems(with_(with_(rl, "eval", every=5), "data", eval_files=()))
    assert msg.startswith("eval.every=5 but data.eval_files is empty")
    [msg] = run.problems({**rl, "mode": "go"})
    assert msg == "mode='go' is not valid. Choose one of: run, plan."


def test_validate_chains_the_rules_and_skips_what_a_problem_makes_meaningless(rl):
    """Every section's problem at once; no device counts stops the rules that count devices; a bad
    placement skips the batch math over its ranks."""
    s = with_(with_(rl, "train", steps=0), "checkpoint", keep_last=0)
    s = with_(s, "algo", lr=0.0)
    assert validate(s, RL_ROLES) == ["algo.lr=0.0 must be > 0.", "train.steps=0 must be >= 1.",
                                     "checkpoint.keep_last=0 must be >= 1."]
    no_devices = with_(with_(rl, "hardware", nodes=0), "train", steps=0)
    assert [m.split(",")[0] for m in validate(no_devices, RL_ROLES)] == ["hardware.nodes=0"]
    odd = with_(with_(rl, "hardware", devices_per_node=5), "train", prompts_per_step=3)  # 3 × 8 over 5 ranks
    assert [m for m in validate(odd, RL_ROLES) if "split evenly" in m]
    bad_place = with_(odd, "placement", mode="nope")
    assert [m.split("=")[0] for m in validate(bad_place, RL_ROLES)] == ["placement.mode"]

"""Bad inputs: exit code 2, one readable message that names the value and a fix, no traceback."""

from __future__ import annotations

import pytest

from rlhf import cli

L8 = ["model=llama3-8b", "hardware=8xh100"]

# (command line, substrings the message must contain)
BAD = [
    # unknown group options list the valid ones
    (["algo=grpoo"], ["algo 'grpoo' not found", "Choose one of: cispo, dapo, dpo, dr_grpo, grpo, gspo, kto, opd, orpo, ppo, reinforce_pp"]),
    (["model=gpt5"], ["model 'gpt5' not found", "llama3-8b", "qwen2.5-0.5b"]),
    (["hardware=8xh200"], ["hardware '8xh200' not found", "8xh100", "1xh200"]),
    (["placement=colocated"], ["placement 'colocated' not found", "Choose one of: disaggregated, hybrid"]),
    (["recipe=nope"], ["recipe 'nope' not found", "grpo_tiny"]),
    (["model_defaults=big"], ["model_defaults=big", "pick model= instead"]),
    # unknown keys name the key path
    (["algo.lrr=3"], ["algo.lrr is not a config key of algo (RLAlgo)", "Did you mean algo.lr?"]),
    (["foo=bar"], ["foo is not a config key", "Known keys: algo, model"]),
    (["placement.rollout.tp=2"], ["placement.rollout.tp is not a config key", "tensor_parallel"]),
    (["++algo.lrr=1"], ["algo.lrr is not a config key", "Did you mean algo.lr?"]),
    (["algo=ppo", "algo.critic.lrr=1"], ["algo.critic.lrr is not a config key", "Did you mean algo.critic.lr?"]),
    # wrong types name the key, the value and the expected type
    (["algo.lr=abc"], ["algo.lr=abc: expected a float, got 'abc'", "1e-6"]),
    (["train.steps=1.5"], ["train.steps=1.5: expected an integer"]),
    (["train.zero_stage=x"], ["train.zero_stage='x' is not a ZeRO stage", "Use auto (the plan picks), 0, 1, 2 or 3"]),
    (["train.zero_stage=true"], ["train.zero_stage=True is not a ZeRO stage", "Use auto"]),
    (["train.offload_optimizer=maybe"], ["train.offload_optimizer='maybe' is not valid", "Use auto", "true or false"]),
    (["placement.offload_train_state=1"], ["placement.offload_train_state=1 is not valid", "Use auto"]),
    (["train.max_tokens_per_micro_batch=10"],
     ["train.max_tokens_per_micro_batch=10 is less than one sequence", "= 20 tokens",
      "Use train.max_tokens_per_micro_batch=20 or more, or null"]),
    (["algo=sft", "data.max_length=1"], ["data.max_length=1 leaves no room for a prompt and a response token",
                                         "Use 2 or more, or null"]),
    (["algo.normalize_std=maybe"], ["algo.normalize_std=maybe: expected a boolean", "true or false"]),
    (["data.train_files=abc"], ["data.train_files=abc: expected a list", "data.train_files=[abc]"]),
    (["train=foo"], ["train=foo: train is a section", "train.KEY=VALUE"]),
    # a critic with an algorithm that has none
    (["algo.critic.lr=1"], ["algo.critic.lr=1: algo=grpo has no critic", "only gae does", "algo=ppo"]),
    (["+algo.critic.lr=1"], ["+algo.critic.lr=1: algo=grpo has no critic", "algo=ppo"]),
    (["algo=rloo", "algo.critic={lr:1}"], ["algo=rloo has no critic", "estimator rloo"]),
    (["algo=ppo", "algo.critic=null"], ["algo.estimator=gae needs a critic", "algo.critic.lr"]),
    (["algo=rloo", "algo.whiten_advantages=false"],
     ["algo.whiten_advantages=false only applies to estimators that whiten", "rloo", "Drop the override"]),
    # override syntax
    (["+algo.lr=3"], ["algo.lr already exists", "algo.lr=VALUE"]),
    (["~algo.foo"], ["cannot delete algo.foo", "no such key"]),
    (["algo.lr"], ["cannot parse the override 'algo.lr'", "KEY=VALUE"]),
    (["--foo"], ["unknown option '--foo'", "--plan"]),
    (["algo=grpo,ppo"], ["algo=grpo,ppo: a sweep of values needs -m"]),
    (["algo.lr=1e-6,2e-6"], ["algo.lr=1e-6,2e-6: a sweep of values needs -m", "rlhf-run -m algo.lr=1e-6,2e-6"]),
    (["algo.kind=dpo"], ["algo.kind='dpo' cannot be set", "algo=<name>"]),
    (["-cp", "/nonexistent/run", "-cn", "config"], ["no config config.yaml in /nonexistent/run", "-cp outputs/"]),
    # placement: tensor parallelism, device counts
    (["placement.rollout.tensor_parallel=3", *L8],
     ["placement.rollout.tensor_parallel=3 does not divide the 8 GPUs of a node", "Use one of: 1, 2, 4, 8"]),
    (["placement.rollout.tensor_parallel=4", "model=qwen2.5-0.5b", "hardware=8xh100"],
     ["tensor_parallel=4 does not split the 14 attention heads", "Use one of: 1, 2."]),
    (["placement.rollout.tensor_parallel=16", *L8],
     ["tensor_parallel=16 must be between 1 and the GPUs of one node", "devices_per_node=8"]),
    (["placement=disaggregated", "placement.actor=8", *L8],
     ["needs 11 devices (actor 8, reference 1, rollout 2) but hardware=8xh100 has 8", "placement=hybrid"]),
    (["placement=disaggregated", "placement.rollout.engines=5", "placement.rollout.tensor_parallel=2", *L8],
     ["needs 12 devices (actor 1, reference 1, rollout 10) but hardware=8xh100 has 8"]),
    (["placement.rollout.engines=16", *L8],
     ["placement.rollout.engines=16 × tensor_parallel=1 needs 16 devices, but hardware=8xh100 has 8",
      "placement.rollout.engines=8"]),
    (["placement.actor=2"], ["placement.actor=2 only applies to placement=disaggregated"]),
    (["placement=disaggregated", "placement.critic=2", *L8],
     ["placement.critic=2 gives devices to a role this run does not have (algo=grpo)", "placement.critic=0"]),
    # impossible batch math gives the numbers and a nearby valid setting
    (["algo=ppo", "algo.group_size=1", "train.prompts_per_step=12", *L8],
     ["12 samples of an optimizer step", "8 data-parallel ranks", "Use train.prompts_per_step=8 (or 16)"]),
    (["train.prompts_per_step=10", *L8],
     ["train.micro_batch_size=8 does not divide the 10 samples", "(80 / 8)", "Use train.micro_batch_size=5"]),
    (["algo.mini_batch_size=100", *L8],
     ["algo.mini_batch_size=100 does not divide", "128 × algo.group_size=8 = 1024 samples",
      "Use algo.mini_batch_size=64 (or 128)"]),
    # algorithm and other values
    (["algo.group_size=1"], ["algo.group_size=1: grpo compares samples of the same prompt", "algo.group_size=4"]),
    (["algo.kl.estimator=k4"], ["algo.kl.estimator='k4' is not valid", "Choose one of: k1, k2, k3"]),
    (["algo=dpo", "algo.loss_type=foo"], ["algo.loss_type='foo'", "sigmoid, ipo, hinge"]),
    (["model.dtype=float16"], ["model.dtype=float16 is not supported on CPU", "float32"]),
    (["rollout.engine=vllm"], ["rollout.engine=vllm needs GPUs but hardware=cpu", "rollout.engine=hf"]),
    (["rollout.gpu_memory_utilization=1.5", *L8], ["rollout.gpu_memory_utilization=1.5 must be in (0, 1)"]),
    (["tracking.backend=neptune"], ["tracking.backend='neptune'", "mlflow, tensorboard, wandb, none"]),
    (["hardware.nodes=0"], ["hardware.nodes=0", "must be >= 1"]),
    (["model.name=???"], ["model.name is required but not set", "model.name=VALUE"]),
    (["train.offload_optimizer=true", "train.zero_stage=0"],
     ["train.offload_optimizer=true needs ZeRO", "train.zero_stage=2 or 3"]),
    # reward services, environments, async rollouts
    (["reward=remote", "reward.remote.urls=[]"], ["reward.remote.urls is empty", "rlhf-reward-server"]),
    (["reward=remote", "reward.remote.urls=[localhost:8000]", "reward.remote.concurrency=0"],
     ["reward.remote.urls[0]='localhost:8000' must start with http://", "reward.remote.concurrency=0 must be >= 1"]),
    (["env.fn=rlhf.envs.keymap.KeymapChain"], ["env.fn='rlhf.envs.keymap.KeymapChain' must name a class as module:Class"]),
    (["algo.async_steps=1"], ["algo.async_steps=1 samples with a stale policy", "algo.tis_cap"]),
]


@pytest.mark.parametrize("argv,parts", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_with_one_readable_message(argv, parts, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert cli.main([*argv, "--plan"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    lines = err.rstrip("\n").split("\n")
    assert lines[0].startswith("error: ")
    assert all(l.startswith(("error: ", "       ")) for l in lines), err
    for part in parts:
        assert part in err, f"{part!r} not in:\n{err}"


def test_at_least_25_distinct_bad_inputs():
    assert len({tuple(a) for a, _ in BAD}) >= 25


def test_hydra_full_error_shows_the_traceback(monkeypatch):
    from rlhf.spec.errors import SpecError

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception) as e:
        cli.main(["algo.lr=abc", "--plan"])
    assert not isinstance(e.value, SpecError)  # Hydra's own exception, with its traceback
    with pytest.raises(SpecError):
        cli.main(["algo.kl.estimator=k4", "--plan"])


def test_entrypoint_exit_code_is_2(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["rlhf-run", "algo=grpoo", "--plan"])
    with pytest.raises(SystemExit) as e:
        cli.entrypoint()
    assert e.value.code == 2
    assert "algo 'grpoo' not found" in capsys.readouterr().err

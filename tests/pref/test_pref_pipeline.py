"""End to end through `rlhf-run` (launcher, Ray actors, DeepSpeed workers), toy size on CPU:

* SFT → reward model → PPO (recipes pipeline_sft / pipeline_rm / pipeline_ppo), each stage
  reading the previous stage's final/hf: SFT lowers the held-out loss, the reward model ranks
  >= 90% of held-out pairs right, PPO against it raises both its score and the task's true reward.
* DPO (recipe dpo_tiny): held-out preference accuracy >= 90%; so do KTO, ORPO and SimPO (algo=kto|orpo|simpo
  on the same data, KTO three epochs).
* an SFT run stopped after its first epoch and resumed from its checkpoint ends where the
  uninterrupted pipeline SFT stage ended.
* the SFT stage (a checkpoint every 16 of its steps, both kept) writes no more checkpoints than the
  disk plan counts from its data (rlhf.plan.disk.supervised_steps).

Every run is in this process, on the session's local Ray (tests/conftest.py ``rl_env``).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import record_learning, with_test_seed

QUIET = ["tracking=none", "tracking.console=plain"]
# the SFT stage's checkpoints: every 16 of its 32 steps, none rotated away (keep_last 2; counted by a test)
SFT_CHECKPOINTS = ["checkpoint.every=16"]


@pytest.fixture(scope="module")
def pipeline(rl_env, tmp_path_factory):
    """Runs the three recipes once, each stage reading the previous one's final/hf."""
    root = tmp_path_factory.mktemp("pipeline")
    mp = pytest.MonkeyPatch()
    mp.setenv("RLHF_PIPELINE_DIR", str(root))
    try:
        for stage in ("sft", "rm", "ppo"):
            _run(f"recipe=pipeline_{stage}", *(SFT_CHECKPOINTS if stage == "sft" else []))
    finally:
        mp.undo()
    return root


def _run(*args) -> None:
    from rlhf.cli import main

    assert main(with_test_seed([*args, *QUIET])) == 0


def _final(path) -> dict:
    return json.loads((path / "final" / "metrics.json").read_text())


def _steps(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _mean(rows, key) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_sft_lowers_held_out_loss(pipeline):
    sft = _final(pipeline / "sft")
    print(f"SFT: held-out loss {sft['eval/loss_before']:.3f} -> {sft['eval/loss_after']:.3f}")
    record_learning("pref/sft", "held-out loss fall, 1 - after/before", 1 - sft["eval/loss_after"] / sft["eval/loss_before"], 0.5)
    assert sft["eval/loss_after"] < 0.5 * sft["eval/loss_before"], sft
    assert (pipeline / "sft" / "final" / "hf" / "config.json").exists()


def test_sft_writes_no_more_checkpoints_than_the_disk_plan_counts(pipeline, monkeypatch):
    """The plan's saves of the stage (its rows counted in the files, before reading them) against
    the checkpoints the run committed: every 16 steps of 2 epochs of 512 rows, 32 a step."""
    from rlhf.ckpt.manager import CheckpointManager
    from rlhf.plan import disk
    from tests.helpers import planned_spec

    monkeypatch.setenv("RLHF_PIPELINE_DIR", str(pipeline))
    spec = planned_spec(["recipe=pipeline_sft", *SFT_CHECKPOINTS])
    written = [c.step for c in CheckpointManager(pipeline / "sft", every=0, keep_last=1).complete()]
    steps = [r["step"] for r in _steps(pipeline / "sft") if "train/loss" in r]
    need = disk.need(spec)
    assert written == [16, 32] and len(steps) == 32, (written, len(steps))
    assert need.saves == len(written) and need.steps.steps == len(steps), need  # a bound, here exact
    assert need.checkpoints >= len(written) and need.final  # both alive beside final/ at the end


def test_reward_model_ranks_held_out_pairs(pipeline):
    rm = _final(pipeline / "rm")
    print(f"RM: held-out accuracy {rm['eval/accuracy_before']:.3f} -> {rm['eval/accuracy_after']:.3f}")
    record_learning("pref/rm", "held-out pair accuracy", rm["eval/accuracy_after"], 0.9)
    assert rm["eval/accuracy_after"] >= 0.9, rm
    cfg = json.loads((pipeline / "rm" / "final" / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and len(cfg["id2label"]) == 1


def test_ppo_against_the_reward_model_raises_its_score_and_the_true_reward(pipeline):
    steps = _steps(pipeline / "ppo")
    first, last = steps[:2], steps[-4:]
    true_before, true_after = _mean(first, "reward/keymap_reward/mean"), _mean(last, "reward/keymap_reward/mean")
    rm_before, rm_after = _mean(first, "reward/model/mean"), _mean(last, "reward/model/mean")
    print(f"PPO: true reward {true_before:.3f} -> {true_after:.3f}, RM score {rm_before:.3f} -> {rm_after:.3f}")
    record_learning("pref/ppo-vs-rm", "true reward gain", true_after - true_before, 0.05)
    record_learning("pref/ppo-vs-rm", "RM score gain", rm_after - rm_before, 0.0)
    assert true_after > true_before + 0.05
    assert rm_after > rm_before


def test_sft_resumed_from_a_checkpoint_equals_the_uninterrupted_run(pipeline, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_PIPELINE_DIR", str(pipeline))
    run_dir = tmp_path / "sft"
    _run("recipe=pipeline_sft", "algo.epochs=1", f"output_dir={run_dir}")  # stops after epoch 1 (a checkpoint)
    from rlhf.cli import main

    assert main([f"resume={run_dir}", "algo.epochs=2", "tracking.backend=none", "tracking.console=plain"]) == 0
    resumed, whole = _final(run_dir), _final(pipeline / "sft")
    assert resumed["eval/loss_after"] == pytest.approx(whole["eval/loss_after"], rel=1e-6)
    losses = lambda rows: [r["train/loss"] for r in rows if "train/loss" in r]  # noqa: E731
    assert losses(_steps(run_dir)) == pytest.approx(losses(_steps(pipeline / "sft")), rel=1e-6)


@pytest.mark.parametrize("placement", [
    [],
    # the reference in its own worker process, which the loop releases (drop_models, then killed)
    ["placement=disaggregated", "hardware.devices_per_node=2"],
], ids=["hybrid", "disaggregated"])
def test_dpo_preference_accuracy(rl_env, tmp_path, placement):
    _run("recipe=dpo_tiny", *placement, f"output_dir={tmp_path / 'dpo'}")
    dpo = _final(tmp_path / "dpo")
    print(f"DPO: held-out accuracy {dpo['eval/accuracy_before']:.3f} -> {dpo['eval/accuracy_after']:.3f}")
    record_learning(f"pref/dpo-{'disaggregated' if placement else 'hybrid'}", "held-out pair accuracy",
                    dpo["eval/accuracy_after"], 0.9)
    assert dpo["eval/accuracy_after"] >= 0.9, dpo
    assert dpo["eval/margin_after"] > 0


# KTO, ORPO and SimPO with their conf/algo defaults on dpo_tiny's data; KTO trains on the pairs split
# into unpaired examples (twice the units, each half a pair's signal) and needs three epochs
PREFERENCE_METHODS = {"kto": ["algo.epochs=3"], "orpo": [], "simpo": []}


@pytest.mark.parametrize("algo", sorted(PREFERENCE_METHODS))
def test_preference_method_accuracy(rl_env, tmp_path, algo):
    _run("recipe=dpo_tiny", f"algo={algo}", *PREFERENCE_METHODS[algo], f"output_dir={tmp_path / algo}")
    out = _final(tmp_path / algo)
    print(f"{algo}: held-out accuracy {out['eval/accuracy_before']:.3f} -> {out['eval/accuracy_after']:.3f}")
    record_learning(f"pref/{algo}", "held-out pair accuracy", out["eval/accuracy_after"], 0.9)
    assert out["eval/accuracy_after"] >= 0.9, out
    assert out["eval/margin_after"] > 0
    if algo == "kto":  # trained unpaired: half the step's examples desirable, the other half not
        steps = [r for r in _steps(tmp_path / algo) if "train/desirable_share" in r]
        assert 0.4 < _mean(steps, "train/desirable_share") < 0.6 and all(r["train/kl_z0"] >= 0 for r in steps)


def test_a_dpo_micro_batch_holds_what_the_plan_sizes_it_for(rl_env, tmp_path, capsys):
    """Pairs longer than data.max_length (bench.matrix.long_rows), a model whose tokenizer reads them
    (byte-level BPE): every micro-batch holds exactly the tokens the plan sizes the pass for, 8 pairs
    × 2 sequences × data.max_length (rlhf.spec.tokens), the memory plan's bound met, not exceeded."""
    import re

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.common import build_tokenizer
    from bench.matrix import long_rows
    from rlhf.cli import main

    tok = build_tokenizer()
    model = tmp_path / "model"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).save_pretrained(model)
    tok.save_pretrained(model)
    long_rows(tmp_path / "data", "preference", n=32, n_eval=8)
    args = ["recipe=dpo_tiny", f"model.path={model}", f"data.train_files=[{tmp_path / 'data' / 'train.jsonl'}]",
            f"data.eval_files=[{tmp_path / 'data' / 'eval.jsonl'}]", "data.max_length=48", "train.micro_batch_size=8",
            "train.prompts_per_step=16", f"output_dir={tmp_path / 'run'}", *QUIET]
    assert main([*args, "--plan"]) == 0
    planned = int(re.search(r"≤ (\d+) tokens per micro-batch", capsys.readouterr().out).group(1))
    assert planned == 8 * 2 * 48
    _run(*args)
    packed = [json.loads(x).get("perf/micro_batch_tokens_max") for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [p for p in packed if p is not None] and all(p == planned for p in packed if p is not None), packed

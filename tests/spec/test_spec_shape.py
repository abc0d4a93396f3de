"""The plan describes the model that will load: ``model.path``'s own config.json replaces the model
group's architecture numbers (rlhf.spec.shape), for a local dir, a cached Hub snapshot, and a Hub
model fetched after the spec was built (rlhf.preflight.resolve_models builds it again)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.spec.build import build, config_dict
from rlhf.plan.memory import param_count
from rlhf.plan.render import render_plan
from rlhf.spec.shape import read_shape, shape_of
from tests.helpers import make_spec

# a Qwen2.5-1.5B-shaped config.json, as transformers writes it
QWEN15 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 1536,
          "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def _checkpoint(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # the plan never reads the weights
    return folder


def test_read_shape_of_configs_transformers_writes(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "llama")
    got = read_shape(json.loads((tmp_path / "llama" / "config.json").read_text()))
    assert got == {"n_layers": 3, "hidden": 96, "intermediate": 200, "n_heads": 6, "n_kv_heads": 2, "vocab": 300,
                   "tie_embeddings": True}
    # GPT-2 names, no grouped-query attention, n_inner null = 4 × hidden
    GPT2Config(vocab_size=500, n_embd=64, n_layer=5, n_head=4, n_inner=None).save_pretrained(tmp_path / "gpt2")
    got = read_shape(json.loads((tmp_path / "gpt2" / "config.json").read_text()))
    assert got == {"n_layers": 5, "hidden": 64, "intermediate": 256, "n_heads": 4, "n_kv_heads": 4, "vocab": 500,
                   "tie_embeddings": True}
    # a multimodal model's numbers sit in text_config
    assert read_shape({"model_type": "x", "tie_word_embeddings": False, "text_config": QWEN15})["hidden"] == 1536
    assert read_shape({"model_type": "x", "tie_word_embeddings": False, "text_config": QWEN15})["tie_embeddings"] is False
    assert read_shape({"hidden_size": 64}) is None  # a number the plan needs is missing


def test_a_local_checkpoint_of_another_shape_is_planned_as_itself(tmp_path):
    ckpt = _checkpoint(tmp_path / "m15", QWEN15)
    ov = ["model=qwen2.5-0.5b", "hardware=1xh200", "placement=hybrid", "algo=grpo", f"model.path={ckpt}"]
    spec = make_spec(ov, tmp_path / "run")
    assert shape_of(spec.model) == read_shape(QWEN15)
    assert param_count(spec.model) == pytest.approx(1.54e9, rel=0.01)  # Qwen2.5-1.5B, not 0.49 B
    plan = render_plan(spec)
    assert "1.54 B parameters" in plan
    assert f"shape from {ckpt / 'config.json'}: n_layers 28, hidden 1536" in plan
    assert "(the model group qwen2.5-0.5b says 24, 896" in plan
    # the saved config keeps the group's numbers (the checkpoint is read again), and rebuilds the same spec
    cfg = config_dict(spec)
    assert cfg["model"]["hidden"] == 896
    assert build(cfg, overrides=spec.overrides, changes=spec.changes) == spec
    # the group's own checkpoint: nothing to say
    same = make_spec(["model=qwen2.5-1.5b", "hardware=1xh200", "algo=grpo", f"model.path={ckpt}"], tmp_path / "r2")
    assert "shape from" not in render_plan(same)
    assert not [d for d in same.auto if d.key.split(".", 1)[1] in shape_of(same.model)]


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"qwen2"'])
def test_a_config_json_that_is_not_an_object_is_planned_with_the_group(text, tmp_path, capsys):
    from rlhf import cli
    from rlhf.spec.shape import model_type

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(text)
    assert model_type(str(ckpt)) is None
    assert cli.main(["model=qwen2.5-0.5b", "hardware=1xh200", "algo=grpo", f"model.path={ckpt}", "--plan"]) == 0
    assert "shape from" not in capsys.readouterr().out  # the model group's numbers, as for an unreadable one


def test_the_plan_counts_the_parameters_the_loaded_model_has(tmp_path):
    """The plan's parameter count (memory's basis) against the model transformers builds from the
    same checkpoint, for a shape unlike the model group's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    d = tmp_path / "ckpt"
    LlamaForCausalLM(cfg).save_pretrained(d)
    spec = make_spec(["model=tiny", f"model.path={d}"], tmp_path / "run")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(d)
    assert param_count(spec.model) == sum(p.numel() for p in loaded.parameters())


def test_a_cached_hub_snapshot_is_read_and_a_fetched_one_replans(tmp_path, monkeypatch):
    from tests.hub.hubserver import Repo, write_cache

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = Repo(files={"config.json": json.dumps(QWEN15).encode(), "model.safetensors": b""})
    ov = ["model=qwen2.5-0.5b", "hardware=1xh200", "algo=grpo", "model.path=acme/qwen-like"]
    before = make_spec(ov, tmp_path / "run")  # not cached yet: the group's numbers
    assert before.model.hidden == 896
    assert "planned with the model group's shape until then, and again with its config.json" in render_plan(before)
    write_cache(cache, "model", "acme/qwen-like", repo)
    cached = make_spec(ov, tmp_path / "run2")
    assert shape_of(cached.model) == read_shape(QWEN15)

    # built before the fetch, resolved after it (what rlhf.run does): planned again
    from rlhf.preflight import resolve_models

    lines = []

    class Say:
        print = staticmethod(lines.append)

    after = resolve_models(before, Say())
    assert shape_of(after.model) == read_shape(QWEN15)
    assert after.models["model"].repo == "acme/qwen-like"
    assert any(ln.startswith("planned again with the checkpoint's numbers: shape from") for ln in lines), lines

    # a fetched checkpoint whose heads the planned TP does not divide: one line naming its config.json
    from rlhf.spec.errors import UserError

    tp2 = make_spec([*ov[:-1], "model.path=acme/odd-heads", "hardware=8xh100", "placement.rollout.tensor_parallel=2"],
                    tmp_path / "run3")  # built before the fetch: the model group's 14 heads
    odd = {**QWEN15, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 1152}
    write_cache(cache, "model", "acme/odd-heads", Repo(files={"config.json": json.dumps(odd).encode(),
                                                              "model.safetensors": b""}))
    with pytest.raises(UserError) as e:
        resolve_models(tp2, Say())
    assert "\n" not in str(e.value) and "tensor_parallel=2" in str(e.value), e.value
    assert "config.json (model.path=acme/odd-heads)" in str(e.value) and "model=" not in str(e.value), e.value


def test_a_local_checkpoint_whose_heads_tp_does_not_split_names_its_config_json(tmp_path, capsys):
    from rlhf import cli

    ckpt = _checkpoint(tmp_path / "m14", {**QWEN15, "num_attention_heads": 14})
    assert cli.main(["model=llama3-8b", f"model.path={ckpt}", "placement.rollout.tensor_parallel=4",
                     "hardware=8xh100", "--plan"]) == 2
    err = capsys.readouterr().err
    assert f"the 14 attention heads (2 KV heads) of {ckpt / 'config.json'} (model.path={ckpt})" in err, err
    assert "llama3-8b" not in err, err

"""LoRA on the policy (model.lora, rlhf.models.lora).

* without Ray: after a few optimizer steps (B no longer zero) the merged state dict — what the
  object-store sync sends, and what the GPU transports' ``WeightSource`` packs bucket by bucket —
  equals W + (alpha/r)·B@A computed here in float64 from the peft module's lora_A / lora_B, under
  the base model's names, without touching the trained weights;
* one CPU GRPO run with LoRA (the shared Ray of tests/rl): it learns, and after the last sync the
  rollout engine's greedy output equals that of an HF model built from the exported merged weights
  (final/hf) and of the base model + the exported adapter (final/adapter).
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import fifth_means, make_spec, record_learning, run_rl

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_lora_model(seed: int = 0, arch: str = "llama"):
    """A tiny Llama, or a Qwen2 (attention biases, tied embeddings), with LoRA on every projection."""
    import transformers

    from rlhf.models.lora import apply_lora
    from rlhf.spec.schema import LoraSpec

    dims = dict(vocab_size=22, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**dims, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**dims), transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    base = cls(cfg)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, LoraSpec(rank=RANK, alpha=ALPHA, target_modules=list(TARGETS)), seed=seed)
    return cfg, model, initial


def _train_a_few_steps(model, steps: int = 3) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 22, (4, 8), generator=g)
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 22), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _sent(src) -> dict[str, torch.Tensor]:
    """What the GPU transports would send: every bucket of ``src`` packed and unpacked again."""
    from rlhf.workers.buckets import pack, unpack

    sent = {}
    for b in src.buckets:
        buf = torch.empty(src.max_bucket_bytes, dtype=torch.uint8)
        with src.gathered(b) as tensors:
            pack(b, tensors, buf)
        sent.update({name: t.clone() for name, t in unpack(buf, b.metas)})
    return sent


def _reference_merge(model, cfg) -> dict[str, torch.Tensor]:
    """W + (alpha/r)·B@A in float64, read from each peft LoRA module's lora_A / lora_B."""
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for t in TARGETS:
            parent = layer.self_attn if t in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            mod = getattr(parent, t)
            W = mod.base_layer.weight.detach().double()
            A = mod.lora_A["default"].weight.detach().double()
            B = mod.lora_B["default"].weight.detach().double()
            assert A.shape == (RANK, W.shape[1]) and B.shape == (W.shape[0], RANK)
            out[f"model.layers.{i}.{'self_attn' if parent is layer.self_attn else 'mlp'}.{t}.weight"] = \
                W + (ALPHA / RANK) * B @ A
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merged_weights_equal_w_plus_scaled_ba(arch):
    from transformers import AutoModelForCausalLM

    from rlhf.models.lora import merged_state_dict
    from rlhf.workers.sync_cuda import WeightSource
    from rlhf.workers.policy import PolicyWorker

    cfg, model, initial = _tiny_lora_model(arch=arch)
    _train_a_few_steps(model)
    model.eval()
    ref = _reference_merge(model, cfg)
    assert len(ref) == cfg.num_hidden_layers * len(TARGETS)
    assert all(float((r.float() - initial[k]).abs().max()) > 1e-4 for k, r in ref.items())  # B is not zero

    # the object-store sync: PolicyWorker.full_state_dict on rank 0 (ZeRO 0)
    worker = SimpleNamespace(engine=SimpleNamespace(module=model), rank=0,
                             spec=SimpleNamespace(train=SimpleNamespace(zero_stage=0)))
    worker.on_rank0 = functools.partial(PolicyWorker.on_rank0, worker)
    merged = PolicyWorker.full_state_dict(worker)
    assert set(merged) == set(initial)  # exactly the base model's names: no lora_A/B, no base_layer
    for k, v in merged.items():
        if k in ref:
            assert v.dtype == torch.float32
            torch.testing.assert_close(v.double(), ref[k], rtol=0, atol=1e-6)
        else:
            assert torch.equal(v, initial[k]), k  # frozen, and not a target: as loaded
    # the trained modules were not merged in place: W is still the loaded W, the forward still adds B·A
    for k in ref:
        w = model.get_submodule("base_model.model." + k.rsplit(".", 1)[0]).base_layer.weight
        assert torch.equal(w.detach(), initial[k]), k
    assert merged_state_dict(model).keys() == merged.keys()

    # a base model with the merged weights computes what the LoRA model computes
    plain = AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "qwen2":
        assert any(k.endswith("q_proj.bias") for k in merged) and plain.lm_head.weight is plain.model.embed_tokens.weight
    plain.load_state_dict(merged, strict=True)
    ids = torch.randint(0, 22, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)

    # the GPU transports: WeightSource packs the same tensors, bucket by bucket, under the same names
    src = WeightSource(model, bucket_bytes=8192, dtype=torch.float32)
    assert len(src.buckets) > 1 and not src.zero3
    sent = _sent(src)
    assert set(sent) == {n for n, _ in plain.named_parameters()}
    for k, v in sent.items():
        assert torch.equal(v, merged[k]), k
    assert src.total_bytes == 4 * sum(p.numel() for p in plain.parameters())


# ----------------------------------------------------------------------------- an RL run with LoRA

STEPS, EVERY = 60, 30  # checkpoints after steps 30 and 60 (the resume test starts from step 30)
MARGIN = 0.10  # last-fifth mean reward over the first fifth; measured 0.26, 0.27, 0.22 (seeds 1, 2, 3)
# The built-in tiny model is randomly initialised: its frozen lm_head (std 0.02) keeps every logit
# within about ±1.3, so adapters on the projections alone cannot make the policy confident. A
# pretrained model needs no such help; here lm_head gets an adapter too (also merged when synced).
LORA = ["algo=grpo", "train.prompts_per_step=16", "rollout.max_response_tokens=4", "train.seed=1",
        "model.lora.rank=16", "model.lora.alpha=32", "algo.lr=5e-3",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
        f"checkpoint.every={EVERY}", "tracking=none"]
KEYS = [f"key k{i}" for i in range(8)]  # every prompt of the built-in task (rlhf.data.builtin)


def _greedy():
    from rlhf.rollout.engine import Sampling

    return Sampling(n=1, max_new_tokens=4, temperature=1.0, top_k=1, seeds=tuple(range(len(KEYS))))


def _prompt_ids() -> list[list[int]]:
    from rlhf.models.builtin import build_tokenizer

    tok = build_tokenizer()
    return [tok(k)["input_ids"] for k in KEYS]


def _greedy_ids(model) -> list[list[int]]:
    from rlhf.models.builtin import build_tokenizer
    from rlhf.rollout.hf import HFEngine

    tok = build_tokenizer()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    return [s.response_ids for s in engine.generate(_prompt_ids(), _greedy())]


@pytest.fixture(scope="module")
def lora_run(rl_env, tmp_path_factory):
    """The LoRA GRPO run; before its cluster shuts down, the rollout engine's greedy responses to
    every prompt (after the last step's weight sync, the weights of final/hf)."""
    import ray

    import rlhf.loops.rl as rl_loop

    out = tmp_path_factory.mktemp("outputs") / "grpo_lora"
    probe: dict = {}
    loop = rl_loop.run

    def run_then_ask_the_engine(spec, cluster, *args, **kwargs):
        summary = loop(spec, cluster, *args, **kwargs)
        samples = ray.get(cluster.rollout.workers[0].generate.remote(_prompt_ids(), _greedy()))
        probe["greedy"] = [s.response_ids for s in samples]
        return summary

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_loop, "run", run_then_ask_the_engine)  # rlhf.run imports the loop when it runs
        code, rows = run_rl(LORA + [f"train.steps={STEPS}"], out)
    return {"code": code, "rows": rows, "dir": out, **probe}


def test_lora_grpo_learns(lora_run):
    assert lora_run["code"] == 0
    rows = lora_run["rows"]
    assert len(rows) == STEPS
    first, last = fifth_means(rows)
    record_learning("rl/lora-grpo", "reward gain, last fifth - first", last - first, MARGIN)
    assert last >= first + MARGIN, (first, last)


def test_lora_reference_is_the_actor_with_its_adapters_off(lora_run):
    """No reference workers: the KL term's reference is the actor with its adapters switched off,
    which at the start (B = 0) is the policy itself, and stays the base model as the adapters train."""
    rows = lora_run["rows"]
    assert abs(rows[0]["kl/mean"]) < 1e-6
    assert max(r["kl/mean"] for r in rows) > 1e-3
    spec = make_spec(LORA, lora_run["dir"] / "probe")
    assert spec.algo.kl.coef > 0 and "reference" not in spec.roles


def test_rollout_engine_runs_the_trainers_merged_weights(lora_run):
    """Greedy decoding is deterministic: the engine (synced weights), an HF model loaded from the
    exported merged weights, and the base model with the exported adapter must answer alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf.models.lora import adapter_dir

    hf = lora_run["dir"] / "final" / "hf"
    merged = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    assert not (hf / "adapter_config.json").exists()  # the adapter lies beside the merged model
    engine = lora_run["greedy"]
    assert len(engine) == len(KEYS) and all(engine)
    assert _greedy_ids(merged) == engine

    adapter = adapter_dir(hf)
    assert adapter == hf.parent / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    assert _greedy_ids(base) != engine  # the run changed what the policy answers
    assert _greedy_ids(PeftModel.from_pretrained(base, str(adapter))) == engine


def test_lora_checkpoint_holds_the_adapters_and_resumes(lora_run, tmp_path):
    """The DeepSpeed checkpoint keeps the trained adapters (not the frozen weights, which come from
    the model path); resuming from step 30 gives the steps that followed it, metric for metric."""
    ckpt = lora_run["dir"] / "checkpoints" / f"step_{EVERY:08d}"
    states = torch.load(next((ckpt / "actor" / "ds").glob("*model_states.pt")), weights_only=False)["module"]
    assert states and all(".lora_A." in k or ".lora_B." in k for k in states), list(states)[:5]

    code, rows = run_rl(LORA + [f"train.steps={EVERY + 2}", f"resume={ckpt}"], tmp_path / "resumed")
    assert code == 0
    ref = {r["step"]: r for r in lora_run["rows"]}
    assert [r["step"] for r in rows] == [EVERY + 1, EVERY + 2]
    for r in rows:
        for k, v in r.items():
            if not k.startswith(("time/", "throughput/", "perf/")):
                assert abs(v - ref[r["step"]][k]) <= 1e-6, (r["step"], k, v, ref[r["step"]][k])


# ----------------------------------------------------------------------------- ZeRO-3 and data parallel (slow)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def zero3_weight_source_check() -> None:
    """In a fresh process (it initialises torch.distributed): a LoRA model under DeepSpeed ZeRO-3
    (one CPU rank, gloo), trained a few steps; the GPU transports' ``WeightSource`` gathers W, A and
    B bucket by bucket and packs exactly the merged tensors of ``merged_state_dict``."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    from rlhf.models.lora import merged_state_dict
    from rlhf.workers.sync_cuda import WeightSource

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, model, _ = _tiny_lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    _train_a_few_steps_engine(engine)
    src = WeightSource(engine.module, bucket_bytes=8192, dtype=torch.float32)
    assert src.zero3 and len(src.buckets) > 1
    sent = _sent(src)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        merged = {k: v.clone() for k, v in merged_state_dict(engine.module).items()}
        ref = _reference_merge(engine.module, cfg)
    assert set(sent) == set(merged)  # untied: every state-dict tensor is a parameter, sent once
    for k, v in sent.items():
        assert torch.equal(v, merged[k]), k
    for k, r in ref.items():
        torch.testing.assert_close(sent[k].double(), r, rtol=0, atol=1e-6)
    print("zero3 weight source ok", flush=True)


def _train_a_few_steps_engine(engine, steps: int = 3) -> None:
    ids = torch.randint(0, 22, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        out = engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        engine.backward(torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 22), ids[:, 1:].reshape(-1)))
        engine.step()


@pytest.mark.slow
def test_zero3_weight_source_sends_merged_weights():
    import subprocess
    import sys

    code = "from tests.rl.test_rl_lora import zero3_weight_source_check as check; check()"
    r = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "zero3 weight source ok" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.slow
def test_lora_zero3_on_two_ranks_equals_one_rank(lora_run, tmp_path):
    """Two data-parallel ranks under ZeRO-3 (adapters initialised alike on both, weights gathered
    and merged for the sync) give the single-rank run's first steps."""
    n = 3
    code, rows = run_rl(LORA + [f"train.steps={n}", "hardware.devices_per_node=2", "train.zero_stage=3"],
                        tmp_path / "dp2_zero3")
    assert code == 0
    for a, b in zip(lora_run["rows"][:n], rows):
        for k in ("reward/mean", "reward/std", "kl/mean", "actor/pg_loss", "actor/entropy", "advantages/abs_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), (a["step"], k, a[k], b[k])

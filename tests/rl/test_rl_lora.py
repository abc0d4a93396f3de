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

from types import SimpleNamespace

import pytest
import torch

from tests.rl.conftest import fifth_means, run_rl

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_lora_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.models.lora import apply_lora
    from rlhf.spec.schema import LoraSpec

    cfg = LlamaConfig(vocab_size=22, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    base = LlamaForCausalLM(cfg)
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


def test_merged_weights_equal_w_plus_scaled_ba():
    from transformers import LlamaForCausalLM

    from rlhf.models.lora import merged_state_dict
    from rlhf.workers.buckets import pack, unpack
    from rlhf.workers.sync_cuda import WeightSource
    from rlhf.workers.train import PolicyWorker

    cfg, model, initial = _tiny_lora_model()
    _train_a_few_steps(model)
    model.eval()
    ref = _reference_merge(model, cfg)
    assert len(ref) == cfg.num_hidden_layers * len(TARGETS)
    assert all(float((r.float() - initial[k]).abs().max()) > 1e-4 for k, r in ref.items())  # B is not zero

    # the object-store sync: PolicyWorker.full_state_dict on rank 0 (ZeRO 0)
    worker = SimpleNamespace(engine=SimpleNamespace(module=model), rank=0,
                             spec=SimpleNamespace(train=SimpleNamespace(zero_stage=0)))
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
    plain = LlamaForCausalLM(cfg).eval()
    plain.load_state_dict(merged, strict=True)
    ids = torch.randint(0, 22, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)

    # the GPU transports: WeightSource packs the same tensors, bucket by bucket, under the same names
    src = WeightSource(model, bucket_bytes=8192, dtype=torch.float32)
    assert len(src.buckets) > 1 and not src.zero3
    sent = {}
    for b in src.buckets:
        buf = torch.empty(src.max_bucket_bytes, dtype=torch.uint8)
        with src.gathered(b) as tensors:
            pack(b, tensors, buf)
        sent.update({name: t.clone() for name, t in unpack(buf, b.metas)})
    assert set(sent) == {n for n, _ in plain.named_parameters()}
    for k, v in sent.items():
        assert torch.equal(v, merged[k]), k
    assert src.total_bytes == 4 * sum(p.numel() for p in plain.parameters())

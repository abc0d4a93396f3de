"""Weight buckets and the trainer-side source (CPU): planning, packing, unpacking, names."""

from __future__ import annotations

import pytest
import torch

from rlhf.workers.buckets import (
    ALIGN,
    metas_from_wire,
    metas_to_wire,
    pack,
    plan_buckets,
    rename,
    unpack,
)


def _items(shapes, dtype=torch.bfloat16):
    return [(f"t{i}", s, dtype) for i, s in enumerate(shapes)]


def test_plan_respects_size_order_and_alignment():
    shapes = [(10, 10), (3,), (64, 64), (1000,), (7, 5)]
    buckets = plan_buckets(_items(shapes), bucket_bytes=8192)
    names = [m.name for b in buckets for m in b.metas]
    assert names == [f"t{i}" for i in range(len(shapes))]
    for b in buckets:
        assert b.nbytes % ALIGN == 0
        for m in b.metas:
            assert m.offset % ALIGN == 0
            assert m.offset + m.nbytes <= b.nbytes
        if len(b.metas) > 1:
            assert sum(m.nbytes for m in b.metas) <= 8192
    # the 64x64 bf16 tensor (8192 bytes) fits alone
    assert any(len(b.metas) == 1 and b.metas[0].name == "t2" for b in buckets)


def test_oversized_tensor_gets_its_own_bucket():
    buckets = plan_buckets(_items([(4,), (100, 100), (4,)]), bucket_bytes=1024)
    assert [b.names for b in buckets] == [["t0"], ["t1"], ["t2"]]


def test_duplicate_names_rejected():
    with pytest.raises(ValueError):
        plan_buckets([("a", (2,), torch.float32), ("a", (2,), torch.float32)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_pack_unpack_roundtrip_with_cast(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(5, 3), (17,), (2, 2, 2), (1,)]]
    buckets = plan_buckets([(f"t{i}", t.shape, dtype) for i, t in enumerate(tensors)], bucket_bytes=1 << 20)
    assert len(buckets) == 1
    b = buckets[0]
    buf = torch.full((b.nbytes + 100,), 0xAB, dtype=torch.uint8)
    flat = pack(b, tensors, buf)
    assert flat.numel() == b.nbytes
    got = dict(unpack(buf, metas_from_wire(metas_to_wire(b.metas))))
    for i, t in enumerate(tensors):
        assert got[f"t{i}"].dtype == dtype
        assert torch.equal(got[f"t{i}"], t.to(dtype))


def test_pack_checks_shapes_and_sizes():
    b = plan_buckets([("a", (4,), torch.float32)])[0]
    with pytest.raises(ValueError):
        pack(b, [torch.zeros(5)], torch.zeros(b.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack(b, [torch.zeros(4)], torch.zeros(1, dtype=torch.uint8))


def test_rename_strips_wrappers():
    assert rename("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert rename("_orig_mod.module.lm_head.weight") == "lm_head.weight"
    assert rename("actor.model.norm.weight", ["actor."]) == "model.norm.weight"


def test_weight_source_buckets_a_tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.workers.sync_cuda import WeightSource

    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    src = WeightSource(model, bucket_bytes=4096, dtype=torch.bfloat16)
    names = [m.name for b in src.buckets for m in b.metas]
    assert "lm_head.weight" not in names  # tied: sent once, as the embedding
    assert names == [n for n, _ in model.named_parameters()]
    assert not src.zero3
    total = sum(p.numel() for p in model.parameters()) * 2
    assert src.total_bytes == total
    # every bucket packs and unpacks to the model's tensors
    for b in src.buckets:
        buf = torch.empty(src.max_bucket_bytes, dtype=torch.uint8)
        with src.gathered(b) as ts:
            pack(b, ts, buf)
        for name, t in unpack(buf, b.metas):
            assert torch.equal(t, dict(model.named_parameters())[name].detach().to(torch.bfloat16))

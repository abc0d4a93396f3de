"""The plan's activation bytes per decoder layer (rlhf.plan.memory.ACT_BYTES_PER_LAYER) against what
autograd keeps for the backward pass of HF's Qwen2 layer in bf16, measured with saved-tensor hooks
on CPU (storages counted once).

On GPU the packed attention is FlashAttention's varlen kernel, which keeps q, k, v, its output and a
float32 log-sum-exp per head; on CPU the same call scatters the samples into padded rows for SDPA,
which keeps other tensors. So the tensors saved inside the attention call are left out of the
measurement and the formula's attention part (q 2h, k and v 2·kv each, log-sum-exp 4·heads; the
output is the o_proj input, measured) is added as the kernel keeps it. The rest (norms, projections'
inputs, SwiGLU) must match the formula within 1 %: the only tensors the formula leaves out are the
norms' fp32 reciprocal RMS, 4 bytes per token each."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from rlhf.models import varlen
from rlhf.plan.memory import ACT_BYTES_PER_LAYER
from rlhf.spec.schema import ModelSpec

TOLERANCE = 0.01
LENGTHS = (37, 120, 99)  # three packed samples


def qwen2(h: int, inter: int, heads: int, kv_heads: int, layers: int):
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=h, intermediate_size=inter,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   num_hidden_layers=layers, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    varlen.use_varlen(model)
    return model


def saved_bytes(model) -> int:
    """Bytes of the tensors autograd saves in one packed forward of LENGTHS, parameters and the
    attention call's own tensors left out."""
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)))
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "max_len": torch.tensor(max(LENGTHS))}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        s = t.untyped_storage()
        if not inside[0] and s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    real = varlen.varlen_causal_attention

    def marked(*args, **kwargs):
        inside[0] = True
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] = False

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        varlen.varlen_causal_attention = marked
        stack.callback(setattr, varlen, "varlen_causal_attention", real)
        model.base_model(**varlen.packed_kwargs(packed, "cpu"))
    return sum(seen.values())


@pytest.mark.parametrize("h,inter,heads,kv_heads", [(896, 4864, 14, 2), (256, 1024, 8, 4)],
                         ids=["qwen2.5-0.5b-ratios", "other-ratios"])
def test_layer_activation_bytes_match_what_autograd_saves(h, inter, heads, kv_heads):
    tokens = sum(LENGTHS)
    per_layer = (saved_bytes(qwen2(h, inter, heads, kv_heads, 2)) - saved_bytes(qwen2(h, inter, heads, kv_heads, 1)))
    measured = per_layer / tokens
    a, b, c, d = ACT_BYTES_PER_LAYER
    kv = h // heads * kv_heads
    kernel = 2 * h + 2 * kv + 2 * kv + 4 * heads  # q, k, v, fp32 log-sum-exp (FlashAttention varlen)
    formula = a * h + b * inter + c * kv + d * heads
    assert measured + kernel == pytest.approx(formula, rel=TOLERANCE), (measured, kernel, formula)
    # the plan's figure for the same shape uses the same numbers
    from rlhf.plan.memory import layer_activation_bytes

    m = ModelSpec(name="t", path="x", n_layers=2, hidden=h, intermediate=inter, n_heads=heads, n_kv_heads=kv_heads,
                  vocab=128, dtype="bfloat16")
    assert layer_activation_bytes(m) == formula

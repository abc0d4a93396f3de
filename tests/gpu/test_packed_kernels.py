"""The training side's kernels on the GPU: varlen attention (torch's FlashAttention varlen
kernel), chunked log-probs + entropy from hidden states, and a packed bf16 forward against the
padded one. References in float64 (attention, log-probs) or the padded SDPA pass (model)."""

from __future__ import annotations

import pytest
import torch

from rlhf.algos import logprobs_from_hidden
from rlhf.data.batch import collate, response_slice, response_tokens
from rlhf.data.packing import pack, unpack
from rlhf.models.varlen import _varlen_kernel, packed_kwargs, use_varlen, varlen_causal_attention

pytestmark = pytest.mark.gpu


def _reference_attention(q, k, v, cu, scale):
    """float64 causal attention per sample, GQA by head groups."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.empty_like(q)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        att = (qs @ ks.transpose(1, 2)) * scale
        n = e - s
        att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), 1), float("-inf"))
        out[s:e] = (torch.softmax(att, -1) @ vs).transpose(0, 1)
    return out


def test_varlen_kernel_present_and_matches_float64():
    assert _varlen_kernel() is not None, "torch.nn.attention.varlen.varlen_attn missing in this torch"
    torch.manual_seed(0)
    lens = [37, 1, 200, 64, 129]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T = sum(lens)
    q = torch.randn(T, 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = varlen_causal_attention(q, k, v, cu, max(lens), scale=0.125)
    ref = _reference_attention(q.detach(), k.detach(), v.detach(), cu, 0.125)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-2, err
    g = torch.randn_like(out)
    (out * g).sum().backward()
    gq = q.grad.clone()
    qd = q.detach().double().requires_grad_()
    (_reference_attention(qd, k.detach(), v.detach(), cu, 0.125) * g.double()).sum().backward()
    rel = ((gq.double() - qd.grad).norm() / qd.grad.norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("keep", [None, 0], ids=["kept", "recomputed"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_logprobs_from_hidden_on_gpu_matches_float64(compile, keep):
    """Values and both gradients (hidden, head weight) of the written-out head, eager and through
    torch.compile (train.compile_logprobs), its logits kept for the backward (each chunk's gradient
    written over them) or recomputed there, against float64 autograd on the same bf16 inputs."""
    torch.manual_seed(1)
    h = torch.randn(3000, 256, device="cuda").bfloat16().requires_grad_()
    head = torch.nn.Linear(256, 151936, bias=False, device="cuda").bfloat16()
    y = torch.randint(0, 151936, (3000,), device="cuda")
    g_lp, g_ent = torch.randn(3000, device="cuda"), torch.randn(3000, device="cuda")
    lp, ent = logprobs_from_hidden(h, head, y, 0.9, with_entropy=True, compile=compile, keep_elements=keep)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    hd = h.detach().double().requires_grad_()
    wd = head.weight.detach().double().requires_grad_()
    z = (hd @ wd.t()) / 0.9
    ref_lp = torch.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    # values against the float64 softmax of the same bf16 logits (the kernel's input); the
    # gradients against float64 throughout, whose logits differ by bf16 rounding
    z = (h.detach() @ head.weight.t()).double() / 0.9
    ref_lp_bf16 = torch.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    ref_ent_bf16 = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert (lp.double() - ref_lp_bf16).abs().max().item() < 1e-3
    assert (ent.double() - ref_ent_bf16).abs().max().item() < 1e-3
    assert (lp.double() - ref_lp).abs().mean().item() < 5e-3
    for name, got, ref in (("hidden", h.grad, hd.grad), ("weight", head.weight.grad, wd.grad)):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        print(f"{name} gradient, relative error vs float64: {rel:.3e}")  # -rA keeps it in the log
        assert rel < 2e-2, rel


def test_packed_bf16_forward_matches_padded():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).cuda().bfloat16().eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (16,), generator=g)]
    resps = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (16,), generator=g)]
    b = collate(prompts, resps, pad_id=0, response_width=200)
    with torch.no_grad():
        cb = {k: v.cuda() for k, v in b.items()}
        logits = model(input_ids=cb["input_ids"], attention_mask=cb["attention_mask"],
                       position_ids=cb["position_ids"]).logits[:, response_slice(cb)].float()
        ref = torch.log_softmax(logits, -1).gather(2, response_tokens(cb).unsqueeze(-1)).squeeze(-1).cpu()
        p = pack(b, list(range(16)))
        use_varlen(model)
        hidden = model.model(**packed_kwargs(p, "cuda")).last_hidden_state[0]
        lp, _ = logprobs_from_hidden(hidden[p["pred_index"].cuda()], model.lm_head, p["targets"].cuda())
    got = unpack(lp.float().cpu(), p, 16, 200)
    m = b["response_mask"] > 0
    diff = (got - ref)[m].abs()
    print(f"packed vs padded bf16 logprobs: mean {diff.mean():.5f} max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.5


def test_supervised_padding_free_bf16_matches_padded():
    """SFT/DPO's passes on a worker (rlhf_varlen: every example's real tokens end to end, the
    FlashAttention varlen kernel) against the same model's padded rows with their block-diagonal
    mask (SDPA), bf16, packed rows of several examples."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.data import sft as S
    from rlhf.algos import offline as O

    torch.manual_seed(4)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    padded = Qwen2ForCausalLM(cfg).cuda().bfloat16().eval()
    varlen = copy.deepcopy(padded)
    use_varlen(varlen)
    g = torch.Generator().manual_seed(5)
    rows = [S.Row() for _ in range(4)]
    for k in range(12):  # three examples packed per row, prompt then response
        p, r = (int(n) for n in torch.randint(5, 80, (2,), generator=g))
        ids = torch.randint(1, 4096, (p + r,), generator=g).tolist()
        rows[k % 4].add(ids, [0] * p + [1] * r, k // 4)
    mb = {k: v.cuda() if torch.is_tensor(v) else v for k, v in S.collate(rows, 0).items()}
    with torch.no_grad():
        a, b = O.token_logps(padded, mb), O.token_logps(varlen, mb)
    m = mb["loss_mask"].bool()
    m[:, 0] = False
    diff = (a - b)[m].abs().float()
    print(f"supervised padding-free vs padded bf16 logprobs: mean {diff.mean():.5f} max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.5


def test_compiled_layers_match_eager_in_bf16():
    """model.compile_layers on the GPU (inductor, the FlashAttention varlen kernel inside the traced
    layer): a packed bf16 forward + backward of a 0.5B-wide Qwen2 gives the eager layers' log-probs
    and gradients to bf16 tolerance, with one compiled graph serving the layers and no graph break."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from torch._dynamo.utils import counters

    from rlhf.models.compiled import compile_layers, compiled

    torch.manual_seed(6)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    eager = Qwen2ForCausalLM(cfg).cuda().bfloat16().train()
    use_varlen(eager)
    comp = copy.deepcopy(eager)
    counters.clear()
    assert compile_layers(comp) == 4
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (16,), generator=g)]
    resps = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (16,), generator=g)]
    p = pack(collate(prompts, resps, pad_id=0, response_width=200), list(range(16)))
    out = {}
    for name, m in (("eager", eager), ("compiled", comp)):
        hidden = m.model(**packed_kwargs(p, "cuda")).last_hidden_state[0]
        lp, _ = logprobs_from_hidden(hidden[p["pred_index"].cuda()], m.lm_head, p["targets"].cuda())
        lp.sum().backward()
        out[name] = (lp.detach().float(), {n: q.grad.float() for n, q in m.named_parameters() if q.grad is not None})
    assert compiled(comp)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] < 4, dict(counters["stats"])
    diff = (out["compiled"][0] - out["eager"][0]).abs()
    print(f"compiled vs eager bf16 logprobs: mean {diff.mean():.5f} max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.5
    grads_eager, grads_comp = out["eager"][1], out["compiled"][1]
    assert grads_eager.keys() == grads_comp.keys()
    for n, ge in grads_eager.items():
        rel = ((grads_comp[n] - ge).norm() / ge.norm().clamp_min(1e-12)).item()
        assert rel < 5e-2, (n, rel)


def test_warm_up_compiles_the_training_graphs_before_training():
    """rlhf.models.compiled.warm_up as a trained worker runs it (TrainedWorker._initialize): the model
    still in float32 on the host, a copy of one layer compiled in bf16 on the GPU with inductor, forward
    and backward; then the real model on the GPU in bf16 (what DeepSpeed makes of it) finds those
    graphs: its first packed forward + backward compiles nothing more."""
    import time
    import warnings

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from torch._dynamo.utils import counters

    from rlhf.models.compiled import compile_layers, compiled, warm_up

    torch._dynamo.reset()
    torch.manual_seed(8)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).train()
    use_varlen(model)
    compile_layers(model)
    counters.clear()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile failure would warn
        assert warm_up(model, torch.device("cuda"), torch.bfloat16) is True
    print(f"warm-up {time.perf_counter() - t0:.1f} s, graphs {dict(counters['stats'])}")
    built = counters["stats"]["unique_graphs"]
    assert built >= 1 and all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    model = model.cuda().bfloat16()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (8,), generator=g)]
    resps = [torch.randint(1, 4096, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (8,), generator=g)]
    p = pack(collate(prompts, resps, pad_id=0, response_width=200), list(range(8)))
    t0 = time.perf_counter()
    hidden = model.model(**packed_kwargs(p, "cuda")).last_hidden_state[0]
    lp, _ = logprobs_from_hidden(hidden[p["pred_index"].cuda()], model.lm_head, p["targets"].cuda())
    lp.sum().backward()
    torch.cuda.synchronize()
    print(f"first real pass {time.perf_counter() - t0:.1f} s, graphs {dict(counters['stats'])}")
    assert compiled(model) and counters["stats"]["unique_graphs"] == built, dict(counters["stats"])

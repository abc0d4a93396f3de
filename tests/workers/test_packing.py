"""Padding-free packing (rlhf.data.packing) and packed attention (rlhf.models.varlen): the
packed pass gives the padded pass's log-probs, on a tiny random Llama in float64."""

import pytest
import torch

from rlhf.data.batch import collate, response_slice, response_tokens
from rlhf.data.packing import largest_first, pack, split_to_count, token_groups, token_values, unpack
from rlhf.models.varlen import packed_kwargs, use_varlen, varlen_causal_attention


def test_largest_first_orders_by_tokens_and_keeps_ties():
    n = [3, 4, 2, 9, 1, 1]
    # token counts 7, 2, 9, 2, 0: largest first, the two 2s in their order, the empty group last
    assert largest_first([[0, 1], [2], [3], [4, 5], []], n) == [[3], [0, 1], [2], [4, 5], []]


def test_token_groups_keep_order_and_budget():
    assert token_groups([3, 4, 2, 9, 1, 1], 7) == [[0, 1], [2], [3], [4, 5]]
    assert token_groups([5], 2) == [[0]]  # a row over the budget is alone
    assert token_groups([], 4) == []


def test_split_to_count_splits_largest_and_pads():
    n = [4, 4, 1, 1]
    assert split_to_count([[0, 1, 2, 3]], n, 2) == [[0], [1, 2, 3]]
    out = split_to_count([[0, 1], [2, 3]], n, 4)
    assert sorted(sum(out, [])) == [0, 1, 2, 3] and len(out) == 4
    assert split_to_count([[0], [1]], n, 3) == [[0], [1], []]


def test_pack_layout_and_unpack_roundtrip():
    b = collate([[5, 6], [7], [8, 9, 10]], [[1, 2, 3], [4], []], pad_id=0, response_width=4)
    p = pack(b, [0, 1, 2])
    assert p["input_ids"].tolist() == [[5, 6, 1, 2, 3, 7, 4, 8, 9, 10]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert p["cu_seqlens"].tolist() == [0, 5, 7, 10]
    assert p["pred_index"].tolist() == [1, 2, 3, 5]  # the positions before each response token
    assert p["targets"].tolist() == [1, 2, 3, 4]
    flat = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert unpack(flat, p, 3, 4).tolist() == [[10, 11, 12, 0], [13, 0, 0, 0], [0, 0, 0, 0]]
    b["advantages"] = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert token_values(b, [0, 1, 2], p, ["advantages"])["advantages"].tolist() == [0, 1, 2, 4]
    empty = pack(b, [])
    assert empty["pred_index"].numel() == 0 and empty["input_ids"].shape == (1, 1)


def _random_rows(g, n, lo, hi):
    return [torch.randint(3, 30, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_collate_equals_a_row_by_row_reference():
    """The batch layout (module doc of rlhf.data.batch) built one row at a time, against collate,
    which copies all the ids at once: empty prompts and responses, responses cut at the width."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        B = int(torch.randint(1, 9, (1,), generator=g))
        prompts, responses = _random_rows(g, B, 0 if trial % 4 == 0 else 1, 7), _random_rows(g, B, 0, 6)
        width = (None, 1, 3, 6)[trial % 4]
        P = max(len(p) for p in prompts)
        R = width or max(1, max(len(r) for r in responses))
        ids, attn, rmask = [], [], []
        for p, r in zip(prompts, responses):
            r = r[:R]
            ids.append([9] * (P - len(p)) + p + r + [9] * (R - len(r)))
            attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)))
            rmask.append([1.0] * len(r) + [0.0] * (R - len(r)))
        b = collate(prompts, responses, pad_id=9, response_width=width)
        assert b["input_ids"].dtype == torch.long and b["input_ids"].tolist() == ids
        assert b["attention_mask"].dtype == torch.long and b["attention_mask"].tolist() == attn
        assert b["response_mask"].dtype == torch.float32 and b["response_mask"].tolist() == rmask
        assert b["position_ids"].tolist() == [[max(0, sum(a[:t + 1]) - 1) for t in range(P + R)] for a in attn]


def test_pack_equals_a_row_by_row_reference():
    """pack (one mask over the rows) against the layout built sample by sample: any subset and
    order of rows, repeated rows, rows without a response; a row without a prompt token is named."""
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        B = int(torch.randint(1, 9, (1,), generator=g))
        b = collate(_random_rows(g, B, 1, 7), _random_rows(g, B, 0, 5), pad_id=0, response_width=(None, 5)[trial % 2])
        rows = torch.randperm(B, generator=g)[:int(torch.randint(1, B + 1, (1,), generator=g))].tolist()
        rows += rows[:trial % 2]
        R = b["response_mask"].shape[1]
        P = b["input_ids"].shape[1] - R
        ids, pos, cu, pred, tgt, rr, cc = [], [], [0], [], [], [], []
        for k, row in enumerate(rows):
            real = [t for t, a in zip(b["input_ids"][row].tolist(), b["attention_mask"][row].tolist()) if a]
            n_resp = int(b["response_mask"][row].sum())
            n_prompt = len(real) - n_resp
            pred += [cu[-1] + n_prompt - 1 + t for t in range(n_resp)]
            ids += real
            pos += list(range(len(real)))
            cu.append(cu[-1] + len(real))
            tgt += b["input_ids"][row, P:P + n_resp].tolist()
            rr += [k] * n_resp
            cc += list(range(n_resp))
        p = pack(b, rows)
        assert p["input_ids"].tolist() == [ids] and p["position_ids"].tolist() == [pos]
        assert p["cu_seqlens"].dtype == torch.int32 and p["cu_seqlens"].tolist() == cu
        assert (p["pred_index"].tolist(), p["targets"].tolist(), p["rows"].tolist(), p["cols"].tolist()) == \
            (pred, tgt, rr, cc)
        lengths = [cu[i + 1] - cu[i] for i in range(len(rows))]
        assert int(p["max_len"]) == max(lengths) and float(p["sq_lengths"]) == sum(n * n for n in lengths)
    b = collate([[5, 6], [], [7]], [[1], [2], [3]], pad_id=0)
    with pytest.raises(ValueError, match="row 1 has no prompt token"):
        pack(b, [0, 2, 1])


def test_varlen_attention_equals_per_sequence_masked_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, cu, 4, scale=0.3)
    for s, e in [(0, 4), (4, 5), (5, 9)]:
        for t in range(s, e):
            for hq in range(4):
                kv = hq // 2
                w = torch.softmax(torch.stack([q[t, hq] @ k[j, kv] * 0.3 for j in range(s, t + 1)]), 0)
                ref = sum(w[j - s] * v[j, kv] for j in range(s, t + 1))
                torch.testing.assert_close(out[t, hq], ref, rtol=0, atol=1e-12)


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    responses = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (5, 2, 7, 0)]
    return collate(prompts, responses, pad_id=0, response_width=8)


def _padded_logprobs(model, b):
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, response_slice(b)]
    return torch.log_softmax(logits, -1).gather(2, response_tokens(b).unsqueeze(-1)).squeeze(-1) * b["response_mask"]


def _packed_logprobs(model, b):
    p = pack(b, [0, 1, 2, 3])
    h = model.model(**packed_kwargs(p, "cpu")).last_hidden_state[0][p["pred_index"]]
    lp = torch.log_softmax(model.lm_head(h), -1).gather(1, p["targets"][:, None]).squeeze(1)
    return unpack(lp, p, 4, 8)


def test_packed_forward_equals_padded_forward():
    """The same model (rlhf_varlen set for good) gives the padded SDPA pass's log-probs both
    packed and padded."""
    b = _batch()
    model = _tiny_llama().eval()
    with torch.no_grad():
        ref = _padded_logprobs(model, b)
        use_varlen(model)
        assert model.config._attn_implementation == "rlhf_varlen"
        torch.testing.assert_close(_padded_logprobs(model, b), ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(_packed_logprobs(model, b), ref, rtol=0, atol=1e-10)


def test_packed_forward_reads_nothing_back_from_the_device(monkeypatch):
    """transformers looks for packed sequences in the position ids (a host sync per forward) only
    when a call has no mask: packed calls give it one it passes through, and the result is the
    padded pass's."""
    import transformers.masking_utils as mu

    def sync(*a, **k):
        raise AssertionError("find_packed_sequence_indices ran: a device read in every packed forward")

    monkeypatch.setattr(mu, "find_packed_sequence_indices", sync)
    b = _batch()
    model = _tiny_llama().eval()
    with torch.no_grad():
        ref = _padded_logprobs(model, b)
        use_varlen(model)
        torch.testing.assert_close(_packed_logprobs(model, b), ref, rtol=0, atol=1e-10)


def test_packed_gradients_with_gradient_checkpointing():
    """Layers recomputed in the backward pass (gradient checkpointing) attend packed again: the
    gradients equal those of the padded pass without checkpointing."""
    b = _batch()
    ref_model, model = _tiny_llama().train(), _tiny_llama().train()
    _padded_logprobs(ref_model, b).sum().backward()
    use_varlen(model)
    model.gradient_checkpointing_enable()
    _packed_logprobs(model, b).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)


def test_a_workers_micro_batches_run_largest_first():
    """``packed_micro_batches`` (every RL pass's micro-batches) cuts by the token budget, then runs
    the largest first; every row is in exactly one of them."""
    from types import SimpleNamespace

    from rlhf.workers.policy import PolicyWorker

    b = _batch()  # rows of 8, 8, 8, 4 real tokens
    w = object.__new__(PolicyWorker)  # no __init__: only what packed_micro_batches reads
    w.spec = SimpleNamespace(train=SimpleNamespace(max_tokens_per_micro_batch=12))
    w.world_size, w.module, w.engine = 1, _tiny_llama(), None
    out = w.packed_micro_batches(b)
    sizes = [int(p["input_ids"].shape[1]) for _, p in out]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], sizes
    assert sorted(r for rows, _ in out for r in rows) == [0, 1, 2, 3]

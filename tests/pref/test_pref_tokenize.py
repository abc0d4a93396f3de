"""Tokenisation with and without chat templates, truncation counts, packing that changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.data import preference as P
from rlhf.data import sft as S
from rlhf.data.files import Records
from rlhf.spec.errors import UserError


def data_spec(**kw):
    base = dict(
        prompt_key="prompt", response_key="response", chosen_key="chosen", rejected_key="rejected",
        messages_key="messages", chat_template=False, truncation="right", tools_key="tools",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def rec(rows):
    return Records(rows=rows, source="mem.jsonl")


def test_plain_text_matches_the_rollout_boundary(keymap_tok):
    tok = keymap_tok
    ex = S.sft_example(rec([{"prompt": "key k1 =", "response": "v1 v2 v3"}]), 0, tok, data_spec())
    p = tok("key k1 =")["input_ids"]  # what the RL data path feeds the policy (with <bos>)
    assert ex.input_ids[: len(p)] == p and p[0] == tok.bos_token_id
    assert tok.decode(ex.input_ids[len(p):], skip_special_tokens=True) == "v1 v2 v3"
    assert ex.input_ids[-1] == tok.eos_token_id
    assert ex.loss_mask == [0] * len(p) + [1] * 4


def test_chat_template_masks_every_assistant_turn(chat_tok):
    tok = chat_tok
    msgs = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3"},
        {"role": "user", "content": "w4"},
        {"role": "assistant", "content": "w5 w6"},
    ]
    ex = S.sft_example(rec([{"messages": msgs}]), 0, tok, data_spec(chat_template=True))
    words = tok.convert_ids_to_tokens(ex.input_ids)
    trained = [w for w, m in zip(words, ex.loss_mask) if m]
    assert trained == ["w3", "<end>", "w5", "w6", "<end>"]
    assert words[:4] == ["<user>", "w1", "w2", "<end>"]
    # prompt/response rows through the template: one user turn, one assistant turn
    ex = S.sft_example(rec([{"prompt": "w1", "response": "w2"}]), 0, tok, data_spec(chat_template=True))
    assert tok.convert_ids_to_tokens(ex.input_ids) == ["<user>", "w1", "<end>", "<assistant>", "w2", "<end>"]
    assert ex.loss_mask == [0, 0, 0, 0, 1, 1]


def test_missing_template_is_a_clear_error(chat_tok):
    tok = chat_tok.__class__.from_pretrained  # noqa: F841 (keeps the fixture's class in scope)
    import copy

    bare = copy.deepcopy(chat_tok)
    bare.chat_template = None
    with pytest.raises(UserError, match="has no chat template.*data.chat_template=false"):
        S.sft_example(rec([{"prompt": "w1", "response": "w2"}]), 0, bare, data_spec(chat_template=True))
    with pytest.raises(UserError, match="has no chat template"):
        S.sft_example(rec([{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}]), 0, bare, data_spec())


def test_row_errors(keymap_tok):
    with pytest.raises(UserError, match=r"mem.jsonl, row 0: no key 'response'.*data.response_key="):
        S.sft_example(rec([{"prompt": "key k1 =", "answer": "v1"}]), 0, keymap_tok, data_spec())
    with pytest.raises(UserError, match=r"row 0: no key 'rejected'"):
        P.pair_from_row(rec([{"prompt": "key", "chosen": "v1"}]), 0, keymap_tok, data_spec())
    with pytest.raises(UserError, match=r"same response"):
        P.pair_from_row(rec([{"prompt": "key", "chosen": "v1", "rejected": "v1"}]), 0, keymap_tok, data_spec())


def test_truncation_policies_and_report(keymap_tok):
    rows = [{"prompt": "key k1 =", "response": " ".join(["v1"] * n)} for n in (1, 3, 8)]
    # lengths: 4 prompt tokens (<bos> key k1 =) + n + 1 (eos)
    exs, rep = S.build_sft(rec(rows), keymap_tok, data_spec(truncation="right"), max_length=8)
    assert [len(e.input_ids) for e in exs] == [6, 8, 8]
    assert (rep.total, rep.truncated, rep.dropped, rep.tokens_cut) == (3, 1, 0, 5)
    assert "1 truncated" in rep.line() and "data.max_length" in rep.line()
    exs, rep = S.build_sft(rec(rows), keymap_tok, data_spec(truncation="drop"), max_length=8)
    assert len(exs) == 2 and rep.dropped == 1
    exs, rep = S.build_sft(rec(rows), keymap_tok, data_spec(truncation="left"), max_length=8)
    assert exs[2].loss_mask == [1] * 8
    # left truncation of a pair cuts the prompt's start, keeps whole responses
    pairs, rep = P.build_pairs(
        rec([{"prompt": "key k1 k2 k3 =", "chosen": "v1 v2", "rejected": "v3"}]), keymap_tok, data_spec(truncation="left"), max_length=6
    )
    assert len(pairs[0].prompt) == 3 and keymap_tok.convert_ids_to_tokens(pairs[0].chosen) == ["v1", "v2", "<eos>"]
    pairs, rep = P.build_pairs(
        rec([{"prompt": "key k1 k2 k3 =", "chosen": "v1 v2", "rejected": "v3"}]), keymap_tok, data_spec(truncation="right"), max_length=7
    )
    assert len(pairs[0].prompt) == 6 and len(pairs[0].chosen) == 1 and rep.truncated == 1


def test_conversation_pairs_without_prompt_key(chat_tok):
    u = {"role": "user", "content": "w1"}
    row = {"chosen": [u, {"role": "assistant", "content": "w2"}], "rejected": [u, {"role": "assistant", "content": "w3"}]}
    pair = P.pair_from_row(rec([row]), 0, chat_tok, data_spec(chat_template=True))
    assert chat_tok.convert_ids_to_tokens(pair.prompt) == ["<user>", "w1", "<end>", "<assistant>"]
    assert chat_tok.convert_ids_to_tokens(pair.chosen) == ["w2", "<end>"]


def _tiny_lm(vocab, attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _token_logp(model, batch):
    from rlhf.algos.losses import token_logprobs

    with torch.no_grad():
        logits = model(**S.model_inputs(batch, attn_impl=model.config._attn_implementation)).logits
    lp = token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])
    return torch.nn.functional.pad(lp, (1, 0))  # position t: log p(input_ids[t])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_gives_the_same_losses(keymap_tok, attn):
    rows = [{"prompt": f"key k{i} =", "response": " ".join(f"v{(i + j) % 8}" for j in range(1 + i % 4))} for i in range(7)]
    exs, _ = S.build_sft(rec(rows), keymap_tok, data_spec(), max_length=16)
    model = _tiny_lm(len(keymap_tok), attn)
    totals = {}
    for pack in (False, True):
        rws = S.to_rows(exs, pack=pack, max_length=16)
        if pack:
            assert len(rws) < len(exs) and all(len(r) <= 16 for r in rws)
        b = S.collate(rws, keymap_tok.pad_token_id)
        lp = _token_logp(model, b)
        m = b["loss_mask"].bool()
        totals[pack] = (lp[m].sum().item(), int(m.sum()))
    assert totals[True][1] == totals[False][1]
    assert totals[True][0] == pytest.approx(totals[False][0], abs=1e-4)

    pairs = [P.Pair(e.input_ids[:4], e.input_ids[4:], e.input_ids[4:-1] + [keymap_tok.eos_token_id, 5]) for e in exs]
    out = {}
    for pack in (False, True):
        b = P.collate_pairs(pairs, keymap_tok.pad_token_id, pack=pack, max_length=24)
        out[pack] = P.sequence_logps(_token_logp(model, b), b, 2 * len(pairs))
        last = P.last_token_values(b["input_ids"].float(), b)
        assert last[0].item() == keymap_tok.eos_token_id and last[1].item() == 5
    assert torch.allclose(out[True], out[False], atol=1e-4)

"""The supervised objectives against plain recomputations, the RM's read position against the RL
reward-model worker's, and the driver-side batch splitting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.data import preference as P
from rlhf.data import sft as S
from rlhf.data.batch import collate as rl_collate
from rlhf.algos import offline as O
from rlhf.loops import supervised as sup


def _models(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg).eval()
    cfg.num_labels = 1
    rm = LlamaForSequenceClassification(cfg).eval()
    return lm, rm


def _pairs(tok):
    rows = [{"prompt": f"key k{i}" + " k1" * (i % 3), "chosen": f"v{i}", "rejected": " ".join(["v1"] * (1 + i % 2))}
            for i in range(6)]
    data = SimpleNamespace(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", messages_key="messages",
                           chat_template=False, truncation="right")
    from rlhf.data.files import Records

    pairs, _ = P.build_pairs(Records(rows=rows, source="mem"), tok, data, 32)
    return pairs


def test_rm_scores_are_read_where_the_rl_reward_worker_reads_them(keymap_tok):
    _, rm = _models(len(keymap_tok))
    pairs = _pairs(keymap_tok)
    mb = P.collate_pairs(pairs, keymap_tok.pad_token_id)
    with torch.no_grad():
        ours = O.sequence_scores(rm, mb)
        # the RL path: prompt left-padded, response right-padded, HF's pooling at the last real token
        prompts = [p.prompt for p in pairs for _ in range(2)]
        responses = [r for p in pairs for r in (p.chosen, p.rejected)]
        b = rl_collate(prompts, responses, keymap_tok.pad_token_id, 4)
        theirs = rm(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-5)
    packed = P.collate_pairs(pairs, keymap_tok.pad_token_id, pack=True, max_length=32)
    with torch.no_grad():
        assert torch.allclose(O.sequence_scores(rm, packed), ours, atol=1e-5)


def test_dpo_and_rm_objectives_match_the_algos(keymap_tok):
    from rlhf.algos.preference import bradley_terry_loss, dpo_loss

    lm, rm = _models(len(keymap_tok))
    pairs = _pairs(keymap_tok)
    mb = P.collate_pairs(pairs, keymap_tok.pad_token_id)
    n = len(pairs)
    mb["loss_scale"] = torch.tensor(1.0 / n)
    ref = torch.randn(2 * n)
    mb["ref_logp"] = ref
    with torch.no_grad():
        logp = O.SequenceLogps()(lm, mb)
        loss, st = O.DPOObjective(beta=0.2, loss_type="ipo")(lm, mb)
    want, m = dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], beta=0.2, loss_type="ipo")
    assert float(loss) == pytest.approx(float(want.mean()), rel=1e-5)
    assert st["correct"] == pytest.approx(float(m["accuracy"].sum()))
    # summed response log-probs by hand, for pair 0's chosen
    ids = pairs[0].prompt + pairs[0].chosen
    with torch.no_grad():
        lp = torch.log_softmax(lm(torch.tensor([ids])).logits[0, :-1], -1)
    by_hand = sum(float(lp[t - 1, ids[t]]) for t in range(len(pairs[0].prompt), len(ids)))
    assert float(logp[0]) == pytest.approx(by_hand, abs=1e-4)
    with torch.no_grad():
        loss, st = O.RMObjective(margin=0.5)(rm, mb)
        s = O.sequence_scores(rm, mb)
    want, acc = bradley_terry_loss(s[0::2], s[1::2], torch.full((n,), 0.5))
    assert float(loss) == pytest.approx(float(want.mean()), rel=1e-5)


def test_sft_objective_is_a_token_mean(keymap_tok):
    lm, _ = _models(len(keymap_tok))
    rows = [S.Row() for _ in range(3)]
    for k, r in enumerate(rows):
        ids = keymap_tok(f"key k{k}")["input_ids"] + [10 + k, keymap_tok.eos_token_id]
        r.add(ids, [0] * (len(ids) - 2) + [1, 1], 0)
    mb = S.collate(rows, keymap_tok.pad_token_id)
    tokens = sum(sum(r.loss_mask) for r in rows)
    mb["loss_scale"] = torch.tensor(1.0 / tokens)
    with torch.no_grad():
        loss, st = O.SFTObjective()(lm, mb)
        per_row = O.SFTRowNLL()(lm, mb)
    assert st["tokens"] == tokens == float(per_row[:, 1].sum())
    assert float(loss) == pytest.approx(float(per_row[:, 0].sum()) / tokens, rel=1e-5)


def test_step_and_eval_shards():
    spec = SimpleNamespace(batch=SimpleNamespace(train_world_size=2, micro_batch_size=3, grad_accum=2, mini_batch_size=12))
    shards = sup.step_shards(list(range(12)), spec)
    assert shards == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
    # with sizes, each rank's largest micro-batch first; the ranks keep their units
    size = {0: 5, 1: 1, 2: 1, 3: 6, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2, 9: 2, 10: 2, 11: 2}
    by_size = sup.step_shards(list(range(12)), spec, lambda mb: sum(size[u] for u in mb))
    assert by_size == [[[3, 4, 5], [0, 1, 2]], [[6, 7, 8], [9, 10, 11]]]  # ties keep their order
    pairs = [SimpleNamespace(prompt=[1] * p, chosen=[1] * c, rejected=[1] * r) for p, c, r in ((2, 3, 5), (4, 1, 1))]
    assert sup.pair_tokens(pairs)([0, 1]) == (2 * 2 + 3 + 5) + (2 * 4 + 1 + 1)
    ev = sup.eval_shards(7, world=2, micro=3)
    assert [len(r) for r in ev] == [2, 2]  # same number of micro-batches on every rank (ZeRO-3)
    flat = [u for r in ev for mb in r for u in mb]
    assert flat[:7] == list(range(7)) and set(flat[7:]) == {6}
    pieces = [(mb, torch.tensor([float(u) for u in mb])) for r in ev for mb in r]
    assert sup.per_unit(pieces, 7).tolist() == [float(i) for i in range(7)]


def last_token_scores(model, mb) -> torch.Tensor:
    """Reference: a sequence classifier's score at each padded row's last real token, by its
    attention mask (not the model's pooling, which looks for pad_token_id), ``[B]``."""
    hidden = model.base_model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                              position_ids=mb["position_ids"]).last_hidden_state
    values = model.score(hidden).squeeze(-1).float()  # [B, T]
    attn = mb["attention_mask"]
    last = attn.shape[1] - 1 - attn.flip(-1).argmax(-1)
    return values[torch.arange(values.shape[0]), last]


def test_rl_reward_worker_reads_the_trained_position_also_when_eos_pads(keymap_tok):
    """Tokenizers without a pad token pad with EOS (rlhf.models.load_tokenizer): HF's own pooling
    would then score the token before the final EOS; the worker and the RM loop both read the EOS."""
    _, rm = _models(len(keymap_tok))
    eos = keymap_tok.eos_token_id
    rm.config.pad_token_id = eos
    pairs = _pairs(keymap_tok)
    mb = P.collate_pairs(pairs, eos)
    prompts = [p.prompt for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p.chosen, p.rejected)]
    b = rl_collate(prompts, responses, eos, 4)
    with torch.no_grad():
        assert torch.allclose(last_token_scores(rm, b), O.sequence_scores(rm, mb), atol=1e-5)
    # the RL reward-model worker's padding-free pass reads the same position
    import copy

    from rlhf.data.packing import pack
    from rlhf.models.varlen import use_varlen
    from rlhf.workers.frozen import packed_last_token_scores

    varlen = copy.deepcopy(rm)
    use_varlen(varlen)
    rows = list(range(len(prompts)))
    with torch.no_grad():
        for part in (rows, rows[3:7]):
            got = packed_last_token_scores(varlen, pack(b, part), "cpu")
            assert torch.allclose(got, last_token_scores(rm, b)[part], atol=1e-5)


def test_supervised_log_probs_from_hidden_states_match_float64_full_logits(keymap_tok):
    """SFT's loss and DPO's summed log-probs now run the LM head on the trained positions only
    (``objectives.token_logps``). Against a float64 full-logits log-softmax written here, on packed
    and unpacked rows: values and every weight's gradient."""
    lm, _ = _models(len(keymap_tok))
    lm = lm.double()

    def reference(mb, keep):  # float64, every position's logits, then the kept ones summed
        from rlhf.data.sft import model_inputs

        logits = lm(**model_inputs(mb, dtype=torch.float64)).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
        return (lp * keep[:, 1:]).sum(-1)

    rows = [S.Row() for _ in range(2)]
    for k in range(4):
        ids = keymap_tok(f"key k{k}" + " k1" * k)["input_ids"] + [10 + k, 11, keymap_tok.eos_token_id]
        rows[k % 2].add(ids, [0] * (len(ids) - 3) + [1, 1, 1], k // 2)  # two examples packed per row
    for mb in (S.collate(rows, keymap_tok.pad_token_id), S.collate(rows[:1], keymap_tok.pad_token_id)):
        keep = (mb["loss_mask"] != 0).double()
        keep[:, 0] = 0
        mb["loss_scale"] = torch.tensor(1.0)
        lm.zero_grad()
        loss, st = O.SFTObjective()(lm, mb)
        loss.backward()
        ours = {n: p.grad.clone() for n, p in lm.named_parameters()}
        lm.zero_grad()
        want = -reference(mb, keep).sum()
        want.backward()
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-10)
        assert st["tokens"] == float(keep.sum())
        for n, p in lm.named_parameters():
            assert torch.allclose(ours[n], p.grad, rtol=1e-8, atol=1e-12), n

    pairs = _pairs(keymap_tok)
    for mb in (P.collate_pairs(pairs, keymap_tok.pad_token_id),
               P.collate_pairs(pairs, keymap_tok.pad_token_id, pack=True, max_length=32)):
        n = 2 * len(pairs)
        with torch.no_grad():
            got = O.SequenceLogps()(lm, mb)  # float32 by design (what the reference hands to DPO)
        keep = (mb["loss_mask"].bool() & (mb["seq"] >= 0)).double()
        per_pos = torch.zeros(n, dtype=torch.float64)
        with torch.no_grad():
            from rlhf.data.sft import model_inputs

            logits = lm(**model_inputs(mb, dtype=torch.float64)).logits[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
        sel = keep[:, 1:].bool()
        per_pos.index_add_(0, mb["seq"][:, 1:][sel], lp[sel])
        assert torch.allclose(got.double(), per_pos, rtol=1e-6, atol=1e-6)
        with torch.no_grad():  # and the DPO objective sums the same positions, in float64 here
            logp = O.token_logps(lm, mb, O._response(mb))
        assert torch.allclose(P.sequence_logps(logp, mb, n), per_pos, rtol=1e-10, atol=1e-10)


def test_padding_free_supervised_passes_equal_the_masked_padded_ones(keymap_tok):
    """A worker's model attends with rlhf_varlen: the supervised objectives then run every
    example's real tokens end to end (``objectives.backbone_hidden``) instead of padded rows with a
    (block-diagonal, for packed rows) mask. Same values and gradients, float64, packed and not."""
    import copy

    from rlhf.models.varlen import use_varlen

    lm, rm = _models(len(keymap_tok))
    pairs = _pairs(keymap_tok)
    for model, objective in ((lm, O.DPOObjective(beta=0.2, reference_free=True)), (rm, O.RMObjective())):
        padded = model.double()
        varlen = copy.deepcopy(padded)
        use_varlen(varlen)
        for mb in (P.collate_pairs(pairs, keymap_tok.pad_token_id),
                   P.collate_pairs(pairs, keymap_tok.pad_token_id, pack=True, max_length=32)):
            mb["loss_scale"] = torch.tensor(1.0)
            grads = []
            for m in (padded, varlen):
                m.zero_grad()
                loss, st = objective(m, mb)
                loss.backward()
                grads.append((float(loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}))
            assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-10)
            for n in grads[0][1]:
                assert torch.allclose(grads[0][1][n], grads[1][1][n], rtol=1e-8, atol=1e-12), n
    rows = [S.Row() for _ in range(2)]
    for k in range(4):
        ids = keymap_tok(f"key k{k}" + " k1" * k)["input_ids"] + [10 + k, keymap_tok.eos_token_id]
        rows[k % 2].add(ids, [0] * (len(ids) - 2) + [1, 1], k // 2)
    varlen = copy.deepcopy(lm)
    use_varlen(varlen)
    mb = S.collate(rows, keymap_tok.pad_token_id)
    mb["loss_scale"] = torch.tensor(1.0)
    with torch.no_grad():
        a, _ = O.SFTObjective()(lm, mb)
        b, _ = O.SFTObjective()(varlen, mb)
    assert float(a) == pytest.approx(float(b), rel=1e-10)


def test_objective_stats_stay_on_the_device_and_sum_once_as_read_per_micro_batch(keymap_tok):
    """A training worker sums the objectives' stats on the device over its micro-batches and reads
    them once (``rlhf.workers.policy.StatSums``, as the RL update does): nothing an objective
    returns was read back to the host, and the once-read sums equal reading every micro-batch's."""
    from rlhf.workers.policy import StatSums

    lm, rm = _models(len(keymap_tok))
    pairs = _pairs(keymap_tok)
    g = torch.Generator().manual_seed(0)
    pref = []
    for chunk in (pairs[0:2], pairs[2:5], pairs[5:6]):
        mb = P.collate_pairs(chunk, keymap_tok.pad_token_id)
        mb["loss_scale"] = torch.tensor(1.0 / len(pairs))
        mb["ref_logp"] = -torch.rand(2 * len(chunk), generator=g) * 5
        pref.append(mb)
    sft = []
    for k in range(3):
        rows = [S.Row() for _ in range(k + 1)]
        for j, r in enumerate(rows):
            ids = keymap_tok(f"key k{j}" + " k1" * k)["input_ids"] + [10 + j, keymap_tok.eos_token_id]
            r.add(ids, [0] * (len(ids) - 2) + [1, 1], 0)
        mb = S.collate(rows, keymap_tok.pad_token_id)
        mb["loss_scale"] = torch.tensor(0.1)
        sft.append(mb)
    for model, objective, mbs in ((lm, O.SFTObjective(), sft), (lm, O.DPOObjective(beta=0.2), pref),
                                  (rm, O.RMObjective(margin=0.5), pref)):
        once, read_each = StatSums(), {}
        for mb in mbs:
            with torch.no_grad():
                _, st = objective(model, mb)
            assert {k for k, v in st.items() if not torch.is_tensor(v)} <= {"pairs"}  # pairs: a shape, no read
            once.add_sums(st)
            for k, v in st.items():
                read_each[k] = read_each.get(k, 0.0) + float(v)
        assert once.totals() == read_each, type(objective).__name__
        assert all(type(v) is float for v in once.totals().values())


def _host_reads(fn) -> list[str]:
    """The ops in ``fn()``, called from rlhf's own code, that make the host read a tensor's value
    (``.item()``/``int()``, ``nonzero``, boolean-mask indexing): on a GPU each waits for the device."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
    indexing = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}

    found: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            masks = func in indexing and any(t is not None and t.dtype == torch.bool for t in args[1])
            if func in reads or masks:
                caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
                if "/rlhf/" in caller.filename:
                    found.append(f"{func} at {caller.filename}:{caller.lineno}")
            return func(*args, **(kwargs or {}))

    with Record(), torch.no_grad():
        fn()
    return found


def test_the_padding_free_pass_reads_nothing_back_from_the_device(keymap_tok):
    """``backbone_hidden`` finds the real tokens from the collate's host-side index
    (``sft.padding_free_index``): no sync of its own per micro-batch (transformers' own packed-row
    check is not ours), and ``max_len`` travels as an int that a worker's ``_to`` leaves alone."""
    import copy

    from rlhf.models.varlen import use_varlen
    from rlhf.workers.model import to_device

    lm, rm = _models(len(keymap_tok))
    pairs = _pairs(keymap_tok)
    rows = [S.Row() for _ in range(2)]
    for k in range(4):
        ids = keymap_tok(f"key k{k}" + " k1" * k)["input_ids"] + [10 + k, keymap_tok.eos_token_id]
        rows[k % 2].add(ids, [0] * (len(ids) - 2) + [1, 1], k // 2)
    mbs = [S.collate(rows, keymap_tok.pad_token_id), P.collate_pairs(pairs, keymap_tok.pad_token_id),
           P.collate_pairs(pairs, keymap_tok.pad_token_id, pack=True, max_length=32)]
    for model in (lm, rm):
        varlen = copy.deepcopy(model)
        use_varlen(varlen)
        for mb in mbs:
            assert type(mb["max_len"]) is int and mb["cu_seqlens"].dtype == torch.int32
            real = mb["seg"] >= 0
            assert mb["real_index"].tolist() == torch.nonzero(real.flatten()).flatten().tolist()
            lengths = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
            assert sum(lengths) == int(real.sum()) and max(lengths) == mb["max_len"]
            assert _host_reads(lambda: O.backbone_hidden(varlen, mb)) == []
            moved = to_device(mb, "cpu")
            assert moved["max_len"] == mb["max_len"] and type(moved["max_len"]) is int


@pytest.mark.parametrize("flag", [False, True])
def test_workers_hand_the_objectives_their_spec_compile_flag(flag):
    """The objectives are built in the driver without ``train.compile_logprobs``; the worker that runs
    them passes its own spec's value with every call (evaluation and training share ``_run_fn``)."""
    from rlhf.workers.policy import PolicyWorker

    worker = PolicyWorker.__new__(PolicyWorker)  # the method under test, without Ray or DeepSpeed
    worker.module, worker.device = torch.nn.Linear(2, 2).train(), "cpu"
    worker.spec = SimpleNamespace(train=SimpleNamespace(compile_logprobs=flag))
    seen = []

    def fn(model, mb, compile=None):
        seen.append((model.training, compile))
        return mb["x"] * 2

    out = worker.apply([{"x": torch.ones(1)}, {"x": torch.zeros(1)}], fn)
    assert seen == [(False, flag), (False, flag)] and worker.module.training
    assert [float(o) for o in out] == [2.0, 0.0]

"""The supervised objectives pick the LM head's rows by flat indices that the collates find on the
host (``scored_index``), not by boolean masks of device tensors, whose every use makes the host
wait for the device to report a count: the same bits as the boolean path, no such read in a
micro-batch's forward and backward, and under ZeRO-3 the head rows agreed by the driver
(``rlhf.loops.supervised.agree_head_rows``)."""

from __future__ import annotations

import copy
import traceback
from collections import Counter

import pytest
import torch

from rlhf.data import preference as P
from rlhf.data import sft as S
from rlhf.algos import offline as O
from rlhf.loops import supervised as sup
from rlhf.models.varlen import use_varlen
from tests.pref.test_pref_objectives import _models, _pairs


def _sft_rows(tok, pack: bool) -> list:
    rows = [S.Row() for _ in range(2 if pack else 4)]
    for k in range(4):
        ids = tok(f"key k{k}" + " k1" * k)["input_ids"] + [10 + k, 11, tok.eos_token_id]
        r = rows[k % 2] if pack else rows[k]
        r.add(ids, [0] * (len(ids) - 3) + [1, 1, 1], k // 2 if pack else 0)
    return rows


def _micro_batches(tok) -> dict[str, dict]:
    """SFT and preference micro-batches, rows of one example and packed rows."""
    pairs = _pairs(tok)
    g = torch.Generator().manual_seed(0)
    out = {"sft": S.collate(_sft_rows(tok, False), tok.pad_token_id),
           "sft packed": S.collate(_sft_rows(tok, True), tok.pad_token_id),
           "pairs": P.collate_pairs(pairs, tok.pad_token_id),
           "pairs packed": P.collate_pairs(pairs, tok.pad_token_id, pack=True, max_length=32)}
    for name, mb in out.items():
        mb["loss_scale"] = torch.tensor(0.25, dtype=torch.float64)
        if name.startswith("pairs"):
            mb["ref_logp"] = -torch.rand(2 * len(pairs), generator=g, dtype=torch.float64) * 5
    return out


def _without_index(mb: dict) -> dict:
    return {k: v for k, v in mb.items() if k != "scored_index"}


def test_the_collates_index_the_positions_the_boolean_masks_select(keymap_tok):
    for name, mb in _micro_batches(keymap_tok).items():
        keep = mb["loss_mask"].bool() & (mb["seq"] >= 0 if "seq" in mb else True)
        keep[:, 0] = False
        assert mb["scored_index"].dtype == torch.long, name
        assert mb["scored_index"].tolist() == torch.nonzero(keep.flatten()).flatten().tolist(), name


def test_indexed_log_probs_equal_the_boolean_path_to_the_bit(keymap_tok):
    """float64, padded rows with a mask and padding-free (rlhf_varlen), packed and not: token
    log-probs, DPO's summed ones, and every loss and weight gradient of SFT and DPO."""
    lm, _ = _models(len(keymap_tok))
    padded = lm.double()
    varlen = copy.deepcopy(padded)
    use_varlen(varlen)
    for model in (padded, varlen):
        for name, mb in _micro_batches(keymap_tok).items():
            plain = _without_index(mb)
            pairs = name.startswith("pairs")
            keep = O._response(plain) if pairs else None
            with torch.no_grad():
                a, b = O.token_logps(model, mb), O.token_logps(model, plain, keep)
                assert torch.equal(a, b), name
                if pairs:
                    n = mb["last"].shape[0]
                    assert torch.equal(P.sequence_logps(a, mb, n), P.sequence_logps(b, plain, n)), name
                    assert torch.equal(O.SequenceLogps()(model, mb), O.SequenceLogps()(model, plain)), name
                else:
                    assert torch.equal(O.SFTRowNLL()(model, mb), O.SFTRowNLL()(model, plain)), name
            objective = O.DPOObjective(beta=0.2) if pairs else O.SFTObjective()
            got = []
            for m in (mb, plain):
                model.zero_grad()
                loss, _ = objective(model, m)
                loss.backward()
                got.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
            assert torch.equal(got[0][0], got[1][0]), name
            assert all(torch.equal(got[0][1][k], got[1][1][k]) for k in got[0][1]), name


def _device_reads(fn) -> Counter:
    """The ops run by ``fn()``, forward and backward, that make the host read a device value
    (``.item()``/``int()``/``bool()`` of a tensor, ``nonzero``, boolean-mask indexing and
    assignment), by op and the line (outside torch) that ran it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.is_nonzero.default, aten.masked_scatter.default}
    indexing = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
    found: Counter = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            masks = func in indexing and any(t is not None and t.dtype == torch.bool for t in args[1])
            if func in reads or masks:
                caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
                found[f"{func} at {caller.filename.split('/')[-1]}:{caller.lineno}"] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return found


def test_a_micro_batch_forward_and_backward_read_nothing_back(keymap_tok):
    """A training worker's pass (padding-free) of SFT and DPO, forward and backward, and the
    evaluation passes: no op that waits for the device. The same passes on micro-batches without
    the index (the boolean path) are caught, so the recorder sees what it looks for."""
    lm, _ = _models(len(keymap_tok))
    use_varlen(lm)
    lm.train()

    def step(objective, mb):
        def run():
            loss, _ = objective(lm, mb)
            loss.backward()
        return run

    for name, mb in _micro_batches(keymap_tok).items():
        objective = O.DPOObjective(beta=0.2) if name.startswith("pairs") else O.SFTObjective()
        evaluation = O.SequenceLogps() if name.startswith("pairs") else O.SFTRowNLL()
        assert _device_reads(step(objective, mb)) == Counter(), name
        with torch.no_grad():
            assert _device_reads(lambda: evaluation(lm, mb)) == Counter(), name
        assert sum(_device_reads(step(objective, _without_index(mb))).values()) >= 2, name


def test_the_driver_agrees_each_micro_batch_head_rows_over_ranks(keymap_tok):
    """Under ZeRO-3 with several ranks every micro-batch gets the most scored positions of any
    rank's micro-batch at its place in the step (what ``equal_head_rows`` pads to); otherwise the
    micro-batches stay as they were."""
    rows = _sft_rows(keymap_tok, False) + _sft_rows(keymap_tok, True)
    shards_of = lambda: [[S.collate([rows[i] for i in mb], keymap_tok.pad_token_id) for mb in rank]  # noqa: E731
                         for rank in ([[0], [1, 2]], [[3, 4], [5]], [[2], [0]])]
    shards = sup.agree_head_rows(shards_of(), zero3=True)
    counts = [[len(mb["scored_index"]) for mb in rank] for rank in shards]
    assert counts[0] != counts[1]
    for k in range(2):
        assert [rank[k]["head_rows"] for rank in shards] == [max(c[k] for c in counts)] * 3
    assert not any("head_rows" in mb for rank in sup.agree_head_rows(shards_of(), zero3=False) for mb in rank)
    assert not any("head_rows" in mb for rank in sup.agree_head_rows(shards_of()[:1], zero3=True) for mb in rank)


class _Group:
    """A stand-in worker group: what ``apply`` got on each rank, a count per micro-batch back."""

    def __init__(self, world_size: int):
        self.world_size, self.got = world_size, []

    def scatter(self, method, shards, fn):
        self.got = shards
        return [[1.0 for _ in rank] for rank in shards]


@pytest.mark.parametrize("zero3", [False, True])
def test_evaluation_micro_batches_carry_the_agreed_head_rows(keymap_tok, zero3):
    pairs = _pairs(keymap_tok)
    group = _Group(world_size=2)
    sup.gather_eval(group, len(pairs), lambda u: P.collate_pairs([pairs[i] for i in u], keymap_tok.pad_token_id),
                    O.SequenceLogps(), 2, zero3)
    at_k = list(zip(*group.got))
    assert len(at_k) == 2
    for mbs in at_k:
        want = [max(len(mb["scored_index"]) for mb in mbs)] * 2 if zero3 else [None, None]
        assert [mb.get("head_rows") for mb in mbs] == want


def test_a_worker_copies_its_micro_batches_to_the_device_without_waiting_for_it():
    """A blocking copy from the host makes the host wait until the device has run everything
    queued before it (PyTorch synchronises the stream after the copy): the workers' ``_to`` asks
    for ``non_blocking`` copies (safe from pageable memory, which is staged before the call
    returns). Checked on the meta device, where the copy's arguments show."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf.workers.model import to_device

    copies = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                copies.append((kwargs or {}).get("non_blocking"))
            return func(*args, **(kwargs or {}))

    row = S.Row()
    row.add([5, 6, 7, 8], [0, 0, 1, 1], 0)
    mb = S.collate([row], 0)
    with Record():
        moved = to_device(mb, "meta")
    tensors = [k for k, v in mb.items() if torch.is_tensor(v)]
    assert copies == [True] * len(tensors) and all(moved[k].is_meta for k in tensors)
    assert moved["max_len"] == mb["max_len"]


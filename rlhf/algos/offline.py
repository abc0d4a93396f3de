"""The objectives of the offline algorithms (``OfflineAlgo``: SFT, reward model, the preference trainer:
DPO, KTO, ORPO, SimPO), the losses of the supervised loops, as ``fn(model, micro_batch, compile=...)``;
the RL objective is ``rlhf.algos.objective``.

A training worker calls ``loss, stats = fn(model, mb, compile=...)`` on each micro-batch and
backpropagates ``loss``; for evaluation it calls the same function under ``torch.no_grad``.
``model`` is the HF module (a DeepSpeed engine's ``.module`` is fine, including ZeRO-3: only the
module's own forwards are called). ``compile`` is the worker's ``train.compile_logprobs`` (the LM
head's chunk passes through torch.compile); it comes with the call so that the driver builds the
objectives without it. The functions are plain picklable objects so they travel to Ray actors.

Normalisation: each micro-batch carries ``loss_scale`` (a float tensor) that the driver set so that
summing ``loss`` over every micro-batch of every rank gives the global-batch mean (tokens for SFT,
pairs for RM/DPO), times the data-parallel world size because DeepSpeed averages gradients over
ranks (see ``rlhf.algos.losses`` for the same convention in RL). ``stats`` are sums (not means)
so the driver can add them over micro-batches and ranks and divide once; they stay tensors on the
model's device (or plain counts), which the worker adds there and reads once per optimizer step:
reading each on the host here would make the host wait for the device on every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from rlhf.algos.preference import bradley_terry_loss, kto_loss, kto_reference_point, pair_preference_loss
from rlhf.data.preference import last_token_values, sequence_logps
from rlhf.data.sft import model_inputs

Stats = dict[str, Union[torch.Tensor, float]]  # 0-d tensors on the model's device, or plain counts


def _inputs(model: Any, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cfg = getattr(model, "config", None)
    attn = getattr(cfg, "_attn_implementation", None) or "sdpa"
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    return model_inputs(mb, dtype=dtype, attn_impl=attn)


def backbone_hidden(model: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The backbone's last hidden states of a supervised micro-batch, ``[B, T, h]`` (zeros at padding).

    A model that attends with ``rlhf_varlen`` (every training worker's: ``rlhf.models.varlen``)
    gets the batch padding-free: every example's real tokens end to end in one row, attention
    kept to each example by ``cu_seq_lens`` (FlashAttention's varlen kernel on CUDA), so neither
    padding nor a ``T × T`` mask for packed rows is computed; where each example's tokens are
    (``real_index``, ``cu_seqlens``, ``max_len``) comes with the micro-batch from its collate.
    Other models take the padded rows with their mask (``rlhf.data.sft.model_inputs``)."""
    from rlhf.models.varlen import NAME, packed_kwargs

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(hf.config, "_attn_implementation", None) != NAME:
        return hf.base_model(**_inputs(model, mb), use_cache=False).last_hidden_state
    # where the real tokens are came with the micro-batch, worked out on the host (the collates'
    # rlhf.data.sft.padding_free_index): finding them here would read device values back
    B, T = mb["input_ids"].shape
    index = mb["real_index"]
    ids, pos = mb["input_ids"].flatten()[index], mb["position_ids"].flatten()[index]
    packed = {"input_ids": ids[None], "position_ids": pos[None], "cu_seqlens": mb["cu_seqlens"], "max_len": mb["max_len"]}
    flat = hf.base_model(**packed_kwargs(packed, ids.device)).last_hidden_state[0]
    return flat.new_zeros(B * T, flat.shape[-1]).index_copy(0, index, flat).view(B, T, -1)


def token_logps(model: Any, mb: dict[str, torch.Tensor], keep: Optional[torch.Tensor] = None,
                compile: bool = False) -> torch.Tensor:
    """``[B, T]``: at each position t where ``keep[:, t]`` (default: ``loss_mask``) the log-prob of
    ``input_ids[:, t]`` given the tokens before it; 0 elsewhere, and always at position 0 (nothing
    predicts it).

    The backbone's hidden states go through the LM head at the kept positions only, in chunks
    (``rlhf.algos.logprobs_from_hidden``, as in the RL passes): no ``[B, T, V]`` logits, and no
    head work for prompt tokens or padding.

    Without ``keep``, a micro-batch from the collates (``rlhf.data.sft.collate``,
    ``rlhf.data.preference.collate_pairs``) brings its positions as ``scored_index``, found on the
    host, and ``head_rows`` where the driver agreed the LM head's rows over ZeRO-3 ranks
    (``rlhf.workers.zero3.equal_head_rows``): rows are picked and put back by index, so the pass
    reads nothing back from the device. A boolean ``keep`` (or a micro-batch without the index)
    costs a device-to-host read of each mask's count (and, under ZeRO-3, a collective)."""
    from rlhf.algos import logprobs_from_hidden
    from rlhf.workers.zero3 import equal_head_rows

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft keeps its LoRA layers
    head = hf.get_output_embeddings()
    hidden = backbone_hidden(model, mb)
    at = mb.get("scored_index") if keep is None else None
    if at is not None:
        B, T = mb["input_ids"].shape
        # the hidden state at t - 1 predicts token t (t is never a row's position 0: same row)
        h = hidden.reshape(B * T, -1).index_select(0, at - 1)
        y = mb["input_ids"].reshape(-1).index_select(0, at)
        h, y, n = equal_head_rows(h, y, head, mb.get("head_rows"))
        lp, _ = logprobs_from_hidden(h, head, y, vocab=hf.config.vocab_size, compile=compile)
        return lp.new_zeros(B * T).index_copy(0, at, lp[:n]).view(B, T)
    keep = (mb["loss_mask"] if keep is None else keep).to(torch.bool).clone()
    keep[:, 0] = False
    pred = keep[:, 1:]  # the hidden state at t - 1 predicts token t
    h, y, n = equal_head_rows(hidden[:, :-1][pred], mb["input_ids"][:, 1:][pred], head)
    lp, _ = logprobs_from_hidden(h, head, y, vocab=hf.config.vocab_size, compile=compile)
    out = torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device)
    out[keep] = lp[:n]
    return out


def _response(mb: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """The positions ``sequence_logps`` sums, response tokens of real sequences, as ``keep`` for
    ``token_logps``: None where the micro-batch carries them as ``scored_index`` (its collate
    found the same positions on the host)."""
    from rlhf.data.preference import summed_positions

    return None if "scored_index" in mb else summed_positions(mb)


def _n_seqs(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["last"].shape[0])


@dataclass
class SFTObjective:
    """Next-token loss on response tokens (``loss_mask``), token mean over the global batch:
    ``nll_sum = -Σ_{trained t} log p(x_t | x_<t)`` (``rlhf.algos.preference.sft_loss``, computed
    from the hidden states at the trained positions only, see ``token_logps``)."""

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> tuple[torch.Tensor, Stats]:
        nll = -token_logps(model, mb, compile=compile).sum()  # over loss_mask, position 0 left out
        loss = nll * mb["loss_scale"].to(nll.dtype)
        return loss, {"nll_sum": nll.detach(), "tokens": (mb["loss_mask"][:, 1:] != 0).sum()}


def sequence_scores(model: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """A sequence-classification model's score at each sequence's last token, ``[n_seqs]``.

    Runs the backbone and the score head separately so that packed rows (several sequences in one
    row) work; the head is ``score`` (Llama, Qwen2, Mistral, Gemma...) or ``classifier``."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no score/classifier head")
    hidden = backbone_hidden(model, mb)
    values = head(hidden).squeeze(-1).float()
    return last_token_values(values, mb)


@dataclass
class RMObjective:
    """Bradley-Terry loss on (chosen, rejected) scores; sequence 2i is chosen, 2i+1 rejected."""

    margin: Optional[float] = None

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> tuple[torch.Tensor, Stats]:
        # ``compile`` is for LM heads; a score head is one small matmul
        s = sequence_scores(model, mb)
        chosen, rejected = s[0::2], s[1::2]
        m = None if self.margin is None else torch.full_like(chosen, float(self.margin))
        loss, acc = bradley_terry_loss(chosen, rejected, m)
        total = loss.sum()
        return total * mb["loss_scale"].to(total.dtype), {
            "loss_sum": total.detach(),
            "correct": acc.detach().sum(),
            "pairs": float(chosen.numel()),
            "chosen_score_sum": chosen.detach().sum(),
            "rejected_score_sum": rejected.detach().sum(),
        }


@dataclass
class SequenceLogps:
    """Summed response log-probs per sequence (for the frozen reference): ``fn(model, mb) -> [n]``."""

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> torch.Tensor:
        return sequence_logps(token_logps(model, mb, _response(mb), compile), mb, _n_seqs(mb)).float()


@dataclass
class DPOObjective:
    """The preference trainer's loss (``algo.loss_type``) on summed response log-probs; the reference
    log-probs, where the method has a reference term, come in the micro-batch (``ref_logp
    [n_seqs]``, computed once before training).

    * pairs (DPO / IPO / hinge / cDPO, ORPO, SimPO): sequence 2i is pair i's chosen, 2i+1 its
      rejected; ORPO and SimPO divide by the responses' lengths (``response_tokens``);
    * ``kto``: unit i is one completion (sequence 2i, ``desirable[i]``) and its mismatched pair
      (2i+1), whose policy-reference log-ratios give the micro-batch's reference point ``z0``
      (``rlhf.algos.preference.kto_reference_point``)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False
    gamma: float = 1.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> tuple[torch.Tensor, Stats]:
        logp = sequence_logps(token_logps(model, mb, _response(mb), compile), mb, _n_seqs(mb))
        ref = mb.get("ref_logp")
        if self.loss_type == "kto":
            return self._kto(logp, ref.to(logp.dtype), mb)
        n = mb["response_tokens"]
        loss, m = pair_preference_loss(
            self.loss_type, logp[0::2], logp[1::2], None if ref is None else ref[0::2], None if ref is None else ref[1::2],
            n[0::2], n[1::2], beta=self.beta, label_smoothing=self.label_smoothing, reference_free=self.reference_free,
            gamma=self.gamma)
        total = loss.sum()
        return total * mb["loss_scale"].to(total.dtype), {
            "loss_sum": total.detach(),
            "pairs": float(loss.numel()),
            "correct": m["accuracy"].detach().sum(),
            "chosen_reward_sum": m["chosen_reward"].detach().sum(),
            "rejected_reward_sum": m["rejected_reward"].detach().sum(),
            "margin_sum": m["margin"].detach().sum(),
            "chosen_logp_sum": logp[0::2].detach().sum(),
            "rejected_logp_sum": logp[1::2].detach().sum(),
        }

    def _kto(self, logp: torch.Tensor, ref: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Stats]:
        z0 = kto_reference_point(logp[1::2], ref[1::2])
        d = mb["desirable"].to(logp.device)
        loss, m = kto_loss(logp[0::2], ref[0::2], d, z0, beta=self.beta, desirable_weight=self.desirable_weight,
                           undesirable_weight=self.undesirable_weight)
        total = loss.sum()
        reward = m["reward"]
        return total * mb["loss_scale"].to(total.dtype), {
            "loss_sum": total.detach(),
            "pairs": float(loss.numel()),  # examples: the step's units
            "correct": m["accuracy"].sum(),
            "desirable": d.sum(),
            "desirable_reward_sum": torch.where(d, reward, torch.zeros_like(reward)).sum(),
            "undesirable_reward_sum": torch.where(d, torch.zeros_like(reward), reward).sum(),
            "z0_sum": z0 * loss.numel(),  # weighted by examples: the step's mean z0
        }


@dataclass
class SFTRowNLL:
    """Per row: (summed NLL of its trained tokens, number of trained tokens) → ``[B, 2]``."""

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> torch.Tensor:
        lp = token_logps(model, mb, compile=compile)
        m = mb["loss_mask"].to(lp.dtype)
        m[:, 0] = 0
        return torch.stack([-(lp * m).sum(-1), m.sum(-1)], dim=-1).float()


@dataclass
class SequenceScores:
    """A reward model's score of every sequence, ``[n_seqs]``."""

    def __call__(self, model: Any, mb: dict[str, torch.Tensor], compile: bool = False) -> torch.Tensor:
        return sequence_scores(model, mb)

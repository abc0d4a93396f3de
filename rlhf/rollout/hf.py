"""The Hugging Face rollout engine (CPU, and GPU without vLLM): sampling with a causal LM and its KV
cache, one token step at a time, every sample from its own seeded generator. It implements
``rlhf.rollout.engine.RolloutEngine``; its kind (``rlhf.rollout.registry.HFKind``) loads the model."""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.data.batch import padded_rows
from rlhf.rollout.engine import Sample, Sampling, one_request


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


# the Exp(1) draws made ahead for the next tokens of a call, at most this many values at once
NOISE_ELEMENTS = 1 << 22


def exponential_noise(generators: list[torch.Generator], rows: list[int], steps: int, vocab: int) -> torch.Tensor:
    """``[len(generators), steps, vocab]``: for each row ``b`` of ``rows``, its next ``steps`` draws
    of ``vocab`` Exp(1) values from ``generators[b]``, in one call per row (the same values in the
    same order as ``steps`` calls of ``vocab`` each: a test checks); ones in the other rows."""
    q = torch.ones(len(generators), steps, vocab)
    for b in rows:
        q[b].exponential_(generator=generators[b])
    return q


def draw_rows(probs: torch.Tensor, noise: torch.Tensor, rows: list[int], fill: int) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` for the rows ``rows`` (the others get ``fill``),
    with ``noise`` ``[B, V]`` the rows' Exp(1) draws for this token (``exponential_noise``).

    ``torch.multinomial(probs[b], 1, generator=g_b)`` runs an exponential race, ``argmax(p / q)``
    with ``q ~ Exp(1)`` drawn from ``g_b`` (the Gumbel-max trick with the exponential applied):
    given the same draws, this picks the same token. Here all the rows race in one division and
    argmax, with one validity check, instead of a call (its checks, its read-back) per row; a
    test compares it with ``torch.multinomial``."""
    out = torch.full((probs.shape[0],), fill, dtype=torch.long)
    if not rows:
        return out
    every = len(rows) == probs.shape[0]
    p = probs if every else probs[rows]
    if not bool(((p >= 0) & (p < float("inf"))).all()):  # NaN fails both
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((p.sum(-1) == 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    out[rows] = (p / (noise if every else noise[rows])).argmax(-1)
    return out


def _first_of_each(keys: list[int]) -> tuple[list[int], list[int]]:
    """(the first row of each distinct key, in order; for every row, where its key's first row
    sits in that list)."""
    where: dict[int, int] = {}
    firsts: list[int] = []
    copies = []
    for b, k in enumerate(keys):
        if k not in where:
            where[k] = len(firsts)
            firsts.append(b)
        copies.append(where[k])
    return firsts, copies


class HFEngine:
    """Sampling with a Hugging Face causal LM and its KV cache, one token step at a time."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int, device: str = "cpu", max_batch: int = 256):
        self.model = model.eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.device = device
        self.max_batch = max_batch

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(named_tensors, strict=False)
        if unexpected:
            raise RuntimeError(f"weight sync: unexpected parameters {unexpected[:5]}")

    def sample(self, prompt_ids: list[int], sampling: Sampling) -> Sample:
        """One continuation of ``prompt_ids`` (``RolloutEngine.sample``)."""
        return self.generate([list(prompt_ids)], one_request(sampling))[0]

    # nothing to give back between phases: the model stays where it is
    def sleep(self, level: int = 1) -> dict[str, float]:
        return {}

    def wake_up(self, tags=None) -> float:
        return 0.0

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(sampling.n)]
        seeds = list(sampling.seeds) or [0] * len(prompt_token_ids)
        out: list[Sample] = []
        for s in range(0, len(rows), self.max_batch):
            chunk = rows[s : s + self.max_batch]
            out.extend(self._generate_rows([prompt_token_ids[i] for i, _ in chunk],
                                           [seeds[i] * 1_000_003 + j for i, j in chunk], sampling,
                                           [i for i, _ in chunk]))
            for k, (i, _) in enumerate(chunk):
                out[s + k].prompt_index = i
        return out

    def _generate_rows(self, prompts: list[list[int]], row_seeds: list[int], sp: Sampling,
                       prompt_keys: Optional[list[int]] = None) -> list[Sample]:
        """``prompt_keys``: which rows hold the same prompt (the samples of one prompt share a key);
        such rows share one prefill, whose KV cache and last logits are copied to each of them."""
        B = len(prompts)
        P = max(len(p) for p in prompts)
        ids, attn = padded_rows(prompts, P, self.pad, left=True)
        ids, attn = ids.to(self.device), attn.long().to(self.device)
        gens = [torch.Generator().manual_seed(int(seed) % (2**63)) for seed in row_seeds]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        done = [False] * B
        stops = {self.eos, *sp.stop_token_ids}
        responses: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        past = None
        step_ids, step_pos = ids, pos
        first = _first_of_each(prompt_keys) if prompt_keys is not None else None
        noise, noise_from = None, 0
        for step in range(sp.max_new_tokens):
            if step == 0 and first is not None and len(first[0]) < B:  # a group's prompt is prefilled once
                uniq, copies = (torch.tensor(x, device=self.device) for x in first)
                o = self.model(input_ids=ids[uniq], attention_mask=attn[uniq], position_ids=pos[uniq],
                               use_cache=True)
                past = o.past_key_values
                past.reorder_cache(copies)
                last = o.logits[copies, -1, :]
            else:
                o = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                               past_key_values=past, use_cache=True)
                past = o.past_key_values
                last = o.logits[:, -1, :]
            logits = last.float().cpu() / sp.temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(_filter_logits(logits, sp.top_k, sp.top_p), dim=-1)
            live = [b for b in range(B) if not done[b]]
            if noise is None or step - noise_from == noise.shape[1]:
                # the live rows' draws for the next tokens at once; a row that stops before using
                # them all leaves its generator, which nothing reads again, further on
                ahead = max(1, min(sp.max_new_tokens - step, NOISE_ELEMENTS // (B * probs.shape[-1])))
                noise, noise_from = exponential_noise(gens, live, ahead, probs.shape[-1]), step
            nxt = draw_rows(probs, noise[:, step - noise_from], live, self.pad)
            # read back once per token step, not an element (and a tensor index) per row
            tokens = nxt.tolist()
            token_logp = logp_all.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
            for b in live:
                t = tokens[b]
                responses[b].append(t)
                logps[b].append(token_logp[b])
                if t in stops:
                    done[b] = True
            if all(done):
                break
            step_ids = nxt.unsqueeze(1).to(self.device)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)
        return [
            Sample(response_ids=responses[b], logprobs=logps[b],
                   finish_reason="stop" if responses[b] and responses[b][-1] in stops else "length")
            for b in range(B)
        ]

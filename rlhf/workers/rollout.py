"""Rollout engines: turn prompt token ids into sampled responses.

The interface every engine implements (the HF engine below on CPU; ``rollout_vllm.py`` on GPU):

    engine.generate(prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]
        ``n = sampling.n`` samples per prompt, prompt-major: samples of prompt i are
        ``out[i*n : (i+1)*n]``. Each ``Sample`` holds the response token ids (ending with EOS when
        it stopped), the log-probability of each sampled token under the sampling distribution
        (``log_softmax(logits / temperature)``, before top-k/top-p truncation) and the finish reason
        ("stop" | "length").
    engine.load_weights(named_tensors: dict[str, Tensor])   # weight sync after each update
    engine.sleep() / engine.wake_up()                       # free memory between phases (no-op on CPU)

Determinism: ``sampling.seeds[i]`` seeds prompt i; sample j of prompt i draws from its own
``torch.Generator`` seeded with ``seeds[i] * 1_000_003 + j``. So the same prompt with the same seed
and weights yields the same samples whichever engine, process or batch it lands in (the driver
derives the seeds from the run seed, the step and the prompt's position in the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seeds: tuple[int, ...] = ()  # one per prompt


@dataclass
class Sample:
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length
    prompt_index: int = 0


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]: ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


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

    def sleep(self) -> None:  # nothing to free on CPU
        pass

    def wake_up(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(sampling.n)]
        seeds = list(sampling.seeds) or [0] * len(prompt_token_ids)
        out: list[Sample] = []
        for s in range(0, len(rows), self.max_batch):
            chunk = rows[s : s + self.max_batch]
            out.extend(self._generate_rows([prompt_token_ids[i] for i, _ in chunk],
                                           [seeds[i] * 1_000_003 + j for i, j in chunk], sampling))
            for k, (i, _) in enumerate(chunk):
                out[s + k].prompt_index = i
        return out

    def _generate_rows(self, prompts: list[list[int]], row_seeds: list[int], sp: Sampling) -> list[Sample]:
        B = len(prompts)
        P = max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[b, P - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        gens = [torch.Generator().manual_seed(int(seed) % (2**63)) for seed in row_seeds]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        done = torch.zeros(B, dtype=torch.bool)
        responses: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        past = None
        step_ids, step_pos = ids, pos
        for _ in range(sp.max_new_tokens):
            o = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                           past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1, :].float().cpu() / sp.temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(_filter_logits(logits, sp.top_k, sp.top_p), dim=-1)
            nxt = torch.empty(B, dtype=torch.long)
            for b in range(B):
                nxt[b] = self.pad if done[b] else torch.multinomial(probs[b], 1, generator=gens[b])[0]
            for b in range(B):
                if not done[b]:
                    t = int(nxt[b])
                    responses[b].append(t)
                    logps[b].append(float(logp_all[b, t]))
                    if t == self.eos:
                        done[b] = True
            if bool(done.all()):
                break
            step_ids = nxt.unsqueeze(1).to(self.device)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)
        return [
            Sample(response_ids=responses[b], logprobs=logps[b],
                   finish_reason="stop" if responses[b] and responses[b][-1] == self.eos else "length")
            for b in range(B)
        ]


def make_engine(spec, model, tokenizer, device: str = "cpu") -> RolloutEngine:
    """The rollout engine for ``spec.rollout_engine``: hf here; vllm from rollout_vllm.py (GPU)."""
    if spec.rollout_engine == "hf":
        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device=device)
    if spec.rollout_engine == "vllm":
        from rlhf.workers import rollout_vllm  # type: ignore[attr-defined]  # added by the GPU issue

        return rollout_vllm.VLLMEngine(spec, tokenizer)
    raise ValueError(f"unknown rollout engine {spec.rollout_engine!r}")


# ----------------------------------------------------------------------------- the Ray worker

from rlhf.workers.base import Worker  # noqa: E402
from rlhf.workers.rollout_vllm import EngineCallsMixin  # noqa: E402  (GPU weight sync, sleep/wake)


class RolloutWorker(EngineCallsMixin, Worker):
    """One rollout engine (a TP group's rank 0 on GPU; one process on CPU)."""

    def setup(self) -> None:
        from rlhf.models import load_model, load_tokenizer, model_dir

        path = model_dir(self.spec)
        self.tokenizer = load_tokenizer(path)
        model = None
        if self.spec.rollout_engine == "hf":
            model = load_model(path, "causal_lm", "float32" if self.device == "cpu" else self.spec.model.dtype,
                               pad_token_id=self.tokenizer.pad_token_id)
            if self.device == "cuda":
                model = model.cuda()
        self.engine = make_engine(self.spec, model, self.tokenizer, device="cpu" if self.device == "cpu" else "cuda")

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        # HF engines need no process group; a vLLM engine sets up its own TP group.
        self.setup()

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        return self.engine.generate(prompt_token_ids, sampling)

    def load_weights(self, named_tensors: dict) -> None:
        self.engine.load_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

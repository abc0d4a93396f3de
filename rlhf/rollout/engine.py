"""Rollout engines: turn prompt token ids into sampled responses.

The interface every engine implements (``rlhf.rollout.hf.HFEngine`` on CPU,
``rlhf.rollout.vllm.VLLMEngine`` on GPU):

    engine.generate(prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]
        ``n = sampling.n`` samples per prompt, prompt-major: samples of prompt i are
        ``out[i*n : (i+1)*n]``. Each ``Sample`` holds the response token ids (ending with EOS when
        it stopped), the log-probability of each sampled token under the sampling distribution
        (``log_softmax(logits / temperature)``, before top-k/top-p truncation) and the finish reason
        ("stop" | "length").
    engine.load_weights(named_tensors: dict[str, Tensor])   # weight sync after each update

A vLLM engine also sleeps and wakes between phases and loads weights over CUDA IPC or NCCL (its own
methods, called by ``rlhf.workers.schedule`` and ``rlhf.workers.sync_cuda`` on GPU runs only).

Determinism: ``sampling.seeds[i]`` seeds prompt i; sample j of prompt i draws from its own
``torch.Generator`` seeded with ``seeds[i] * 1_000_003 + j``. So the same prompt with the same seed
and weights yields the same samples whichever engine, process or batch it lands in (the driver
derives the seeds from the run seed, the step and the prompt's position in the step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    """One generated response."""

    response_ids: list[int]
    logprobs: list[float]  # of each sampled token ([] when not requested)
    finish_reason: str  # stop | length
    prompt_index: int = 0  # its prompt's position in the list the engine (or ``generate``) got


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]: ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

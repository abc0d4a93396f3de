"""Prompts sharded over the rollout engines: contiguous chunks, one call per engine, samples back
in prompt-major order with ``prompt_index`` counting from the first prompt of the call."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from rlhf.rollout.engine import Sample, Sampling
from rlhf.spec.runspec import RunSpec


def sampling_for(spec: RunSpec, step: int, first_prompt: int, n_prompts: int) -> Sampling:
    """The rollout settings of a step's prompts ``first_prompt ...``; each prompt's seed depends on
    the run seed, the step and its position, so a sample does not depend on where it is generated
    (``rollout.seeded``; unseeded, vLLM samples the whole batch at once)."""
    seeds = tuple(spec.train.seed * 1_000_000_007 + step * 100_003 + first_prompt + i for i in range(n_prompts)) \
        if spec.rollout.seeded else ()
    r = spec.rollout
    return Sampling(n=spec.algo.group_size, max_new_tokens=r.max_response_tokens, temperature=r.temperature,
                    top_p=r.top_p, top_k=r.top_k, seeds=seeds)


@dataclass
class Launched:
    """Generation calls in flight: one Ray object ref per engine that got prompts, and the index of
    each part's first prompt."""

    refs: list
    starts: list[int]

    def samples(self, parts: Sequence[list[Sample]]) -> list[Sample]:
        """The parts (``ray.get(self.refs)``) as one list, ``prompt_index`` over all the prompts."""
        out: list[Sample] = []
        for lo, part in zip(self.starts, parts):
            for s in part:
                s.prompt_index += lo
                out.append(s)
        return out


def launch(engines: Sequence[Any], prompts: list[list[int]], sampling: Sampling) -> Launched:
    """Start ``generate`` on every engine (Ray actor handles) with its contiguous share of
    ``prompts`` and of ``sampling.seeds``; returns without waiting."""
    n = len(prompts)
    per = math.ceil(n / len(engines))
    refs, starts = [], []
    for e, engine in enumerate(engines):
        lo, hi = e * per, min(n, (e + 1) * per)
        if lo >= hi:
            continue
        refs.append(engine.generate.remote(prompts[lo:hi], dataclasses.replace(sampling, seeds=sampling.seeds[lo:hi])))
        starts.append(lo)
    return Launched(refs, starts)


def generate(engines: Sequence[Any], prompts: list[list[int]], sampling: Sampling) -> list[Sample]:
    """``sampling.n`` samples of every prompt, prompt-major, split over ``engines``."""
    import ray

    launched = launch(engines, prompts, sampling)
    return launched.samples(ray.get(launched.refs))

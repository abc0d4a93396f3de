"""The rollout engine interface: what every engine implements, and the types it speaks.

An engine turns prompt token ids into sampled continuations. Two ship with rlhf, the HF engine
(``rlhf.rollout.hf``, CPU and GPU) and vLLM (``rlhf.rollout.vllm``, GPU); others register from a
plugin module (``rlhf.rollout.registry``). One engine lives in each rollout worker
(``rlhf.workers.rollout.RolloutWorker``, a Ray actor), which forwards the driver's calls to it.

``RolloutEngine`` (below) is the interface:

* ``generate(prompt_token_ids, sampling) -> list[Sample]``: the batched call of an RL step.
  ``n = sampling.n`` samples per prompt, prompt-major: samples of prompt i are
  ``out[i*n : (i+1)*n]``, each with ``prompt_index = i``.
* ``sample(prompt_ids, sampling) -> Sample``: ONE continuation of one token sequence, for a
  caller that drives trajectories one request at a time (a multi-turn agent: each trajectory
  sends its next turn when its tool call returns, not in lock step with the others).
  ``sampling.n`` must be 1; ``sampling.seeds``, if given, holds this request's one seed.
  Through Ray it is awaitable as it is (``await worker.sample.remote(ids, sampling)``: an
  ``ObjectRef`` is awaitable, so an asyncio loop on the driver keeps many requests in flight over
  the engines); in one process, ``RequestBatcher`` (below) gathers concurrent ``await`` calls
  into ``generate`` calls.
* ``load_weights(named_tensors)``: the trained policy's full weights by checkpoint name, after
  each update (the object-store transport, ``rlhf.workers.schedule``). The tensors may be the
  trainer's own (a CPU host hands them over within its process): copy what is kept.
* ``sleep(level) -> metrics`` / ``wake_up(tags) -> seconds``: give the device memory back while
  the models train beside the engine and take it again (an engine whose kind says it sleeps,
  ``EngineKind.sleeps``; the others return at once).
* ``close()``: free the engine (its model, its processes).

An engine whose kind receives weights on the device (``EngineKind.device_weights``: vLLM) also
has ``load_ipc``, ``load_nccl``, ``sync_done``, ``init_weight_group`` and ``weight_digest``
(``rlhf.workers.sync_cuda`` calls them through the rollout worker).

What an engine must guarantee:

* ``Sample.logprobs``: the log-probability of each sampled token under the sampling
  distribution, ``log_softmax(logits / temperature)`` before top-k/top-p truncation (what the
  trainer recomputes, so that ``rlhf.algos.kl.logprob_mismatch`` compares like with like).
* ``Sample.response_ids`` end with a stop token (EOS or one of ``sampling.stop_token_ids``) when
  the engine stopped there (``finish_reason="stop"``), else ``finish_reason="length"``.
* Determinism (an engine whose kind is ``seeded``): ``sampling.seeds[i]`` seeds prompt i; sample j
  of prompt i draws from its own generator seeded with ``seeds[i] * 1_000_003 + j``. The same
  prompt with the same seed and weights then yields the same samples whichever engine, process
  or batch it lands in, and ``sample(ids, Sampling(seeds=(s,)))`` equals sample 0 of
  ``generate([ids], Sampling(n=k, seeds=(s,)))``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seeds: tuple[int, ...] = ()  # one per prompt
    stop_token_ids: tuple[int, ...] = ()  # stop after any of these too (besides the tokenizer's EOS)


@dataclass
class Sample:
    """One generated response."""

    response_ids: list[int]
    logprobs: list[float]  # of each sampled token ([] when not requested)
    finish_reason: str  # stop | length
    prompt_index: int = 0  # its prompt's position in the list the engine (or ``generate``) got


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Sample]: ...

    def sample(self, prompt_ids: list[int], sampling: Sampling) -> Sample: ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def sleep(self, level: int = 1) -> dict[str, float]: ...

    def wake_up(self, tags: Any = None) -> float: ...

    def close(self) -> None: ...


def one_request(sampling: Sampling) -> Sampling:
    """``sampling`` checked for one continuation (``RolloutEngine.sample``): n = 1, one seed at most."""
    if sampling.n != 1 or len(sampling.seeds) > 1:
        raise ValueError(f"sample() draws one continuation: got n={sampling.n} and {len(sampling.seeds)} seeds "
                         "(use generate() for several)")
    return sampling


class RequestBatcher:
    """Per-request sampling over an engine's batched ``generate``, in one process's asyncio loop:
    ``await batcher.sample(ids, sampling)`` from many tasks at once; the requests waiting when
    the loop next runs the batcher go to the engine as one ``generate`` per distinct sampling
    setting (seeds aside), in a worker thread so the loop keeps serving. Each request's seed
    stays its own, so the results equal what ``engine.sample`` gives one at a time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pending: list[tuple[list[int], Sampling, asyncio.Future]] = []
        self._flush: asyncio.Task | None = None

    async def sample(self, prompt_ids: list[int], sampling: Sampling) -> Sample:
        one_request(sampling)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), sampling, fut))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._run())
        return await fut

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let the other ready tasks add their requests first
        while self._pending:
            batch, self._pending = self._pending, []
            groups: dict[tuple[Sampling, bool], list[tuple[list[int], Sampling, asyncio.Future]]] = {}
            for req in batch:  # seeded and unseeded requests apart: a batch has a seed per prompt or none
                groups.setdefault((dataclasses.replace(req[1], seeds=()), bool(req[1].seeds)), []).append(req)
            for (common, seeded), reqs in groups.items():
                sp = dataclasses.replace(common, seeds=tuple(r[1].seeds[0] for r in reqs) if seeded else ())
                try:
                    out = await asyncio.to_thread(self.engine.generate, [r[0] for r in reqs], sp)
                except Exception as e:  # noqa: BLE001 - every waiting request sees the engine's error
                    for r in reqs:
                        r[2].set_exception(e)
                    continue
                for r, s in zip(reqs, out):
                    s.prompt_index = 0
                    r[2].set_result(s)

"""Async rollouts for the RL loop (``algo.async_steps=k``, 0 = off).

While the trainers update on step t's batch, the rollout engines already sample the batches of
steps t+1 … t+k with the weights they hold (the policy before update t): generation overlaps the
update, and a batch is at most k policy updates stale. The rollout engines run their calls in
order, so the weight sync after update t lands after those generations, and later ones use the new
weights. The prompts, seeds and data order are the same as without async (the data source is read
ahead in step order), so only the sampling policy differs.

Off-policy correction: the trainer recomputes ``old_logp`` with its current policy and the loss
weights each token by ``min(exp(old_logp - rollout_logp), algo.tis_cap)`` (truncated importance
sampling, ``rlhf.algos.policy_loss``). Metrics: ``async/staleness`` (updates between the sampling
and the training policy), ``async/generate_s`` (wall time of the prefetched generation) and
``async/overlap_s`` (the part of it hidden behind the update).

Placement: any. Where the engines share GPUs with the trainers (hybrid), the build keeps them awake
and the training states resident (``placement.sleep_rollout`` / ``offload_train_state`` auto, the
plan's training phase holding both; ``rlhf.plan.auto``), so the schedule moves no memory and the
weight sync (CUDA IPC) waits for the generation in flight like the disaggregated NCCL one. On CPU
the rollout workers get processes of their own (``rlhf.launch.group.can_colocate``).

Limits: not with ``algo.dynamic_sampling`` or ``env.fn`` (validation says so);
a checkpoint taken at step t records the data source after the k read-ahead batches, so a resumed
run skips those k batches (its samples are otherwise the same).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Optional

from rlhf.launch.cluster import Cluster
from rlhf.rollout.engine import Sample
from rlhf.rollout.generate import Launched, launch, sampling_for
from rlhf.data.prompts import tokenize_prompts
from rlhf.spec.runspec import RunSpec


class _Pending:
    def __init__(self, step: int, launched_after: int, rows, prompt_ids, launched: Launched):
        self.step, self.launched_after = step, launched_after
        self.rows, self.prompt_ids, self.launched = rows, prompt_ids, launched
        self.t_launch = time.perf_counter()
        self.t_done: Optional[float] = None
        self.t_update_end: Optional[float] = None  # the end of the first update it overlapped
        self.result: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        import ray

        try:
            self.result = ray.get(self.launched.refs)
        except BaseException as e:  # noqa: BLE001 (re-raised in the loop's thread)
            self.error = e
        self.t_done = time.perf_counter()


class Prefetcher:
    def __init__(self, spec: RunSpec, cluster: Cluster, data: Any, tokenizer):
        self.spec, self.cluster, self.data, self.tokenizer = spec, cluster, data, tokenizer
        self.k = spec.algo.async_steps
        self.queue: deque[_Pending] = deque()
        self.next_step: Optional[int] = None
        self.last: dict[str, float] = {}

    def launch_ahead(self, step: int) -> None:
        """During step ``step``'s update (``step`` updates done before it): launch steps up to step+k."""
        if self.next_step is None:
            self.next_step = step + 1
        while self.next_step <= min(step + self.k, self.spec.train.steps - 1):
            s = self.next_step
            P = self.spec.batch.prompts_per_step
            rows = self.data.next(P)
            prompt_ids = tokenize_prompts(self.spec, self.tokenizer, rows)
            launched = launch(self.cluster.rollout.workers, prompt_ids, sampling_for(self.spec, s, 0, P))
            self.queue.append(_Pending(s, step, rows, prompt_ids, launched))
            self.next_step += 1

    def update_done(self) -> None:
        """After an update: the generations in flight overlapped it up to now."""
        now = time.perf_counter()
        for p in self.queue:
            if p.t_update_end is None:
                p.t_update_end = now

    def take(self, step: int):
        """(rows, prompt ids, samples) of ``step`` if it was prefetched, else None."""
        if not self.queue or self.queue[0].step != step:
            self.last = {"async/staleness": 0.0, "async/generate_s": 0.0, "async/overlap_s": 0.0}
            return None
        p = self.queue.popleft()
        p.thread.join()
        if p.error is not None:
            raise p.error
        samples: list[Sample] = p.launched.samples(p.result)
        gen = p.t_done - p.t_launch
        hidden_until = p.t_update_end if p.t_update_end is not None else p.t_launch
        self.last = {"async/staleness": float(step - p.launched_after), "async/generate_s": gen,
                     "async/overlap_s": max(0.0, min(p.t_done, hidden_until) - p.t_launch)}
        return p.rows, p.prompt_ids, samples

    def close(self) -> None:
        for p in self.queue:
            p.thread.join(timeout=60)
        self.queue.clear()

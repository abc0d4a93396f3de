"""Agent rollouts in the RL loop (``agent.enabled``): a step's prompts → chat trajectories with tool
calls (``rlhf.agent.loop.AgentLoop``) → samples the trainer takes as they are.

The engines are reached per request, through the same interface whatever the engine kind:
``EnginePool.sample`` hands each trajectory's next turn to one rollout worker's ``RequestBatcher``
(``rlhf.rollout.engine``), which gathers the requests that are waiting into one batched ``generate``
call of that worker (``ray.get(worker.generate.remote(...))`` in a thread, so the event loop keeps
serving tools and the other trajectories). With HF generate (CPU, GPU) and vLLM (GPU) alike, a
trajectory that waits for a slow tool holds no batch back: the next batch leaves without it. A
request goes to the worker with the fewest requests outstanding.

What the trainer receives per trajectory (``AgentSample``): ``response_ids`` = every id after the
prompt (sampled turns and the template's ids between them), ``loss_mask`` = 1 exactly on sampled
ids, ``logprobs`` = the engine's log-probs of the sampled ids as returned (0.0 elsewhere), the
prompt ids = the chat template's rendering of the first messages with the prompt's tools. The
reward functions score the final assistant message (``responses``), with the row's other columns,
``finish_reasons`` and ``conversations`` (each trajectory's messages) as metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rlhf.agent.loop import AgentLoop, Sampled
from rlhf.agent.trajectory import Trajectory
from rlhf.launch.cluster import Cluster
from rlhf.rollout.engine import RequestBatcher, Sample, Sampling
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec


@dataclass
class AgentSample(Sample):
    loss_mask: list[int] = field(default_factory=list)  # per response id: 1 sampled, 0 template / tool answer
    turns: int = 0
    trajectory: Optional[Trajectory] = None


class RemoteEngine:
    """A rollout worker (a Ray actor handle) as the batched engine a ``RequestBatcher`` calls."""

    def __init__(self, worker: Any):
        self.worker = worker

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Sample]:
        import ray

        return ray.get(self.worker.generate.remote(prompts, sampling))


class EnginePool:
    """``sample(ids, max_new_tokens, seed)`` (the agent loop's engine call) over the rollout workers:
    a ``RequestBatcher`` per worker, each request to the one with the fewest outstanding. Made
    inside the event loop that uses it (one per ``asyncio.run``)."""

    def __init__(self, workers: Sequence[Any], base: Sampling):
        self.batchers = [RequestBatcher(RemoteEngine(w)) for w in workers]
        self.load = [0] * len(self.batchers)
        self.base = dataclasses.replace(base, n=1, seeds=())

    async def sample(self, ids: list[int], max_new_tokens: int, seed: Optional[int] = None) -> Sampled:
        k = min(range(len(self.batchers)), key=lambda i: self.load[i])
        sp = dataclasses.replace(self.base, max_new_tokens=max_new_tokens, seeds=(seed,) if seed is not None else ())
        self.load[k] += 1
        try:
            s = await self.batchers[k].sample(ids, sp)
        finally:
            self.load[k] -= 1
        return Sampled(list(s.response_ids), list(s.logprobs), s.finish_reason)


def _tool_names(value: Any, where: str) -> list[str]:
    """A row's tools column: names, or JSON schemas ({"name"} or {"function": {"name"}}) → names."""
    if not isinstance(value, list):
        raise UserError(f"{where}: the tools column should be a list of tool names, got {str(value)[:80]}.")
    names = []
    for t in value:
        if isinstance(t, str):
            names.append(t)
        elif isinstance(t, dict) and isinstance(t.get("function", t).get("name"), str):
            names.append(t.get("function", t)["name"])
        else:
            raise UserError(f"{where}: tool {str(t)[:60]} should be a name or a schema with a name.")
    return names


def conversation(row: dict, prompt_key: str) -> list[dict]:
    """A row's first messages: its prompt column as messages, or a string as one user turn."""
    value = row[prompt_key]
    if isinstance(value, list):
        return [dict(m) for m in value]
    return [{"role": "user", "content": str(value)}]


class AgentRollout:
    """The run's tools, sandbox and limits; ``run`` rolls out a step's (or an evaluation's) rows."""

    def __init__(self, spec: RunSpec, tokenizer: Any, workers: Sequence[Any]):
        from rlhf.agent import config
        from rlhf.agent.builtin_tools import load_tools
        from rlhf.agent.tools import ToolSet

        config.import_plugins(spec)
        self.spec, self.tokenizer, self.workers = spec, tokenizer, list(workers)
        self.pool = config.sandbox_pool(spec) if config.needs_sandbox(spec) else None
        self.tools = ToolSet(load_tools([_plain(e) for e in spec.agent.tools], sandbox=self.pool))
        self.limits = dataclasses.replace(config.limits(spec), max_response_tokens=spec.rollout.max_response_tokens)

    def _toolsets(self, rows: list[dict]) -> list[Any]:
        key = self.spec.data.tools_key
        out = []
        for i, row in enumerate(rows):
            names = row.get(key)
            out.append(None if names is None else self.tools.subset(_tool_names(names, f"data row {i}")))
        return out

    def run(self, rows: list[dict], sampling: Sampling) -> tuple[list[AgentSample], list[list[int]], dict]:
        """``sampling.n`` trajectories per row, row-major; (samples, each row's prompt ids, the
        ``agent/`` metrics). Seeded runs seed each trajectory's turns from the first row's seed
        and its place (``AgentLoop``), so a step samples the same whatever the interleaving."""
        from rlhf.agent.metrics import step_metrics

        n = sampling.n
        convs = [conversation(r, self.spec.data.prompt_key) for r in rows]
        toolsets = self._toolsets(rows)
        seed = sampling.seeds[0] if sampling.seeds else None

        async def go() -> list[Trajectory]:
            engines = EnginePool(self.workers, sampling)
            loop = AgentLoop(engines.sample, self.tokenizer, self.tools, parser=self.spec.agent.parser,
                             limits=self.limits, seed=seed)
            return await loop.run_many([c for c in convs for _ in range(n)], [r for r in rows for _ in range(n)],
                                       [t for t in toolsets for _ in range(n)])

        trajs = asyncio.run(go())
        samples = [AgentSample(response_ids=t.response_ids, logprobs=t.response_logprobs,
                               finish_reason="stop" if t.finish == "stop" else "length", prompt_index=k // n,
                               loss_mask=t.response_mask, turns=t.turns, trajectory=t)
                   for k, t in enumerate(trajs)]
        prompt_ids = [trajs[i * n].token_ids[: trajs[i * n].prompt_len] for i in range(len(rows))]
        return samples, prompt_ids, step_metrics(trajs)

    def score(self, rows: list[dict], samples: list[AgentSample], rewards: Any, cluster: Cluster,
              prompt_ids: list[list[int]]) -> tuple[torch.Tensor, dict]:
        """The reward of each trajectory: the reward functions on its final answer (and the reward
        model on the whole sequence)."""
        from rlhf.data.batch import collate, dp_forward
        from rlhf.workers.frozen import RewardModelWorker

        spec = self.spec
        prompts = [self.tokenizer.decode(prompt_ids[s.prompt_index], skip_special_tokens=True) for s in samples]
        responses = [s.trajectory.final_answer() for s in samples]
        keys = [k for k in rows[0] if k != spec.data.prompt_key]
        metadata = {k: [rows[s.prompt_index].get(k) for s in samples] for k in keys}
        metadata["finish_reasons"] = [s.finish_reason for s in samples]
        metadata["conversations"] = [s.trajectory.messages for s in samples]
        total, parts = rewards.score(prompts, responses, metadata) if rewards.functions else ([0.0] * len(samples), {})
        scores = torch.tensor(total, dtype=torch.float32)
        if getattr(cluster, "reward_model", None) is not None:
            batch = collate([prompt_ids[s.prompt_index] for s in samples], [s.response_ids for s in samples],
                            self.tokenizer.pad_token_id, None)
            rm = dp_forward(cluster.reward_model, RewardModelWorker.scores, batch)
            parts["model"] = rm.tolist()
            scores = scores + spec.reward.model_weight * rm
        return scores, parts

    def close(self) -> None:
        self.tools.close()
        if self.pool is not None:
            self.pool.close()


def _plain(entry: Any) -> Any:
    """A frozen config value (FrozenDict, tuple) as plain dicts and lists, as load_tools and jsonschema take it."""
    if isinstance(entry, dict):
        return {k: _plain(v) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return [_plain(v) for v in entry]
    return entry

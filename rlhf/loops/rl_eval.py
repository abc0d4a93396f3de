"""Evaluation of the RL policy on held-out prompts (``data.eval_files``), every ``eval.every`` steps
and after the last step.

For each prompt: one greedy response (top-k 1) and ``eval.n_samples`` sampled ones (the rollout's
temperature / top-p / top-k), scored by the run's reward (functions and reward model). Metrics:

    eval/greedy/reward_mean, eval/greedy/pass_rate     greedy: mean score, share scoring >= pass_threshold
    eval/sampled/reward_mean                          mean over all samples
    eval/pass_at_<k>                                  pass@k: share of prompts with any of the k =
                                                      eval.n_samples samples passing (MLflow allows no "@")
    eval/prompts                                      how many prompts were evaluated
    eval/<source>/...                                 the same per data source: the row's
                                                      ``data_source`` column, else the file's name
                                                      (``builtin:keymap/eval`` -> ``keymap/eval``)

Eval prompts longer than ``rollout.max_prompt_tokens`` are dropped (as training drops them), with
a console line. With ``checkpoint.best_metric=eval/...`` an evaluation also runs at every
checkpoint step that ``eval.every`` misses, so that each checkpoint is ranked by its own weights.

With ``agent.enabled`` each response is a whole chat with tool calls (``rlhf.agent.rollout``), scored on
its final answer like training's.

Sampling seeds are fixed per eval prompt (not per step), so evaluations differ only by the policy.
Evaluating changes no training state: the rollout engines draw from per-sample generators (no
global RNG), the reward functions run as in training, and nothing of the actor, the reference, the
data order or the KL controller is touched. A run with evaluation has the same training metrics
per step as one without (``tests/rl/test_rl_eval.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf.data.prompts import read_rows, tokenize_prompts
from rlhf.launch.cluster import Cluster
from rlhf.rewards import score_samples
from rlhf.rollout.engine import Sample, Sampling
from rlhf.rollout.generate import generate
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console


def source_name(name: str) -> str:
    """A data source as a metric-name part: letters, digits, ``_ - . /`` (MLflow's set, no space)."""
    return re.sub(r"[^\w.\-/]", "_", str(name)).strip("/") or "unknown"


class Evaluator:
    def __init__(self, spec: RunSpec, cluster: Cluster, tokenizer, rewards, console: Optional[Console] = None,
                 agent: Any = None):
        self.spec, self.cluster, self.tokenizer, self.rewards = spec, cluster, tokenizer, rewards
        self.agent = agent  # agent.enabled: prompts rolled out as chats with tool calls (rlhf.agent.rollout)
        rows: list[dict] = []
        for f in spec.data.eval_files:
            source = f.split(":", 1)[1] if f.startswith("builtin:") else Path(f).stem
            for r in read_rows(f, spec.data.prompt_key, spec.data.columns):
                rows.append({**r, "data_source": source_name(r.get("data_source") or source)})
        from rlhf.preflight import long_prompt_filter

        keep = long_prompt_filter(spec, tokenizer)
        fit = [r for r in rows if keep(r)]
        if len(fit) < len(rows) and console is not None:
            console.print(f"eval: dropped {len(rows) - len(fit)} prompts longer than rollout.max_prompt_tokens="
                          f"{spec.rollout.max_prompt_tokens}")
        if rows and not fit:
            from rlhf.spec.errors import UserError

            raise UserError(f"every prompt of data.eval_files is longer than rollout.max_prompt_tokens="
                            f"{spec.rollout.max_prompt_tokens}. Raise it, or give shorter eval prompts.")
        rows = fit
        if spec.eval.max_prompts is not None:
            rows = rows[: spec.eval.max_prompts]
        self.rows = rows
        self.prompt_ids = tokenize_prompts(spec, tokenizer, rows)
        best = spec.checkpoint.best_metric
        self.at_checkpoints = bool(best) and best.startswith("eval/")

    def due(self, step: int, ckpt: Any = None) -> bool:
        """After ``step`` (0-based): every ``eval.every`` steps and after the last one; also when
        checkpoint ``ckpt`` saves after this step and ranks checkpoints by an eval/ metric."""
        every, done = self.spec.eval.every, step + 1
        if every <= 0:
            return False
        if done % every == 0 or done == self.spec.train.steps:
            return True
        return self.at_checkpoints and ckpt is not None and ckpt.due(done, self.spec.train.steps)

    def _generate(self, sampling: Sampling) -> list[Sample]:
        if self.agent is not None:
            samples, self.agent_prompt_ids, _ = self.agent.run(self.rows, sampling)
            return samples
        return generate(self.cluster.rollout.workers, self.prompt_ids, sampling)

    def _score(self, samples: list[Sample]) -> torch.Tensor:
        if self.agent is not None:
            return self.agent.score(self.rows, samples, self.rewards, self.cluster, self.agent_prompt_ids)[0]
        scores, _ = score_samples(self.spec, self.rows, samples, self.tokenizer, self.rewards,
                                  self.cluster.reward_model, self.prompt_ids)
        return scores

    def run(self) -> dict[str, float]:
        spec, E, r = self.spec, self.spec.eval, self.spec.rollout
        if not self.rows:
            return {}
        seeds = tuple(spec.train.seed * 7_000_003 + 99_991 + i for i in range(len(self.rows)))
        greedy = self._generate(Sampling(n=1, max_new_tokens=r.max_response_tokens, temperature=1.0, top_p=1.0,
                                         top_k=1, seeds=seeds))
        sampled = self._generate(Sampling(n=E.n_samples, max_new_tokens=r.max_response_tokens,
                                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seeds=seeds))
        g = self._score(greedy)  # one per prompt, prompt order
        s = self._score(sampled).view(len(self.rows), E.n_samples)
        sources = [row["data_source"] for row in self.rows]
        out = _metrics("eval", g, s, E.pass_threshold, E.n_samples)
        for src in sorted(set(sources)):
            idx = torch.tensor([i for i, x in enumerate(sources) if x == src])
            out.update(_metrics(f"eval/{src}", g[idx], s[idx], E.pass_threshold, E.n_samples))
        return out


def _metrics(prefix: str, greedy: torch.Tensor, sampled: torch.Tensor, threshold: float, k: int) -> dict[str, float]:
    return {
        f"{prefix}/greedy/reward_mean": float(greedy.mean()),
        f"{prefix}/greedy/pass_rate": float((greedy >= threshold).float().mean()),
        f"{prefix}/sampled/reward_mean": float(sampled.mean()),
        f"{prefix}/pass_at_{k}": float((sampled >= threshold).any(dim=1).float().mean()),
        f"{prefix}/prompts": float(greedy.numel()),
    }


def make_evaluator(spec: RunSpec, cluster: Cluster, tokenizer, rewards, console: Optional[Console] = None,
                   agent: Any = None) -> Optional[Evaluator]:
    if spec.eval.every <= 0 or not spec.data.eval_files:
        return None
    return Evaluator(spec, cluster, tokenizer, rewards, console, agent)

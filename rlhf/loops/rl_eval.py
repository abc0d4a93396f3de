"""Evaluation of the RL policy on held-out prompts (``data.eval_files``), every ``eval.every`` steps
and after the last step.

For each prompt: one greedy response (top-k 1) and ``eval.n_samples`` sampled ones (the rollout's
temperature / top-p / top-k), scored by the run's reward (functions and reward model). Metrics:

    eval/greedy/reward_mean, eval/greedy/pass_rate     greedy: mean score, share scoring >= pass_threshold
    eval/sampled/reward_mean                          mean over all samples
    eval/pass@k                                       share of prompts with any of k samples passing
    eval/<source>/...                                 the same per data source: the row's
                                                      ``data_source`` column, else the file's name

Sampling seeds are fixed per eval prompt (not per step), so evaluations differ only by the policy;
they use no global RNG, so training (and a resumed run) is unaffected by evaluating.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf.data.prompts import read_rows
from rlhf.workers.rollout import Sample, Sampling


class Evaluator:
    def __init__(self, spec: Any, cluster: Any, tokenizer, rewards):
        self.spec, self.cluster, self.tokenizer, self.rewards = spec, cluster, tokenizer, rewards
        rows: list[dict] = []
        for f in spec.data.eval_files:
            source = Path(f.split(":", 1)[-1]).stem if not f.startswith("builtin:") else f.split(":", 1)[1]
            for r in read_rows(f, spec.data.prompt_key):
                rows.append({**r, "data_source": r.get("data_source") or source})
        if spec.eval.max_prompts is not None:
            rows = rows[: spec.eval.max_prompts]
        self.rows = rows
        from rlhf.loops.rl import tokenize_prompts

        self.prompt_ids = tokenize_prompts(spec, tokenizer, rows)

    def due(self, step: int) -> bool:
        """After ``step`` (0-based): every ``eval.every`` steps and after the last one."""
        every = self.spec.eval.every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.spec.train.steps)

    def _generate(self, sampling: Sampling) -> list[Sample]:
        import ray

        workers = self.cluster.rollout.workers
        n = len(self.prompt_ids)
        per = math.ceil(n / len(workers))
        refs, starts = [], []
        for e, w in enumerate(workers):
            lo, hi = e * per, min(n, (e + 1) * per)
            if lo < hi:
                part = Sampling(n=sampling.n, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, seeds=sampling.seeds[lo:hi])
                refs.append(w.generate.remote(self.prompt_ids[lo:hi], part))
                starts.append(lo)
        out: list[Sample] = []
        for lo, part in zip(starts, ray.get(refs)):
            for s in part:
                s.prompt_index += lo
                out.append(s)
        return out

    def _score(self, samples: list[Sample]) -> torch.Tensor:
        from rlhf.loops.rl import score_samples

        scores, _ = score_samples(self.spec, self.rows, samples, self.tokenizer, self.rewards, self.cluster,
                                  self.prompt_ids)
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
        f"{prefix}/pass@{k}": float((sampled >= threshold).any(dim=1).float().mean()),
        f"{prefix}/prompts": float(greedy.numel()),
    }


def make_evaluator(spec: Any, cluster: Any, tokenizer, rewards) -> Optional[Evaluator]:
    if spec.eval.every <= 0 or not spec.data.eval_files:
        return None
    return Evaluator(spec, cluster, tokenizer, rewards)

"""Reward model: a scalar head on the base model, Bradley-Terry loss on preference pairs.

    pairs (prompt, chosen, rejected) → token ids (rlhf.data.preference)
      → the actor is AutoModelForSequenceClassification(num_labels=1) from model.path (a new
        linear head ``score`` on the backbone); a pair's score is read at each sequence's last
        token (EOS), where the RL reward-model worker reads it too
      → loss = mean over the step's pairs of -log sigmoid(r_chosen - r_rejected [- margin])
      → held-out pairwise accuracy (r_chosen > r_rejected) before training, after every epoch
      → checkpoints (checkpoint.every, resume=); final/hf: a sequence-classification checkpoint
        for ``reward.model_path=<run dir>/final/hf``

``algo.margin`` subtracts a fixed margin inside the sigmoid (Llama 2); ``algo.packing`` packs a
micro-batch's sequences into shared rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.offline import RMObjective, SequenceScores
from rlhf.launch.cluster import Cluster
from rlhf.loops import supervised as sup
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker


prepare = sup.prepare_pairs  # the train/eval pairs, tokenised in the driver before the cluster starts


def run(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str,
        prepared: Optional[sup.Prepared] = None) -> dict[str, float]:
    prepared = prepared or prepare(spec, console)
    pairs, eval_pairs, counts, steps_per_epoch = sup.start_pairs(spec, prepared, tracker)
    B = spec.batch
    mb_of = sup.pair_collator(prepared, spec.algo.packing)

    def evaluate() -> dict[str, float]:
        pieces = sup.gather_eval(cluster.actor, len(eval_pairs), lambda u: mb_of(eval_pairs, u), SequenceScores(),
                                 B.micro_batch_size)
        s = sup.per_unit(pieces, len(eval_pairs), per=2)
        chosen, rejected = s[:, 0], s[:, 1]
        margin = chosen - rejected
        return {
            "eval/accuracy": float((margin > 0).float().mean()),
            "eval/loss": float(-torch.nn.functional.logsigmoid(margin).mean()),
            "eval/chosen_score": float(chosen.mean()),
            "eval/rejected_score": float(rejected.mean()),
            "eval/margin": float(margin.mean()),
        }

    def shards_of(units: list[int]) -> list[list[dict]]:
        scale = sup.scale_tensor(B.train_world_size / len(units))  # mean over the step's pairs
        return [[{**mb_of(pairs, u), "loss_scale": scale} for u in rank]
                for rank in sup.step_shards(units, spec, sup.pair_tokens(pairs))]

    def step_metrics(st: dict[str, float]) -> dict[str, float]:
        n = max(st["pairs"], 1.0)
        return {"train/loss": st["loss_sum"] / n, "train/accuracy": st["correct"] / n,
                "train/chosen_score": st["chosen_score_sum"] / n, "train/rejected_score": st["rejected_score_sum"] / n,
                "train/grad_norm": st["grad_norm"], "train/lr": st["lr"]}

    before, after, n_steps = sup.train_epochs(
        spec, cluster, tracker, console, run_dir, n_units=len(pairs), steps_per_epoch=steps_per_epoch,
        shards_of=shards_of, objective=RMObjective(margin=spec.algo.margin), step_metrics=step_metrics,
        evaluate=evaluate)
    summary = sup.pair_summary(before, after, n_steps, len(pairs), len(eval_pairs), counts, ("accuracy", "loss"))
    sup.export_final(spec, cluster, run_dir, summary, console)
    console.print(f"rm: held-out accuracy {before['eval/accuracy']:.3f} → {after['eval/accuracy']:.3f} over {n_steps} steps")
    return summary

"""DPO and its relatives (IPO, hinge/SLiC, cDPO) on preference pairs, against a frozen reference.

    pairs (prompt, chosen, rejected) → token ids (rlhf.data.preference)
      → the reference's summed response log-probs of every pair, computed ONCE before training on
        the reference workers (train and held-out sets), which are then released so the actor has
        the memory; not needed with algo.reference_free
      → for each step: the policy's summed log-probs, rlhf.algos.dpo_loss(beta, loss_type,
        label_smoothing), mean over the step's pairs
      → held-out: implicit rewards beta·(log pi - log pi_ref) of chosen and rejected, their
        margin, and preference accuracy (chosen reward > rejected reward), before training, after
        every epoch and at the end
      → checkpoints (checkpoint.every, resume=); final/hf: the policy

Before training the policy is the reference, so every implicit reward is 0 and the accuracy 0 (no
pair is strictly preferred yet); ``eval/logp_accuracy`` (log pi(chosen) > log pi(rejected)) is
the reference's own ranking for comparison.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.offline import DPOObjective, SequenceLogps
from rlhf.algos.preference import dpo_loss
from rlhf.launch.cluster import Cluster
from rlhf.loops import supervised as sup
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker


prepare = sup.prepare_pairs  # the train/eval pairs, tokenised in the driver before the cluster starts


def run(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str,
        prepared: Optional[sup.Prepared] = None) -> dict[str, float]:
    algo = spec.algo
    prepared = prepared or prepare(spec, console)
    pairs, eval_pairs, counts, steps_per_epoch = sup.start_pairs(spec, prepared, tracker)
    B = spec.batch
    zero3 = spec.train.zero_stage == 3  # the reference is sharded as the actor is
    mb_of = sup.pair_collator(prepared, algo.packing)

    def logps(group, ps) -> torch.Tensor:
        """[n, 2]: summed response log-probs of (chosen, rejected) of every pair."""
        pieces = sup.gather_eval(group, len(ps), lambda u: mb_of(ps, u), SequenceLogps(),
                                 B.micro_batch_size, zero3)
        return sup.per_unit(pieces, len(ps), per=2)

    # ---- the frozen reference, once
    ref_train = ref_eval = None
    if not algo.reference_free:
        ref_train, ref_eval = logps(cluster.reference, pairs), logps(cluster.reference, eval_pairs)
        console.print(f"reference log-probs: {len(pairs)} train + {len(eval_pairs)} held-out pairs "
                      "(reference workers released)")
        cluster.groups.pop("reference").release()  # its memory goes back to the actor (hybrid placement)

    def evaluate() -> dict[str, float]:
        pol, ref = logps(cluster.actor, eval_pairs), ref_eval
        loss, m = dpo_loss(pol[:, 0], pol[:, 1], None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
                           beta=algo.beta, loss_type=algo.loss_type, label_smoothing=algo.label_smoothing,
                           reference_free=algo.reference_free)
        return {
            "eval/accuracy": float(m["accuracy"].mean()),
            "eval/loss": float(loss.mean()),
            "eval/chosen_reward": float(m["chosen_reward"].mean()),
            "eval/rejected_reward": float(m["rejected_reward"].mean()),
            "eval/margin": float(m["margin"].mean()),
            "eval/logp_accuracy": float((pol[:, 0] > pol[:, 1]).float().mean()),
        }

    def shards_of(units: list[int]) -> list[list[dict]]:
        scale = sup.scale_tensor(B.train_world_size / len(units))  # mean over the step's pairs
        out = []
        for rank in sup.step_shards(units, spec, sup.pair_tokens(pairs)):
            mbs = []
            for u in rank:
                mb = {**mb_of(pairs, u), "loss_scale": scale}
                if ref_train is not None:
                    mb["ref_logp"] = ref_train[u].reshape(-1)  # chosen, rejected, chosen, ... as the sequences
                mbs.append(mb)
            out.append(mbs)
        return sup.agree_head_rows(out, zero3)

    def step_metrics(st: dict[str, float]) -> dict[str, float]:
        n = max(st["pairs"], 1.0)
        return {"train/loss": st["loss_sum"] / n, "train/accuracy": st["correct"] / n,
                "train/chosen_reward": st["chosen_reward_sum"] / n, "train/rejected_reward": st["rejected_reward_sum"] / n,
                "train/margin": st["margin_sum"] / n, "train/chosen_logp": st["chosen_logp_sum"] / n,
                "train/rejected_logp": st["rejected_logp_sum"] / n, "train/grad_norm": st["grad_norm"],
                "train/lr": st["lr"]}

    objective = DPOObjective(beta=algo.beta, loss_type=algo.loss_type, label_smoothing=algo.label_smoothing,
                             reference_free=algo.reference_free)
    before, after, n_steps = sup.train_epochs(
        spec, cluster, tracker, console, run_dir, n_units=len(pairs), steps_per_epoch=steps_per_epoch,
        shards_of=shards_of, objective=objective, step_metrics=step_metrics, evaluate=evaluate)
    summary = sup.pair_summary(before, after, n_steps, len(pairs), len(eval_pairs), counts,
                               ("accuracy", "logp_accuracy", "loss"))
    sup.export_final(spec, cluster, run_dir, summary, console)
    console.print(f"dpo ({algo.loss_type}): held-out preference accuracy {before['eval/accuracy']:.3f} → "
                  f"{after['eval/accuracy']:.3f}, margin {after['eval/margin']:.3f}, over {n_steps} steps")
    return summary

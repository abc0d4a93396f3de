"""The preference trainer: DPO and its relatives (IPO, hinge/SLiC, cDPO) against a frozen reference,
KTO on unpaired completions against it, ORPO and SimPO without one (``algo.loss_type``).

    pairs (prompt, chosen, rejected) → token ids (rlhf.data.preference); kto: unpaired examples
      (a completion and its label; a pair gives one desirable and one undesirable), each with
      another example's completion as its mismatched pair (KTO's reference point z0)
      → the reference's summed response log-probs of every unit's two sequences, computed ONCE
        before training on the reference workers (train and held-out sets), which are then released
        so the actor has the memory; not needed by orpo, simpo or algo.reference_free
      → for each step: the policy's summed log-probs, the method's loss
        (rlhf.algos.preference), mean over the step's units
      → held-out: the implicit rewards of chosen and rejected (beta·log pi/pi_ref; orpo and simpo:
        the length-normalised log-prob), their margin, and preference accuracy (chosen reward >
        rejected reward), before training, after every epoch and at the end; kto with unpaired
        held-out rows: the share whose reward's sign agrees with the label
      → checkpoints (checkpoint.every, resume=); final/hf: the policy

Before training the policy is the reference, so every implicit reward of dpo and kto is 0 and the
accuracy 0 (no pair is strictly preferred yet); ``eval/logp_accuracy`` (log pi(chosen) > log
pi(rejected)) is the reference's own ranking for comparison. orpo and simpo start from the model's
own length-normalised ranking.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.offline import DPOObjective, SequenceLogps
from rlhf.algos.preference import kto_loss, pair_preference_loss
from rlhf.launch.cluster import Cluster
from rlhf.loops import supervised as sup
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker


def prepare(spec: RunSpec, console: Optional[Console] = None) -> sup.Prepared:
    """The train/eval units, tokenised in the driver before the cluster starts: pairs, or kto's
    unpaired examples (held out as pairs when the held-out rows are pairs)."""
    if spec.algo.loss_type == "kto":
        return sup.prepare_unpaired(spec, console)
    return sup.prepare_pairs(spec, console)


def _tokens(units: list) -> torch.Tensor:
    """[n, 2]: the response tokens of every unit's two sequences."""
    return torch.tensor([[len(r) for r in u.responses()] for u in units], dtype=torch.float32).reshape(len(units), 2)


def run(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str,
        prepared: Optional[sup.Prepared] = None) -> dict[str, float]:
    from rlhf.data.preference import Unpaired

    algo = spec.algo
    method = algo.loss_type
    prepared = prepared or prepare(spec, console)
    pairs, eval_pairs, counts, steps_per_epoch = sup.start_pairs(spec, prepared, tracker)
    B = spec.batch
    zero3 = spec.train.zero_stage == 3  # the reference is sharded as the actor is
    mb_of = sup.pair_collator(prepared, algo.packing)
    eval_tokens = _tokens(eval_pairs)
    eval_unpaired = bool(eval_pairs) and isinstance(eval_pairs[0], Unpaired)

    def logps(group, ps) -> torch.Tensor:
        """[n, 2]: summed response log-probs of every unit's two sequences (chosen, rejected)."""
        pieces = sup.gather_eval(group, len(ps), lambda u: mb_of(ps, u), SequenceLogps(),
                                 B.micro_batch_size, zero3)
        return sup.per_unit(pieces, len(ps), per=2)

    # ---- the frozen reference, once
    ref_train = ref_eval = None
    if "reference" in spec.roles:
        ref_train, ref_eval = logps(cluster.reference, pairs), logps(cluster.reference, eval_pairs)
        console.print(f"reference log-probs: {len(pairs)} train + {len(eval_pairs)} held-out units "
                      "(reference workers released)")
        cluster.groups.pop("reference").release()  # its memory goes back to the actor (hybrid placement)

    def evaluate() -> dict[str, float]:
        pol, ref = logps(cluster.actor, eval_pairs), ref_eval
        if eval_unpaired:  # kto's held-out examples: does the reward's sign agree with the label?
            d = torch.tensor([u.desirable for u in eval_pairs])
            loss, m = kto_loss(pol[:, 0], ref[:, 0], d, torch.zeros(()), beta=algo.beta,
                               desirable_weight=algo.desirable_weight, undesirable_weight=algo.undesirable_weight)
            r = m["reward"]
            good, bad = float(r[d].mean()) if d.any() else 0.0, float(r[~d].mean()) if (~d).any() else 0.0
            return {"eval/accuracy": float(m["accuracy"].mean()), "eval/loss": float(loss.mean()),
                    "eval/chosen_reward": good, "eval/rejected_reward": bad, "eval/margin": good - bad,
                    "eval/logp_accuracy": float("nan")}
        loss, m = pair_preference_loss(
            method, pol[:, 0], pol[:, 1], None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
            eval_tokens[:, 0], eval_tokens[:, 1], beta=algo.beta, label_smoothing=algo.label_smoothing,
            reference_free=algo.reference_free, gamma=algo.gamma, desirable_weight=algo.desirable_weight,
            undesirable_weight=algo.undesirable_weight)
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
        out = {"train/loss": st["loss_sum"] / n, "train/accuracy": st["correct"] / n, "train/grad_norm": st["grad_norm"],
               "train/lr": st["lr"]}
        if method == "kto":
            nd = st["desirable"]
            out.update({"train/desirable_reward": st["desirable_reward_sum"] / max(nd, 1.0),
                        "train/undesirable_reward": st["undesirable_reward_sum"] / max(n - nd, 1.0),
                        "train/desirable_share": nd / n, "train/kl_z0": st["z0_sum"] / n})
            return out
        out.update({"train/chosen_reward": st["chosen_reward_sum"] / n, "train/rejected_reward": st["rejected_reward_sum"] / n,
                    "train/margin": st["margin_sum"] / n, "train/chosen_logp": st["chosen_logp_sum"] / n,
                    "train/rejected_logp": st["rejected_logp_sum"] / n})
        return out

    objective = DPOObjective(beta=algo.beta, loss_type=method, label_smoothing=algo.label_smoothing,
                             reference_free=algo.reference_free, gamma=algo.gamma,
                             desirable_weight=algo.desirable_weight, undesirable_weight=algo.undesirable_weight)
    before, after, n_steps = sup.train_epochs(
        spec, cluster, tracker, console, run_dir, n_units=len(pairs), steps_per_epoch=steps_per_epoch,
        shards_of=shards_of, objective=objective, step_metrics=step_metrics, evaluate=evaluate)
    summary = sup.pair_summary(before, after, n_steps, len(pairs), len(eval_pairs), counts,
                               ("accuracy", "logp_accuracy", "loss"))
    sup.export_final(spec, cluster, run_dir, summary, console)
    console.print(f"{algo.name} ({method}): held-out preference accuracy {before['eval/accuracy']:.3f} → "
                  f"{after['eval/accuracy']:.3f}, margin {after['eval/margin']:.3f}, over {n_steps} steps")
    return summary

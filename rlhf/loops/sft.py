"""Supervised fine-tuning: next-token loss on response tokens only, held-out loss before/after.

    rows (prompt/response or conversations) → token ids + loss mask (rlhf.data.sft)
      → rows of one example, or packed rows (algo.packing)
      → for each epoch, for each step: the step's rows over the actor's ranks, micro-batches,
        loss = sum of NLL over trained tokens / trained tokens of the whole step
      → eval loss (mean NLL per trained token) on the held-out set, before and after every epoch
      → checkpoints (checkpoint.every, resume=) and final/hf

Batch math and files: rlhf.loops.supervised.
"""

from __future__ import annotations

import math
from typing import Optional

from rlhf.algos.offline import SFTObjective, SFTRowNLL
from rlhf.data.sft import build_sft, collate, to_rows
from rlhf.launch.cluster import Cluster
from rlhf.loops import supervised as sup
from rlhf.spec.runspec import RunSpec
from rlhf.track.tracker import Console, Tracker


def prepare(spec: RunSpec, console: Optional[Console] = None) -> sup.Prepared:
    """Read and tokenise the train/eval sets (in the driver, before the cluster starts)."""
    prepared = sup.prepare_with(spec, console, build_sft, "sft")
    rows = to_rows(prepared.train, pack=spec.algo.packing, max_length=prepared.max_length)
    sup.check_enough(len(rows), spec, "rows" if spec.algo.packing else "examples")
    return prepared


def run(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str,
        prepared: Optional[sup.Prepared] = None) -> dict[str, float]:
    prepared = prepared or prepare(spec, console)
    tok, L = prepared.tokenizer, prepared.max_length
    train_ex, eval_ex = prepared.train, prepared.eval
    counts = prepared.counts()
    tracker.log(0, counts)
    rows = to_rows(train_ex, pack=spec.algo.packing, max_length=L)
    eval_rows = to_rows(eval_ex, pack=False, max_length=L)
    if spec.algo.packing:
        console.print(f"packing: {len(train_ex)} examples in {len(rows)} rows of up to {L} tokens")
    steps_per_epoch = sup.check_enough(len(rows), spec, "rows" if spec.algo.packing else "examples")
    pad = tok.pad_token_id
    B = spec.batch
    zero3 = spec.train.zero_stage == 3

    def evaluate() -> dict[str, float]:
        pieces = sup.gather_eval(cluster.actor, len(eval_rows), lambda u: collate([eval_rows[i] for i in u], pad),
                                 SFTRowNLL(), B.micro_batch_size, zero3)
        per = sup.per_unit(pieces, len(eval_rows), per=2)
        nll, tokens = float(per[:, 0].sum()), float(per[:, 1].sum())
        loss = nll / max(tokens, 1.0)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "eval/tokens": tokens}

    def real_tokens(mb: list[int]) -> int:  # what the padding-free passes run over
        return sum(len(rows[i].input_ids) for i in mb)

    def shards_of(units: list[int]) -> list[list[dict]]:
        """One step's rows per rank and micro-batch; the loss is a token mean over the whole step."""
        tokens = sum(sum(rows[i].loss_mask) for i in units)
        scale = sup.scale_tensor(B.train_world_size / max(tokens, 1))
        return sup.agree_head_rows([[{**collate([rows[i] for i in mb], pad), "loss_scale": scale} for mb in rank]
                                    for rank in sup.step_shards(units, spec, real_tokens)], zero3)

    def step_metrics(st: dict[str, float]) -> dict[str, float]:
        return {"train/loss": st["nll_sum"] / max(st["tokens"], 1.0), "train/tokens": st["tokens"],
                "train/grad_norm": st["grad_norm"], "train/lr": st["lr"]}

    before, after, n_steps = sup.train_epochs(
        spec, cluster, tracker, console, run_dir, n_units=len(rows), steps_per_epoch=steps_per_epoch,
        shards_of=shards_of, objective=SFTObjective(), step_metrics=step_metrics, evaluate=evaluate)
    summary = {
        "eval/loss_before": before["eval/loss"],
        "eval/loss_after": after["eval/loss"],
        "train/steps": float(n_steps),
        "train/examples": float(len(train_ex)),
        "train/rows": float(len(rows)),
        "eval/examples": float(len(eval_ex)),
        **counts,
    }
    sup.export_final(spec, cluster, run_dir, summary, console)
    console.print(f"sft: held-out loss {before['eval/loss']:.4f} → {after['eval/loss']:.4f} over {n_steps} steps")
    return summary


"""What the SFT, reward-model and DPO loops share: data sets, step batches split over ranks,
evaluation, metrics, the final HF export.

Batch math (``spec.batch``, built by rlhf.spec): an optimizer step takes ``train.prompts_per_step``
units — training rows for SFT (examples, or packed rows with ``algo.packing``), pairs for RM and
DPO — split evenly over the actor's data-parallel ranks, each rank running ``batch.grad_accum``
micro-batches of ``batch.micro_batch_size`` units. An epoch is ``floor(units / prompts_per_step)``
steps of a seeded permutation; the run lasts ``algo.epochs`` epochs (``train.steps`` is for RL).

Evaluation runs on the held-out set (``data.eval_files``, else ``algo.eval_fraction`` of the
training files) before training, after every epoch and at the end; every rank gets the same number
of micro-batches (ZeRO-3 gathers parameters collectively), padded by repeating the last unit,
whose results are dropped.

The run dir gets ``metrics.jsonl`` (one line per step and per evaluation), ``final/hf`` (the
trained model, ``from_pretrained``-ready: give it to the next stage as ``model.path`` or
``reward.model_path``) and ``final/metrics.json`` (evaluation before and after, data counts).

Checkpoints work as in RL (rlhf.ckpt.training): every ``checkpoint.every`` optimizer steps and at
the end, the actor's DeepSpeed state + RNGs and the driver's position (global step, metrics
history, evaluations so far); ``resume=<run dir>`` (or rerunning into the same output_dir)
continues from the newest one. The epoch order is a function of (seed, epoch), so a resumed run
sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from rlhf.data.files import Records, load_files, split_eval
from rlhf.launch.cluster import Cluster
from rlhf.quoting import resume_command
from rlhf.spec.errors import UserError
from rlhf.spec.runspec import RunSpec
from rlhf.spec.tokens import sequence_tokens
from rlhf.track.tracker import Console, Tracker
from rlhf.workers.policy import PolicyWorker
from rlhf.workers.schedule import combine_ranks

MB = dict[str, torch.Tensor]


def max_length(spec: RunSpec) -> int:
    return sequence_tokens(spec.algo, spec.data, spec.rollout)


def tokenizer_for(spec: RunSpec):
    from rlhf.models import load_tokenizer, model_dir

    return load_tokenizer(model_dir(spec))


def load_splits(spec: RunSpec) -> tuple[Records, Records]:
    """(train, eval) records: ``data.eval_files`` when given, else a held-out fraction."""
    d = spec.data
    train = load_files(list(d.train_files), list(d.weights) if d.weights else None, seed=spec.train.seed,
                       columns=d.columns)
    if d.eval_files:
        return train, load_files(list(d.eval_files), seed=spec.train.seed, columns=d.columns)
    if spec.algo.eval_fraction <= 0:
        raise UserError(
            "no held-out data: set data.eval_files=[...] or algo.eval_fraction > 0 (e.g. 0.1)."
        )
    return split_eval(train, spec.algo.eval_fraction, seed=spec.train.seed)


def check_enough(n_units: int, spec: RunSpec, unit: str) -> int:
    """Optimizer steps per epoch (UserError when the set is smaller than one step)."""
    per_step = spec.batch.mini_batch_size
    if n_units < per_step:
        raise UserError(
            f"the training set has {n_units} {unit}, fewer than one optimizer step takes "
            f"(train.prompts_per_step={per_step}). Lower train.prompts_per_step or add data."
        )
    return n_units // per_step


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def step_shards(units: Sequence[int], spec: RunSpec,
                tokens: Optional[Callable[[list[int]], int]] = None) -> list[list[list[int]]]:
    """The unit indices of one optimizer step → per rank → per micro-batch. With ``tokens`` (a
    micro-batch's real tokens), each rank runs its largest micro-batch first, as the RL update does
    (``rlhf.data.packing.largest_first``): the later ones fit in the blocks it leaves cached."""
    W, m, acc = spec.batch.train_world_size, spec.batch.micro_batch_size, spec.batch.grad_accum
    per_rank = len(units) // W
    out = []
    for r in range(W):
        mine = list(units[r * per_rank:(r + 1) * per_rank])
        mbs = [mine[k * m:(k + 1) * m] for k in range(acc)]
        if tokens is not None:
            mbs.sort(key=tokens, reverse=True)  # stable: equal sizes keep their order
        out.append(mbs)
    return out


def eval_shards(n: int, world: int, micro: int) -> list[list[list[int]]]:
    """All n units over ``world`` ranks, the same number of micro-batches on each, padded by
    repeating unit n-1 (the caller drops results past n)."""
    per_rank_mbs = max(1, math.ceil(n / (world * micro)))
    total = world * per_rank_mbs * micro
    idx = list(range(n)) + [n - 1] * (total - n)
    out = []
    for r in range(world):
        mine = idx[r * per_rank_mbs * micro:(r + 1) * per_rank_mbs * micro]
        out.append([mine[k * micro:(k + 1) * micro] for k in range(per_rank_mbs)])
    return out


def agree_head_rows(shards: list[list[MB]], zero3: bool) -> list[list[MB]]:
    """``shards`` (per rank, per micro-batch; every rank as many) with ``head_rows`` in each
    micro-batch where the LM head is partitioned (``zero3``, more than one rank): the most head rows
    (``scored_index`` positions) of any rank's micro-batch at the same place. Every rank must call a
    ZeRO-3 head as often as the others at the same time (``rlhf.workers.zero3.equal_head_rows``);
    the driver made every rank's micro-batches, so it sets the count here instead of a collective,
    and a read of its result on the host, in each micro-batch's pass. Otherwise unchanged."""
    if zero3 and len(shards) > 1:
        for at_k in zip(*shards):
            most = max(len(mb["scored_index"]) for mb in at_k)
            for mb in at_k:
                mb["head_rows"] = most
    return shards


def gather_eval(group: Any, n: int, make_mb: Callable[[list[int]], MB], fn: Any, micro: int,
                zero3: bool = False) -> list[Any]:
    """Run ``fn`` over all n units on ``group`` (no gradients); per-micro-batch results in unit
    order, with the padded micro-batch units' index lists alongside: [(units, result), ...].
    ``zero3``: ``fn`` runs a ZeRO-3 LM head over ``token_logps`` (see ``agree_head_rows``)."""
    plan = eval_shards(n, group.world_size, micro)
    shards = agree_head_rows([[make_mb(mb) for mb in rank] for rank in plan], zero3)
    results = group.scatter(PolicyWorker.apply, shards, fn)
    out = []
    for rank_plan, rank_res in zip(plan, results):
        out.extend(zip(rank_plan, rank_res))
    return out


def per_unit(pieces: list[tuple[list[int], torch.Tensor]], n: int, per: int = 1) -> torch.Tensor:
    """Stitch per-micro-batch outputs of ``per`` values per unit back into ``[n, per]`` (or [n])."""
    out = torch.zeros(n, per)
    for units, t in pieces:
        t = t.reshape(len(units), per)
        for k, u in enumerate(units):
            out[u] = t[k]
    return out if per > 1 else out[:, 0]


def add_sums(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            if k in ("grad_norm", "lr"):
                continue
            out[k] = out.get(k, 0.0) + v
    first = dicts[0]
    for k in ("grad_norm", "lr"):
        if k in first:
            out[k] = first[k]  # identical on every rank
    return out


@dataclass
class Log:
    """metrics.jsonl, the tracker and the console of a supervised run."""

    spec: RunSpec
    tracker: Tracker
    console: Console
    run_dir: str
    history: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        from rlhf.track import MetricsFile

        self.file = MetricsFile(self.run_dir)

    def step(self, step: int, m: dict[str, float]) -> None:
        """Step ``step`` (counted from 1, as everywhere) is done: its metrics everywhere."""
        m = {**m, "time/elapsed": time.perf_counter() - self.t0}
        self.history.append({"step": step, **m})
        self.file.write({"step": step, **m})
        if (step - 1) % self.spec.tracking.log_every == 0:
            self.tracker.log(step, m)
        self.console.step(step, m)

    def eval(self, step: int, m: dict[str, float], label: str) -> None:
        self.file.write({"step": step, **m})
        self.tracker.log(step, m)
        self.console.print(f"eval ({label}): " + " · ".join(f"{k.split('/', 1)[1]} {v:.4g}" for k, v in m.items()))

    def close(self) -> None:
        self.file.close()


def start_pairs(spec: RunSpec, prepared: Prepared, tracker: Tracker) -> tuple[list, list, dict[str, float], int]:
    """A preference run's train and eval pairs, their counts (logged at step 0) and the optimizer
    steps per epoch (checked against the batch)."""
    counts = prepared.counts()
    tracker.log(0, counts)
    return prepared.train, prepared.eval, counts, check_enough(len(prepared.train), spec, "pairs")


def pair_summary(before: dict[str, float], after: dict[str, float], n_steps: int, n_pairs: int,
                 n_eval_pairs: int, counts: dict[str, float], before_after: Sequence[str]) -> dict[str, float]:
    """A preference run's summary: each ``eval/<key>`` of ``before_after`` before and after
    training, the held-out margin after, step and pair counts, and the data counts."""
    out: dict[str, float] = {}
    for key in before_after:
        out[f"eval/{key}_before"] = before[f"eval/{key}"]
        out[f"eval/{key}_after"] = after[f"eval/{key}"]
    out.update({"eval/margin_after": after["eval/margin"], "train/steps": float(n_steps),
                "train/pairs": float(n_pairs), "eval/pairs": float(n_eval_pairs), **counts})
    return out


def export_final(spec: RunSpec, cluster: Cluster, run_dir: str, summary: dict[str, Any], console: Console) -> str:
    from rlhf.ckpt.training import exporting

    final = Path(run_dir) / "final"
    with exporting(run_dir, final / "hf", final / "metrics.json"):
        final.mkdir(parents=True, exist_ok=True)  # final/hf last, whole: its presence means the export is done
        with open(final / "metrics.json", "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        paths = [p for p in cluster.actor.call(PolicyWorker.save_hf, str(final / "hf")) if p]
    console.print(f"saved {paths[0] if paths else final / 'hf'} (HF format) and {final / 'metrics.json'}")
    return str(final / "hf")


def total_steps(spec: RunSpec, steps_per_epoch: int, console: Optional[Console] = None) -> int:
    n = steps_per_epoch * spec.algo.epochs
    if console is not None and hasattr(console, "set_total"):
        console.set_total(n)
    return n


def scale_tensor(x: float) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float32)


@dataclass
class Prepared:
    """A supervised run's tokenised data, made in the driver before any worker starts
    (``rlhf.preflight`` calls the loop's ``prepare``): a data error costs seconds, not a cluster."""

    tokenizer: Any
    max_length: int
    train: list  # sft: Example; rm/dpo: Pair; kto: Unpaired
    eval: list
    reports: list  # TruncationReport of train and eval

    def counts(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for rep in self.reports:
            out.update(rep.metrics(f"data/{rep.what.split()[-1]}"))
        return out


def prepare_with(spec: RunSpec, console: Console, build: Callable, what: str) -> Prepared:
    """Load train/eval records and tokenise them with ``build(records, tokenizer, data, L, what=)``."""
    tok = tokenizer_for(spec)
    L = max_length(spec)
    try:
        train_rec, eval_rec = load_splits(spec)
        train, rep_tr = build(train_rec, tok, spec.data, L, what=f"{what} train")
        evals, rep_ev = build(eval_rec, tok, spec.data, L, what=f"{what} eval")
    except UserError as e:
        files = list(spec.data.train_files) + list(spec.data.eval_files)
        if any(f.startswith("builtin:keymap/") for f in files):  # the RL prompt set, by default
            kind = "sft" if what == "sft" else "preference"
            raise UserError(
                f"{e} (builtin:keymap/... holds RL prompts only; for algo={spec.algo.name} on the built-in task use "
                f"data.train_files=[builtin:keymap-{kind}/train] data.eval_files=[builtin:keymap-{kind}/eval], "
                f"or make files with `rlhf-data make {kind} --out DIR`.)"
            ) from None
        raise
    for rep in (rep_tr, rep_ev):
        if console is not None:
            console.print(rep.line())
    return Prepared(tokenizer=tok, max_length=L, train=train, eval=evals, reports=[rep_tr, rep_ev])


def prepare_pairs(spec: RunSpec, console: Optional[Console] = None) -> Prepared:
    """rm and dpo: read and tokenise the train/eval preference pairs (in the driver, before the
    cluster starts)."""
    from rlhf.data.preference import build_pairs

    prepared = prepare_with(spec, console, build_pairs, "preference")
    check_enough(len(prepared.train), spec, "pairs")
    return prepared


def prepare_unpaired(spec: RunSpec, console: Optional[Console] = None) -> Prepared:
    """kto: the training rows as unpaired examples (a pair gives one desirable and one undesirable,
    each with its mismatched completion), the held-out rows as pairs when they are pairs (the
    preference accuracy of DPO) else as examples."""
    from rlhf.data.preference import build_pairs, build_unpaired, is_paired

    def build(rec: Records, tok: Any, data: Any, L: int, what: str):
        if what.endswith("eval") and is_paired(rec, data):
            return build_pairs(rec, tok, data, L, what=what)
        return build_unpaired(rec, tok, data, L, what=what, seed=spec.train.seed)

    prepared = prepare_with(spec, console, build, "preference")
    check_enough(len(prepared.train), spec, "examples")
    return prepared


def pair_collator(prepared: Prepared, pack: bool) -> Callable[[list, Sequence[int]], dict]:
    """rm and dpo: ``mb_of(pairs, units)``, the micro-batch of ``pairs[units]`` (chosen and
    rejected sequences of each pair, padded or packed to the run's max length)."""
    from rlhf.data.preference import collate_pairs

    pad, L = prepared.tokenizer.pad_token_id, prepared.max_length

    def mb_of(pairs: list, units: Sequence[int]) -> dict:
        return collate_pairs([pairs[i] for i in units], pad, pack=pack, max_length=L)

    return mb_of


def pair_tokens(pairs: Sequence[Any]) -> Callable[[list[int]], int]:
    """A micro-batch of pairs' real tokens: each pair's prompt twice, its chosen and its rejected
    response (``step_shards`` orders by it; the passes run padding-free)."""
    def sides(u: Any) -> tuple:  # a Pair's chosen and rejected, an Unpaired's completion and mismatched one
        return u.responses() if hasattr(u, "responses") else (u.chosen, u.rejected)

    return lambda units: sum(2 * len(pairs[i].prompt) + sum(map(len, sides(pairs[i]))) for i in units)


def optional(x: Optional[float]) -> float:
    return float("nan") if x is None else float(x)


def keep_metrics_before(path: Path, start: int) -> None:
    """A resumed run rewrites its metrics after ``start`` steps: keep the lines of steps 1..start
    and the evaluations up to ``start`` (the one at ``start`` belongs to the checkpoint)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if json.loads(line)["step"] <= start:
            keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))


def train_epochs(spec: RunSpec, cluster: Cluster, tracker: Tracker, console: Console, run_dir: str, *, n_units: int,
                 steps_per_epoch: int, shards_of: Callable[[list[int]], list[list[MB]]], objective: Any,
                 step_metrics: Callable[[dict[str, float]], dict[str, float]],
                 evaluate: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, float], int]:
    """The epoch/step loop of sft, rm and dpo: (eval before, eval after, optimizer steps).

    ``shards_of(units)`` makes one step's micro-batches per rank from unit indices;
    ``step_metrics(summed worker stats)`` names the step's metrics; ``evaluate()`` runs the
    held-out evaluation. Checkpoints and resume: see the module docstring."""
    from rlhf.ckpt import training as ckpt_io

    G = spec.batch.mini_batch_size
    n_steps = total_steps(spec, steps_per_epoch, console)
    ckpt = ckpt_io.manager(spec, run_dir)
    start, history = 0, []
    before: Optional[dict[str, float]] = None
    after: Optional[dict[str, float]] = None
    resumed = ckpt_io.latest(spec, run_dir)
    if resumed is not None:
        state = ckpt_io.restore(resumed, cluster)
        start, history, before, after = state["step"], state["history"], state["before"], state["after"]
        console.print(f"resumed from {resumed.path} at step {start + 1} of {n_steps}")
    keep_metrics_before(Path(run_dir) / "metrics.jsonl", start)
    log = Log(spec, tracker, console, run_dir, history=list(history))
    from rlhf.run import StopRequest

    stop = StopRequest().install()  # Ctrl-C / SIGTERM: finish the step, checkpoint it, then stop
    try:
        if before is None:
            before = evaluate()
            log.eval(0, before, "before training")
        after = after or before
        orders: dict[int, list[int]] = {}
        for step in range(start, n_steps):
            epoch, k = divmod(step, steps_per_epoch)
            order = orders.setdefault(epoch, epoch_order(n_units, spec.train.seed, epoch))
            units = order[k * G:(k + 1) * G]
            ranks = cluster.actor.scatter(PolicyWorker.train_step, shards_of(units), objective)
            peaks = [{k: r.pop(k) for k in list(r) if k.startswith("memory/")} for r in ranks]  # CUDA only
            longest = max(r.pop("perf/micro_batch_tokens_max") for r in ranks)
            m = step_metrics(add_sums(ranks))
            m.update(combine_ranks(peaks))  # the largest rank's: a rank runs out of memory on its own peak
            m["perf/micro_batch_tokens_max"] = longest
            m["train/epoch"] = epoch + (k + 1) / steps_per_epoch
            done = step + 1
            log.step(done, m)
            if done % steps_per_epoch == 0:
                after = evaluate()
                log.eval(done, after, f"epoch {epoch + 1}/{spec.algo.epochs}")
            stopping = stop.requested and done < n_steps  # a signal came during this step
            if ckpt.due(done, n_steps) or (stopping and ckpt.last_saved != done):
                state = {"step": done, "history": list(log.history), "before": before, "after": after}
                path = ckpt_io.save(spec, ckpt, done, cluster, state, metrics={**log.history[-1], **after})
                console.print(f"checkpoint: {path}")
            if stopping:
                console.print(f"stopped after step {done}: continue with {resume_command(run_dir)}")
                raise stop.exception()
    finally:
        stop.restore()
        log.close()
    return before, after, n_steps

"""The disk a run writes under its output_dir at its peak: the checkpoints alive at once and the
final HF export. The formulas, and the checkpoint they were measured against, are in
docs/memory.md ("Disk under output_dir").

All figures are GB (1e9 bytes). ``need`` is a function of the spec and, for sft/rm/dpo, of the
row counts of its training files (``supervised_steps``); ``available_bytes`` is the one look at
the free space (where the run dir will be, plus what the run dir's own checkpoints and export
already hold, which the run rotates or rewrites). The plan prints the figure, and the start of a
run refuses one whose need is over DISK_FIT_MARGIN of that space.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhf.plan.memory import DTYPE_BYTES, GB, lora_param_count, param_count
from rlhf.spec.runspec import RunSpec

# A run needing more than this share of the free space does not fit (the metrics, logs, tracking
# files and other writers on the same disk need the rest).
DISK_FIT_MARGIN = 0.95
# DeepSpeed's save_checkpoint (0.19), per trained parameter: the module's weights in the training
# dtype (in the model-states file; ZeRO-3 writes none there, its weights are the optimizer's fp32
# partition), and the optimizer's fp32 master weights with Adam's m and v, 12 B, in the
# optimizer-state files (each rank its partition). At ZeRO-0 in float32 there is no master copy: 8 B.
OPTIMIZER_BYTES = 12
OPTIMIZER_BYTES_NO_MASTER = 8
# The files of an HF export beside its weights, by the vocabulary: the tokenizer's files take
# about 76 B per token at Qwen2.5 (11.5 MB: tokenizer.json, vocab.json, merges.txt) and 71 B at
# Llama 3 (9.1 MB); config.json and generation_config.json a few kB.
TOKENIZER_BYTES_PER_TOKEN = 80
CONFIG_BYTES = 10_000
# Beside the tensors, per rank of a trained role: the tensors' metadata in DeepSpeed's files,
# its zero_to_fp32.py scripts, the rank's RNG states, the driver's metrics history (driver.pt).
CHECKPOINT_EXTRA_BYTES = 1_000_000


@dataclass(frozen=True)
class StepBound:
    """At most ``steps`` optimizer steps, from at most ``rows`` training rows."""

    steps: int
    rows: int


@dataclass(frozen=True)
class DiskNeed:
    """GB a run writes under output_dir at its peak: ``checkpoints`` checkpoints of ``checkpoint``
    (GB by part) alive at once, plus ``final`` (the final export, GB by part) where it is part of
    the peak (empty otherwise). ``saves``: the checkpoints the run writes in all, at most (None:
    not known, an sft/rm/dpo run whose rows are not counted). ``steps``: an sft/rm/dpo run's
    ``supervised_steps`` where counted (and ``checkpoint.every`` > 0)."""

    checkpoint: dict[str, float]
    checkpoints: int
    final: dict[str, float] = field(default_factory=dict)
    saves: Optional[int] = None
    steps: Optional[StepBound] = None

    @property
    def per_checkpoint(self) -> float:
        return sum(self.checkpoint.values())

    @property
    def total(self) -> float:
        return self.checkpoints * self.per_checkpoint + sum(self.final.values())


def trained_params(spec: RunSpec) -> dict[str, tuple[int, int]]:
    """``{role: (trained parameters, parameters of its HF export)}`` for the roles a checkpoint
    saves: the actor (in algo=rm a reward model: a value head, no LM head; with model.lora, which
    only the causal-LM kinds take, its adapters alone) and PPO's critic (every weight). Frozen models
    (reference, reward) are not saved."""
    m = spec.model
    full = param_count(m, with_lm_head=spec.algo.kind != "rm")
    out = {"actor": (lora_param_count(m) or full, full)}
    if "critic" in spec.roles:
        value = param_count(m, with_lm_head=False)
        out["critic"] = (value, value)
    return out


def deepspeed_checkpoint_gb(params: int, dtype: str, zero_stage: int, ranks: int = 1) -> float:
    """One role's DeepSpeed checkpoint (all ranks' files) of ``params`` trained parameters:
    b·P of weights below ZeRO-3, and 12·P of fp32 master weights, m and v (8·P at ZeRO-0 in
    float32, which keeps no master copy), the same with the optimizer offloaded; and
    CHECKPOINT_EXTRA_BYTES per rank."""
    b = DTYPE_BYTES[dtype]
    weights = b * params if zero_stage < 3 else 0
    optimizer = OPTIMIZER_BYTES if zero_stage >= 1 or b == 2 else OPTIMIZER_BYTES_NO_MASTER
    return (weights + optimizer * params + CHECKPOINT_EXTRA_BYTES * ranks) / GB


def hf_export_gb(spec: RunSpec, role: str, trained: int, full: int) -> float:
    """One role's HF export (``save_hf``): its whole weights in the training dtype and the
    tokenizer; a LoRA policy's also holds the adapter beside the merged weights."""
    b = DTYPE_BYTES[spec.model.dtype]
    adapter = b * trained if role == "actor" and spec.model.lora.rank > 0 else 0
    return (b * full + adapter + TOKENIZER_BYTES_PER_TOKEN * spec.model.vocab + CONFIG_BYTES) / GB


def supervised_steps(spec: RunSpec) -> Optional[StepBound]:
    """At most the optimizer steps of an sft/rm/dpo run, from its training files' rows counted
    without reading them whole (``rlhf.data.files.rows_bound``): (rows // batch) × algo.epochs, as
    ``rlhf.loops.supervised.check_enough`` and ``total_steps`` count units. A row makes at most one
    unit (an example, or a pair), and what comes between only lowers the count: the held-out
    fraction, truncation's drops, packing. At least one step (fewer rows: the run refuses its
    data). None for RL, or where a file is not counted (a Hub data set, a saved dataset dir)."""
    if spec.algo.kind == "rl":
        return None
    from rlhf.data.files import rows_bound

    d = spec.data
    rows = rows_bound(list(d.train_files), list(d.weights) if d.weights else None)
    if rows is None:
        return None
    return StepBound(max(1, rows // spec.batch.mini_batch_size * spec.algo.epochs), rows)


def saves(spec: RunSpec, bound: Optional[StepBound] = None) -> Optional[int]:
    """The checkpoints a run writes (at most): every ``checkpoint.every`` steps and at the end, of
    ``train.steps`` (RL) or ``bound.steps`` (sft/rm/dpo: ``supervised_steps``; without it None,
    the step count being the data's). A resumed run counts one more: the checkpoint it resumes
    from may be a stop's (Ctrl-C, SIGTERM), off the ``every`` grid, and rotation keeps it beside
    the grid's."""
    every = spec.checkpoint.every
    if every <= 0:
        return 1
    if spec.algo.kind == "rl":
        steps = spec.train.steps
    elif bound is None:
        return None
    else:
        steps = bound.steps
    return steps // every + (1 if steps % every else 0) + (1 if spec.resume else 0)


def need(spec: RunSpec) -> DiskNeed:
    """The peak of what the run writes under output_dir (see ``DiskNeed``).

    A checkpoint: each trained role's DeepSpeed checkpoint, and its HF export when
    ``checkpoint.save_hf``. Rotation keeps k = keep_last checkpoints (one more, the best, with
    ``best_metric``) and deletes older ones only after the new one is in place: min(S, k + 1) are
    on disk while one is written, S the run's saves (sft/rm/dpo: at most those of the rows
    counted, else unbounded). After the last save the final export (the policy's and the
    critic's, written anew, not linked) joins the min(S, k) that remain. The peak is the larger
    of the two."""
    ck = spec.checkpoint
    roles = trained_params(spec)
    one: dict[str, float] = {}
    final: dict[str, float] = {}
    for role, (trained, full) in roles.items():
        ranks = spec.layout.world_size(role)
        one[role] = deepspeed_checkpoint_gb(trained, spec.model.dtype, spec.train.zero_stage, ranks)
        hf = hf_export_gb(spec, role, trained, full)
        if ck.save_hf:
            one[f"{role} HF"] = hf
        final[role] = hf
    kept = ck.keep_last + (1 if ck.best_metric else 0)
    bound = supervised_steps(spec) if ck.every > 0 else None
    n = saves(spec, bound)
    writing = kept + 1 if n is None else min(n, kept + 1)
    after = kept if n is None else min(n, kept)
    per = sum(one.values())
    if after * per + sum(final.values()) > writing * per:
        return DiskNeed(one, after, final, n, bound)
    return DiskNeed(one, writing, {}, n, bound)


def over(est: DiskNeed, available: Optional[int]) -> bool:
    """``est`` is more than DISK_FIT_MARGIN of ``available`` bytes (unknown: it fits)."""
    if available is None:
        return False
    return est.total * GB > DISK_FIT_MARGIN * available


def available_bytes(spec: RunSpec) -> Optional[int]:
    """Bytes the run may write: free where its run dir is (``rlhf.storage.free_bytes``, the nearest
    existing parent), plus what the run dir's checkpoints and final export already take (a resumed
    run rotates and rewrites them: they are part of the need). None when unknown."""
    from rlhf import storage

    run_dir = Path(spec.run_dir).expanduser()
    free = storage.free_bytes(run_dir)
    if free is None:
        return None
    return free + storage.dir_bytes(run_dir / "checkpoints") + storage.dir_bytes(run_dir / "final")


# ----------------------------------------------------------------------------- advice


def _candidates(spec: RunSpec) -> list[list[str]]:
    """Settings that write less (unchecked): every combination of the checkpoint settings that
    lower the need alone, the fewest functions lost first: those that keep the intermediate
    checkpoints before ``checkpoint.every=0`` (which drops them all), smaller before larger; then
    LoRA (with all of them)."""
    from itertools import combinations

    from rlhf.plan.advice import apply, lora_overrides

    ck = spec.checkpoint
    single = []
    if ck.keep_last > 1:
        single.append("checkpoint.keep_last=1")
    if ck.best_metric:
        single.append("checkpoint.best_metric=null")
    if ck.save_hf:
        single.append("checkpoint.save_hf=false")
    if ck.every > 0:
        single.append("checkpoint.every=0")
    before = need(spec).total
    single = [s for s in single if (new := apply(spec, [s])) is not None and need(new).total < before]
    subsets = [list(c) for k in range(1, len(single) + 1) for c in combinations(single, k)]
    out = sorted(subsets, key=lambda c: ("checkpoint.every=0" in c, len(c)))  # stable: the order above
    lora = lora_overrides(spec)
    if lora:
        out += [lora, single + lora] if single else [lora]
    return out


def suggestions(spec: RunSpec, available: int) -> list[tuple[tuple[str, ...], float]]:
    """``[(overrides, GB)]``: settings that make the run's disk need fit ``available`` bytes, each
    built as a spec (``rlhf.plan.advice.apply``: validation and ``auto`` included) and planned
    again; none that makes a GPU figure that fitted stop fitting. Cheapest first; a combination
    only where none of its parts fits alone."""
    from rlhf.plan.advice import apply
    from rlhf.plan.memory import estimate, over_limit

    was_over = set(over_limit(spec, estimate(spec)))
    out: list[tuple[tuple[str, ...], float]] = []
    for cand in _candidates(spec):
        if any(set(prev) <= set(cand) for prev, _ in out):
            continue  # a part of it fits already
        new = apply(spec, cand)
        if new is None:
            continue
        est = need(new)
        if over(est, available) or not set(over_limit(new, estimate(new))) <= was_over:
            continue
        out.append((tuple(cand), est.total))
    return out


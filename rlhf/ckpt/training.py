"""Save and restore the full training state of an RL run (``rlhf.loops.rl`` calls these).

A checkpoint ``<run_dir>/checkpoints/step_XXXXXXXX/`` (written atomically by CheckpointManager):

    driver.pt        next step, data position (PromptSource state incl. its RNG), KL controller,
                     the driver's RNG, the metrics history (for the run summary)
    actor/ds/...     DeepSpeed checkpoint: weights, optimizer, LR scheduler (every rank's shard)
    actor/rng_rank<r>.pt   each rank's RNG (torch, python, numpy)
    critic/...       the same for PPO's critic
    actor/hf, critic/hf    HF-format exports (``checkpoint.save_hf``), from_pretrained-ready
    actor/adapter    with model.lora: the adapter (peft), beside actor/hf (the merged weights); the
                     DeepSpeed checkpoint then holds only the adapters (the frozen weights are the model's)

The rollout engines hold no state of their own: their sampling seeds are derived from the run
seed, the step and the prompt (``rlhf.loops.rl.sampling_for``), and their weights come from the
actor by a weight sync right after restoring. Reference and reward model are frozen.

At the end of every run ``<run_dir>/final/hf`` is the policy (and ``final/critic_hf`` PPO's
critic; ``final/adapter`` a LoRA policy's adapter), the same contract as the sft/rm/dpo loops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf.ckpt.manager import CheckpointInfo, CheckpointManager, find_latest
from rlhf.launch.cluster import Cluster
from rlhf.spec.runspec import RunSpec
from rlhf.workers.critic import CriticWorker
from rlhf.workers.policy import PolicyWorker

TRAINED_ROLES = ("actor", "critic")


def manager(spec: RunSpec, run_dir: str) -> CheckpointManager:
    c = spec.checkpoint
    return CheckpointManager(run_dir, every=c.every, keep_last=c.keep_last, best_metric=c.best_metric)


def _groups(cluster: Cluster) -> list:
    return [g for g in (cluster.actor, cluster.critic) if g is not None]


def save(spec: RunSpec, ckpt: CheckpointManager, step: int, cluster: Cluster, driver_state: dict,
         metrics: Optional[dict] = None) -> Path:
    """Checkpoint after ``step`` finished steps (``driver_state['step']`` = the next step to run)."""
    import torch

    from rlhf import storage
    from rlhf.ckpt.manager import step_dir_name
    from rlhf.ckpt.state import rng_state

    prev = ckpt.latest()
    where = ckpt.root / (step_dir_name(step) + ".tmp")
    with storage.writing(where, f"the checkpoint of step {step}", ckpt.root.parent,
                         needs=storage.dir_bytes(prev.path) if prev else None,
                         needs_what="the size of the previous checkpoint" if prev else "",
                         cleanup=lambda: ckpt.abort(where)):
        tmp = ckpt.begin(step)
        for g in _groups(cluster):
            g.call(PolicyWorker.save_state, str(tmp))  # every trained role's
            if spec.checkpoint.save_hf:
                g.call(PolicyWorker.save_hf, str(tmp / g.role / "hf"))
        torch.save({**driver_state, "rng": rng_state()}, tmp / "driver.pt")
        return ckpt.commit(tmp, step, metrics)


def latest(spec: RunSpec, run_dir: str) -> Optional[CheckpointInfo]:
    """The checkpoint to resume from: ``resume=<dir>`` (a run dir or a checkpoint dir), else the
    run dir's own newest complete checkpoint (a restarted run continues by itself)."""
    src = spec.resume or run_dir
    p = Path(src)
    if (p / "driver.pt").is_file() and p.name.startswith("step_"):
        import json

        info = json.loads((p / "COMPLETE").read_text())
        return CheckpointInfo(step=int(info["step"]), path=p)
    return find_latest(src)


def restore(info: CheckpointInfo, cluster: Cluster) -> dict:
    """Load every trained role's DeepSpeed state and RNG; return the driver state (its RNG set)."""
    import torch

    from rlhf.ckpt.state import set_rng_state

    for g in _groups(cluster):
        g.call(PolicyWorker.load_state, str(info.path))
    state = torch.load(info.path / "driver.pt", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state


def export_final(spec: RunSpec, cluster: Cluster, run_dir: str) -> str:
    """``<run_dir>/final/hf`` (policy) and ``final/critic_hf`` (PPO), from_pretrained-ready. The
    policy's comes last: each is renamed into place whole, and ``final/hf`` is what ``resume=``
    takes for a finished export."""
    final = Path(run_dir) / "final"
    with exporting(run_dir, final / "hf", final / "critic_hf"):
        if cluster.critic is not None:
            cluster.critic.call(CriticWorker.save_hf, str(final / "critic_hf"))
        cluster.actor.call(PolicyWorker.save_hf, str(final / "hf"))
    return str(final / "hf")


def exporting(run_dir: str, hf: Path, *more: Path):
    """Around the final HF export: a refused write removes the partial export (a model dir that
    ``from_pretrained`` would half-load is worse than none) and is one line (``rlhf.storage``)."""
    import shutil

    from rlhf import storage
    from rlhf.models.lora import adapter_dir

    latest = find_latest(run_dir)
    hf_in_ckpt = latest.path / "actor" / "hf" if latest is not None else None
    has_copy = hf_in_ckpt is not None and hf_in_ckpt.is_dir()

    def cleanup() -> None:
        for p in (hf, adapter_dir(hf), *more):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    return storage.writing(hf, "the final HF export", run_dir,
                           needs=storage.dir_bytes(hf_in_ckpt) if has_copy else None,
                           needs_what="the size of the HF export in the newest checkpoint" if has_copy else "",
                           cleanup=cleanup)

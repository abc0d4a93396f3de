"""One-line messages for failures whose fix is a setting: CUDA out of memory in a phase.

The loop knows which phase of the step was running; the spec knows what the plan estimated for
it. The message names both and the settings that lower that phase's memory.
"""

from __future__ import annotations

from typing import Any

# loop phases that run on the training side of a hybrid GPU (the rest is generation)
TRAINING_PHASES = ("to_train", "reference", "old_logp", "critic", "update", "sync", "reward")


def is_cuda_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error, raised here or inside a Ray worker (its ``cause``)."""
    seen = 0
    while e is not None and seen < 8:
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e).split("\n")[0]:
            return True
        e = getattr(e, "cause", None) or e.__cause__
        seen += 1
    return False


def oom_message(spec: Any, phase: str) -> str:
    """``CUDA out of memory in the <phase> phase: the plan estimated …; try …``."""
    from rlhf.spec.memory import estimate

    est = estimate(spec)
    hybrid = spec.placement.mode == "hybrid"
    generation = phase == "generate"
    if hybrid:
        figure = "generation phase" if generation else "training phase"
    else:
        figure = "rollout" if generation else ("actor" if phase in ("update", "old_logp", "sync") else
                                                {"reference": "reference", "critic": "critic"}.get(phase, "actor"))
    planned = f"{est.total(figure):.1f} GB" if figure in est.figures else "an unknown amount"
    cap = spec.hardware.device_memory_gb
    tips: list[str] = []
    if generation or (hybrid and phase == "sync"):
        tips.append(f"rollout.gpu_memory_utilization={max(spec.rollout.gpu_memory_utilization - 0.1, 0.1):.1f}")
        if hybrid and not spec.placement.offload_train_state:
            tips.append("placement.offload_train_state=true")
    else:
        budget = getattr(spec.train, "max_tokens_per_micro_batch", None)
        if budget:
            tips.append(f"train.max_tokens_per_micro_batch={max(budget // 2, 1)}")
        if not spec.model.gradient_checkpointing:
            tips.append("model.gradient_checkpointing=true")
        if not spec.train.offload_optimizer and spec.train.zero_stage > 0:
            tips.append("train.offload_optimizer=true")
    return (f"CUDA out of memory in the {phase} phase: the plan estimated {planned} of {cap:g} for the "
            f"{figure}. Try {'; '.join(tips) or 'more GPUs or a smaller model'} (see rlhf-run ... --plan).")

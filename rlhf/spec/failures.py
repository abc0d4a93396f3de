"""One-line messages for failures whose fix is a setting: CUDA out of memory in a phase.

The loop knows which phase of the step was running; the spec knows what the plan estimated for
it. The message names both and the settings that lower that phase's memory.
"""

from __future__ import annotations

from rlhf.spec.runspec import RunSpec

# the disaggregated figure of each phase that runs on a training role (generation: "rollout")
ROLE_OF_PHASE = {"reference": "reference", "critic": "critic", "reward": "reward"}


def is_cuda_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error, raised here or inside a Ray worker (its ``cause``)."""
    seen = 0
    while e is not None and seen < 8:
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e).split("\n")[0]:
            return True
        e = getattr(e, "cause", None) or e.__cause__
        seen += 1
    return False


def oom_message(spec: RunSpec, phase: str) -> str:
    """``CUDA out of memory in the <phase> phase: the plan estimated …; try …``: the settings are the
    plan's own checked suggestions (rlhf.spec.advice) that lower that phase's figure."""
    from rlhf.spec.advice import suggestions
    from rlhf.spec.memory import estimate

    est = estimate(spec)
    generation = phase == "generate"
    if spec.placement.mode == "hybrid":  # the weight sync wakes vLLM: its share is what grows
        figure = "generation phase" if generation or phase == "sync" else "training phase"
    else:
        figure = "rollout" if generation else ROLE_OF_PHASE.get(phase, "actor")
    planned = est.total(figure) if figure in est.figures else None
    tips = [" ".join(s.overrides) for s in suggestions(spec, est, figure)
            if planned is None or s.total < planned - 0.05][:3]
    said = f"{planned:.1f} GB" if planned is not None else "an unknown amount"
    return (f"CUDA out of memory in the {phase} phase: the plan estimated {said} of "
            f"{spec.hardware.device_memory_gb:g} for the {figure}. Try {'; '.join(tips) or 'more GPUs or a smaller model'}"
            " (see rlhf-run ... --plan).")

"""One-line messages for failures whose fix is a setting: CUDA out of memory in a phase.

The loop knows which phase of the step was running; the spec knows what the plan estimated for
it. The message names both and the settings that lower that phase's memory.
"""

from __future__ import annotations

from typing import Iterator

from rlhf.spec.runspec import RunSpec

# the disaggregated figure of each phase that runs on a training role (generation: "rollout")
ROLE_OF_PHASE = {"reference": "reference", "teacher": "teacher", "critic": "critic", "reward": "reward"}


def causes(e: BaseException) -> Iterator[BaseException]:
    """``e``, then what it wraps, outermost first: the error a Ray worker raised (a RayTaskError's
    ``cause``) and ``raise ... from`` causes."""
    seen = 0
    while isinstance(e, BaseException) and seen < 8:
        yield e
        inner = getattr(e, "cause", None)  # a RayActorError's may be Ray's death record, not an error
        e = inner if isinstance(inner, BaseException) and inner is not e else e.__cause__
        seen += 1


def is_cuda_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error, raised here or inside a Ray worker (its ``cause``)."""
    return any(type(c).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(c).split("\n")[0]
               for c in causes(e))


def oom_message(spec: RunSpec, phase: str) -> str:
    """``CUDA out of memory in the <phase> phase: the plan estimated …; try …``: the settings are the
    plan's own checked suggestions (rlhf.plan.advice) that lower that phase's figure."""
    from rlhf.plan.advice import suggestions
    from rlhf.plan.memory import estimate, overlaps_update

    est = estimate(spec)
    generation = phase == "generate"
    if overlaps_update(spec):  # async on shared GPUs: the engine generates beside the update, one figure holds both
        figure = "training phase"
    elif spec.layout.one_pool:  # the weight sync wakes the engines: their share is what grows
        figure = spec.layout.figure("rollout", generating=generation or phase == "sync")
    else:
        figure = spec.layout.figure("rollout" if generation else ROLE_OF_PHASE.get(phase, "actor"))
    planned = est.total(figure) if figure in est.figures else None
    tips = [" ".join(s.overrides) for s in suggestions(spec, est, figure)
            if planned is None or s.total < planned - 0.05][:3]
    said = f"{planned:.1f} GB" if planned is not None else "an unknown amount"
    return (f"CUDA out of memory in the {phase} phase: the plan estimated {said} of "
            f"{spec.hardware.device_memory_gb:g} for the {figure}. Try {'; '.join(tips) or 'more GPUs or a smaller model'}"
            " (see rlhf-run ... --plan).")

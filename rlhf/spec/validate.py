"""Every check on a typed config, collected so the user sees all problems at once.

Each message names the key, the value, and a fix. The rules live per section in
``rlhf.spec.rules``; this runs them in order, and skips what an earlier problem makes meaningless
(no device counts: nothing that counts devices; a bad placement: the batch math over its ranks).
"""

from __future__ import annotations

from typing import Optional

from rlhf.agent.config import problems as agent_problems
from rlhf.spec.rules import Sections, algo, data, model, placement, rollout, run, train
from rlhf.spec.rules.algo import estimator_info

__all__ = ["estimator_info", "validate"]


def validate(s: Sections, roles: tuple[str, ...], shape_from: Optional[str] = None) -> list[str]:
    """Every problem of the typed sections, one message each. ``shape_from``: where the model's
    architecture numbers came from when not from its model group (``rlhf.spec.shape.shape_source``)."""
    p = algo.problems(s, roles) + model.problems(s)
    counts = placement.device_counts(s)
    if counts:
        return p + counts
    p += rollout.problems(s, roles) + agent_problems(s)
    placed = placement.problems(s, roles, shape_from)
    p += placed
    p += train.problems(s, roles, batch_math=not placed)
    p += data.problems(s) + data.reward_problems(s) + rollout.env_problems(s) + run.problems(s)
    return p

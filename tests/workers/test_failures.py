"""CUDA out of memory in a phase of the RL step: one line with the phase, the plan's figure and
settings that exist (a stand-in raises torch's OutOfMemoryError, as a CUDA worker would)."""

import pytest
import torch

from rlhf.loops.rl import Phases
from rlhf.spec.errors import UserError
from rlhf.plan.oom import is_cuda_oom

from tests.helpers import planned_spec


class _RayTaskError(Exception):  # what Ray raises in the driver: the worker's error as .cause
    def __init__(self, cause):
        super().__init__("ray task failed")
        self.cause = cause


def _assert_valid_overrides(msg, base):
    tips = msg.split("Try ", 1)[1].split(" (see")[0].split("; ")
    assert tips and tips[0]
    for tip in tips:
        planned_spec(base + tip.split())  # every suggested setting (one or more overrides) composes and validates


@pytest.mark.parametrize("phase", ["update", "reference", "generate"])
def test_oom_in_a_phase_is_one_line_with_valid_settings(phase):
    base = ["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"]
    spec = planned_spec(base)
    ph = Phases(spec)
    with pytest.raises(UserError) as info:
        with ph(phase):
            raise _RayTaskError(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    msg = str(info.value)
    assert "\n" not in msg
    assert f"in the {phase} phase" in msg and "the plan estimated" in msg
    assert ("generation phase" in msg) == (phase == "generate")
    _assert_valid_overrides(msg, base)


def test_other_errors_pass_through():
    ph = Phases(planned_spec(["model=qwen2.5-0.5b", "hardware=1xh200", "model.path=/nonexistent"]))
    with pytest.raises(ValueError):
        with ph("update"):
            raise ValueError("not memory")
    assert not is_cuda_oom(RuntimeError("shape mismatch"))
    assert is_cuda_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))

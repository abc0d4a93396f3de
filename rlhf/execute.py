"""Plan or run a built spec: the one step ``rlhf-run`` and every sweep job share after the spec is built."""

from __future__ import annotations

import sys

from rlhf.config.exits import EXIT_CONFIG
from rlhf.spec.runspec import RunSpec


def check_before_run(spec: RunSpec) -> int:
    """The checks a run passes before anything (its run dir included) is made: 0, or exit code 2
    having printed why (a GPU plan that does not fit, an output dir that cannot be written)."""
    from rlhf.spec.errors import UserError

    try:
        if spec.hardware.accelerator == "cuda":
            from rlhf.preflight import check_fits

            check_fits(spec)
        from rlhf.preflight import check_output_dir

        check_output_dir(spec.output_dir)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_CONFIG)
    return 0


def execute(spec: RunSpec, checked: bool = False) -> int:
    """Plan or run a built spec; the return value is the process exit code. ``checked``:
    ``check_before_run`` has passed already.

    The sweep (rlhf/sweep.py) calls this for every job too.
    """
    if spec.mode == "plan":
        from rlhf.spec.plan import render_plan

        print(render_plan(spec), flush=True)
        return 0
    from rlhf.spec.errors import UserError

    if not checked:
        code = check_before_run(spec)
        if code:
            return code
    if spec.hardware.accelerator == "cuda":
        from rlhf.spec.memory import estimate
        from rlhf.spec.plan import warnings

        for w in warnings(spec, estimate(spec)):  # the ones that do not stop the run (idle GPUs, ...)
            print(f"warning: {w}", file=sys.stderr)
    from rlhf.run import run

    try:
        return int(run(spec) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_CONFIG)

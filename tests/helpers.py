"""Helpers the test folders share (``from tests.helpers import ...``); the shared fixtures (a model
and data cache, the session's local Ray) are in tests/conftest.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


def close(a, b, atol: float = 1e-10, rtol: float = 1e-10) -> None:
    """``assert_close`` of two tensors or numbers, numbers taken as float64 (the references' dtype)."""
    import torch

    a = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.float64)
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def planned_spec(overrides: list[str]):
    """The spec ``rlhf-run <overrides> --plan`` builds (no run dir, nothing resolved or started)."""
    from rlhf.cli import build_spec, compose

    return build_spec(compose(overrides), overrides, plan=True)


def with_test_seed(overrides: list[str]) -> list[str]:
    """``overrides`` with ``train.seed`` replaced by $RLHF_TEST_SEED when it is set: the seed variants
    of scripts/learning_margins.sh (unset, each run keeps the seed it names or the default)."""
    seed = os.environ.get("RLHF_TEST_SEED")
    if not seed:
        return list(overrides)
    return [o for o in overrides if not o.startswith("train.seed=")] + [f"train.seed={int(seed)}"]


def record_learning(test: str, metric: str, value: float, threshold: float) -> None:
    """Append one learning result (a value the test asserts ``>= threshold``) to $RLHF_MARGINS_OUT,
    which scripts/learning_margins.sh collects into the margins table (docs/learning-margins.md)."""
    out = os.environ.get("RLHF_MARGINS_OUT")
    print(f"learning: {test} {metric} = {value:.4f} (threshold {threshold:.4f}, margin {value - threshold:+.4f})")
    if out:
        row = {"test": test, "metric": metric, "value": float(value), "threshold": float(threshold),
               "seed": os.environ.get("RLHF_TEST_SEED", ""), "cpu": os.environ.get("ATEN_CPU_CAPABILITY", ""),
               "threads": os.environ.get("RLHF_CPU_THREADS", "")}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def make_spec(overrides: list[str], out_dir: Path):
    """The spec of a run into ``out_dir`` with plain console output, and without the end-of-run report
    unless the overrides ask for it (``tracking.report=true``): drawing it costs the driver ~1 CPU-s a
    run, and only the report's own tests read it (tests/track)."""
    from rlhf.cli import build_spec, compose

    report = [] if any(o.startswith("tracking.report=") for o in overrides) else ["tracking.report=false"]
    overrides = with_test_seed(overrides) + [f"output_dir={out_dir}", "tracking.console=plain", *report]
    return build_spec(compose(overrides), overrides, plan=False)


def read_metrics(run_dir: Path) -> list[dict]:
    """The per-step rows of a run dir's metrics.jsonl ([] before the first step)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def run_rl(overrides: list[str], out_dir: Path) -> tuple[int, list[dict]]:
    """Run in-process; return (exit code, per-step metrics from metrics.jsonl)."""
    from rlhf.run import run

    code = run(make_spec(overrides, out_dir))
    return code, read_metrics(out_dir)


def fifth_means(rows: list[dict], key: str = "reward/mean") -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last fifth of the rows."""
    k = max(1, len(rows) // 5)
    vals = [r[key] for r in rows]
    return sum(vals[:k]) / k, sum(vals[-k:]) / k


def assert_clear(message: str, *parts: str) -> None:
    """One line that contains every part (the value and the fix)."""
    assert "\n" not in message.strip(), message
    assert "Traceback" not in message, message
    for p in parts:
        assert p in message, (p, message)


def _actor_states() -> dict[str, str]:
    """actor id -> state, from the GCS. (``ray.util.state.list_actors`` needs the dashboard, which
    the tests leave off to save memory and start-up time; this is the same table without it.)"""
    from ray._private import state

    return {aid: info["State"] for aid, info in state.actors().items()}


def snapshot() -> tuple[set, set]:
    """The actors and placement groups of the session's Ray now (for ``leftovers``)."""
    import ray

    return (set(_actor_states()),
            {pg_id for pg_id in ray.util.placement_group_table()})


def leftovers(since_actors: set, since_pgs: set) -> tuple[list, list]:
    """Actors alive and placement groups not removed that were not there before. The idle hosts
    of ``rlhf.launch.pool`` (kept for the next run on purpose, in no placement group) are not
    leftovers; a failed run's hosts never go there (tests/launch/test_host_reuse.py)."""
    import ray

    from rlhf.launch.pool import idle_hosts

    kept = {h._actor_id.hex() for h in idle_hosts()}
    alive = [aid for aid, st in _actor_states().items()
             if st != "DEAD" and aid not in since_actors and aid not in kept]
    pgs = [pg_id for pg_id, info in ray.util.placement_group_table().items()
           if info["state"] != "REMOVED" and pg_id not in since_pgs]
    return alive, pgs


def host_pids(run_dir: Path) -> dict[int, int]:
    """rank -> the pid of the process that held it in the run at ``run_dir``, from the header of each
    worker log (which process a run's ranks ran in: rlhf.launch.pool reuses them)."""
    out = {}
    for path in (Path(run_dir) / "logs").glob("*.log"):
        m = re.match(r"# \w+ rank (\d+) · pid (\d+) ", path.read_text().splitlines()[0])
        out[int(m.group(1))] = int(m.group(2))
    return out

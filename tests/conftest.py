"""Fixtures every test folder may use: the session's model/data cache and its local Ray. Plain helper
functions are in tests/helpers.py; a folder's conftest holds only what is its own."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def rlhf_cache(tmp_path_factory):
    """RLHF_CACHE for the session: $RLHF_TEST_CACHE, else a session tmp dir (builtin:tiny and the
    built-in data are built there once, never in the user's cache)."""
    old = os.environ.get("RLHF_CACHE")
    path = os.environ["RLHF_CACHE"] = os.environ.get("RLHF_TEST_CACHE") or str(tmp_path_factory.mktemp("rlhf_cache"))
    yield path
    if old is None:
        os.environ.pop("RLHF_CACHE", None)
    else:
        os.environ["RLHF_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def tracking_dir(tmp_path_factory):
    """$RLHF_TRACKING_DIR for the session: the default MLflow store (``rlhf.paths.tracking_dir``,
    which ``rlhf-run`` would set to ``outputs/`` of the directory it starts in) is a session tmp
    dir, so that no test writes a store into the repository."""
    from rlhf.paths import TRACKING_DIR_ENV

    old = os.environ.get(TRACKING_DIR_ENV)
    path = os.environ[TRACKING_DIR_ENV] = str(tmp_path_factory.mktemp("tracking"))
    yield path
    if old is None:
        os.environ.pop(TRACKING_DIR_ENV, None)
    else:
        os.environ[TRACKING_DIR_ENV] = old


@pytest.fixture(scope="module")
def rl_env(rlhf_cache):
    """The cache (its path is the value) and a local Ray for in-process runs (the launcher joins it
    and leaves it up). Checked per module and started when not up: a file run earlier in the same
    process may have shut its Ray down (tests/cli/test_sweep_parallel.py needs clusters of its own
    size). Left up for the next module; Ray ends with the process."""
    import ray

    if not ray.is_initialized():
        from rlhf.launch.group import REPO_ROOT

        ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RLHF_CACHE": rlhf_cache, "OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}})
    return rlhf_cache


@pytest.fixture(autouse=True)
def plenty_of_disk(request, monkeypatch):
    """Plans and the start-of-run check see 1 PB available under output_dir (``rlhf.plan.disk``):
    the plan verdicts the tests check (a 70B plan that fits 8 GPUs) must not depend on this
    machine's free disk. The disk check's own tests ask for ``real_disk``, which turns this off."""
    if "real_disk" in request.fixturenames:
        return
    from rlhf.plan import disk

    monkeypatch.setattr(disk, "available_bytes", lambda spec: 10**15)


@pytest.fixture
def real_disk():
    """The disk check sees the real ``rlhf.plan.disk.available_bytes`` (see ``plenty_of_disk``)."""


# -- scheduling over pytest-xdist workers (`make test`: -n 2 --dist loadgroup --no-loadscope-reorder)
#
# A file is one unit (its module fixtures, e.g. a shared training run, are built once), except the
# files in SPLIT, whose tests share nothing costly and are units of their own. Units go out longest
# first, by the seconds tests/durations.json measured (scripts/suite_durations.py writes it from a
# junit report), so that the two workers end together instead of one finishing a long file alone.
SPLIT = {"tests/rl/test_rl_learning.py"}


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPLIT else path


def pytest_collection_modifyitems(config, items):
    import json
    from pathlib import Path

    weights_file = Path(__file__).with_name("durations.json")
    seconds = json.loads(weights_file.read_text()) if weights_file.exists() else {}
    units: dict[str, float] = {}
    for item in items:
        unit = _unit(item.nodeid)
        units[unit] = seconds.get(unit, seconds.get(unit.split("[", 1)[0], 1.0))
        item.add_marker(pytest.mark.xdist_group(unit))
    order = {u: i for i, u in enumerate(sorted(units, key=lambda u: -units[u]))}
    items.sort(key=lambda item: order[_unit(item.nodeid)])  # stable: a file keeps its own order

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
                                           "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": ""}},
                 # no idle workers started ahead, as rlhf.launch.cluster.init_ray: the runs' actors
                 # start processes of their own, and each idle one cost ~1 CPU-s per test process
                 _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
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


# -- scheduling over pytest-xdist workers (`make test`: -n N --dist loadgroup --no-loadscope-reorder)
#
# A unit (an xdist group, run by one worker) is a set of tests of one file that share a costly
# fixture: tests joined by a module-, class- or package-scoped fixture (e.g. a shared training
# run, built once) are one unit; a test that shares none is a unit of its own, so a long file's
# independent tests spread over the workers. Fixtures in CHEAP are left out (they only check that
# something already up is up). Units go out longest first, by the seconds tests/durations.json
# measured for their tests (scripts/suite_durations.py writes it from a junit report; a test it
# does not name weighs its file's mean), so that the workers end together.
#
# The unit goes into each node id as ``<node id>@<unit>``, which is what ``--dist loadgroup``
# groups by. pytest-xdist's own ``xdist_group`` mark writes it into ``item._nodeid``, which pytest
# 9.2 no longer reads (a node id comes from ``item._id``): with the mark alone every test went to
# either worker and each worker ran the module fixtures it needed, a shared run twice. So the
# suffix is written here, where the running pytest reads it.
CHEAP = {"rl_env"}
SHARED_SCOPES = {"module", "class", "package"}


def _shared_fixtures(item) -> set[str]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {name for name, defs in info.name2fixturedefs.items()
            if name not in CHEAP and defs and defs[-1].scope in SHARED_SCOPES}


def units_of(items) -> dict[str, str]:
    """Node id → unit name: union-find, within each file, over the shared fixtures tests use."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item in items:
        path = item.nodeid.split("::", 1)[0]
        find(item.nodeid)
        for name in _shared_fixtures(item):
            a, b = find(item.nodeid), find(f"{path}::fixture:{name}")
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {item.nodeid: find(item.nodeid) for item in items}


def pytest_collection_modifyitems(config, items):
    import json
    from collections import Counter, defaultdict
    from pathlib import Path

    weights_file = Path(__file__).with_name("durations.json")
    seconds = json.loads(weights_file.read_text()) if weights_file.exists() else {}
    file_of = {item.nodeid: item.nodeid.split("::", 1)[0] for item in items}
    known: dict[str, list[float]] = defaultdict(list)  # a file's measured tests
    for nodeid, s in seconds.items():
        known[nodeid.split("::", 1)[0]].append(s)
    tests_in = Counter(file_of.values())

    def mean(path: str) -> float:  # a key naming the file itself holds the whole file's seconds
        if path in seconds:
            return seconds[path] / tests_in[path]
        return sum(known[path]) / len(known[path]) if known.get(path) else 1.0

    unit_of = units_of(items)
    weight: dict[str, float] = defaultdict(float)
    for item in items:
        weight[unit_of[item.nodeid]] += seconds.get(item.nodeid) or mean(file_of[item.nodeid])
    order = {u: i for i, u in enumerate(sorted(weight, key=lambda u: -weight[u]))}
    items.sort(key=lambda item: order[unit_of[item.nodeid]])  # stable: a unit keeps its file's order
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker of --dist loadgroup
        for item in items:
            group(item, unit_of[item.nodeid])


def group(item, unit: str) -> None:
    """``item``'s node id with ``@<unit>`` (a short hash of the unit's name): pytest-xdist's
    loadgroup scheduler sends every test of one unit to one worker."""
    import hashlib

    new = f"{item.nodeid}@{hashlib.sha1(unit.encode()).hexdigest()[:10]}"
    if hasattr(item, "_id"):  # pytest >= 9.2: the node id is str(item._id)
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(new)
    else:  # older pytest: str item._nodeid
        item._nodeid = new
    assert item.nodeid == new, (item.nodeid, new)

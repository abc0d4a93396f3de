"""CPU seconds a command costs, counted over every process it starts (Ray's GCS, raylet and
actor workers too), so a test's cost can be read on a busy machine where wall time cannot.

    python -m bench.cpu_cost -- python -m pytest -q -p no:cacheprovider tests/rl/test_rl_runs.py

The command runs with a marker in its environment; every process whose environment holds the
marker (children inherit it, whether or not they stay in the process tree) is sampled every
``--every`` seconds and its last seen user+system time counted once. A process that lives
shorter than one sample is missed (its cost is then under-counted, never over-counted).
Prints one line: ``cpu_s=... wall_s=... processes=... rc=...``; ``--json`` writes it as JSON.
``--by-process`` adds the seconds per kind of process (the driver, ``ray::Host``, Ray's daemons), by
the last title each had (Ray retitles a worker ``ray::<Actor>`` once it holds one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid


def _marked(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


def _cpu_s(pid: int) -> float | None:
    """user + system seconds of one live process, from /proc/PID/stat (fields 14 and 15)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _label(pid: int) -> str:
    """A short name for a process: Ray's process title (``ray::Host``, ``raylet``, ``gcs_server``)
    or the program and its module/script (``python -m pytest``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not args:
        return "?"
    first = args[0]
    if first.startswith("ray::"):
        return first.split()[0].split(".")[0]
    base = os.path.basename(first.split()[0])
    if base.startswith("python"):
        rest = [a for a in args[1:] if not a.startswith("-") or a == "-m"]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"python -m {rest[1]}"
        if rest:
            return f"python {os.path.basename(rest[0])}"
    return base


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def measure(cmd: list[str], every: float = 0.2) -> dict:
    tag = f"RLHF_CPU_COST_TAG={uuid.uuid4().hex}"
    marker = tag.encode() + b"\0"
    env = dict(os.environ)
    k, v = tag.split("=", 1)
    env[k] = v
    seen: dict[tuple[int, int], float] = {}  # (pid, start time) -> last user+sys seconds
    names: dict[tuple[int, int], str] = {}  # (pid, start time) -> last seen label (Ray retitles workers)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    known: set[int] = set()
    while True:
        done = proc.poll() is not None
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid not in known and not _marked(pid, marker):
                continue
            known.add(pid)
            start = _start_ticks(pid)
            cpu = _cpu_s(pid)
            if start is not None and cpu is not None:
                seen[(pid, start)] = cpu
                label = _label(pid)
                if label != "?" and not label.startswith("ray::IDLE"):
                    names[(pid, start)] = label
        if done:
            break
        time.sleep(every)
    by: dict[str, list[float]] = {}
    for key, cpu in seen.items():
        by.setdefault(names.get(key, "?"), []).append(cpu)
    return {"cpu_s": round(sum(seen.values()), 1), "wall_s": round(time.monotonic() - t0, 1),
            "processes": len(seen), "rc": proc.returncode,
            "by_process": {k: [len(v), round(sum(v), 1)] for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("--by-process", action="store_true",
                    help="also print CPU seconds per kind of process (count, seconds), most first")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    res = measure(cmd, a.every)
    line = " ".join(f"{k}={v}" for k, v in res.items() if k != "by_process")
    print(line, file=sys.stderr)
    if a.by_process:
        for name, (n, cpu) in res["by_process"].items():
            print(f"  {cpu:8.1f} s  {n:3d} x {name}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return int(res["rc"] or 0)


if __name__ == "__main__":
    sys.exit(main())

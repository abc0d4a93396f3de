"""CPU seconds a command costs, counted over every process it starts (Ray's GCS, raylet and
actor workers too), so a test's cost can be read on a busy machine where wall time cannot.

    python -m bench.cpu_cost -- python -m pytest -q -p no:cacheprovider tests/rl/test_rl_runs.py

The command runs with a marker in its environment; every process whose environment holds the
marker (children inherit it, whether or not they stay in the process tree) is sampled every
``--every`` seconds and its last seen user+system time counted once. A process that lives
shorter than one sample is missed (its cost is then under-counted, never over-counted).
Prints one line: ``cpu_s=... wall_s=... processes=... rc=...``; ``--json`` writes it as JSON.
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
        if done:
            break
        time.sleep(every)
    return {"cpu_s": round(sum(seen.values()), 1), "wall_s": round(time.monotonic() - t0, 1),
            "processes": len(seen), "rc": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    res = measure(cmd, a.every)
    line = " ".join(f"{k}={v}" for k, v in res.items())
    print(line, file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return int(res["rc"] or 0)


if __name__ == "__main__":
    sys.exit(main())

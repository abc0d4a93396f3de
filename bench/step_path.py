"""The executed path of one GRPO step: every rlhf file whose Python code runs during the step, in
any process of the run (the driver and every Ray worker), measured, not read off the code.

    .venv/bin/python -m bench.step_path            # the default run (CPU, hybrid), 3 steps
    .venv/bin/python -m bench.step_path placement=disaggregated

How: the run is ``rlhf-run train.steps=3`` in a child process whose ``PYTHONPATH`` starts with a
directory holding a ``sitecustomize.py``, which Python imports at the start of every process
(the driver, and the Ray workers, which inherit the driver's ``PYTHONPATH``: rlhf/launch/group.py).
It installs ``sys.setprofile`` (and ``threading.setprofile``) with a hook that notes, for every
Python function call whose code lives in ``rlhf/``, the file and the wall-clock time of its first
call in each 10 ms, appended to one file per process. The driver's notes also mark when each
step's ``Phases`` is made (``rlhf/loops/rl.py``: the first line of every step), and the mark
starts the 10 ms over: the first call of every file after it is noted, so that a step's last
calls (its metrics line, a few ms before the next mark) count in that step and not in the next.
The step measured is the second of three: from its ``Phases`` to the third's, so neither the
first step's warm-up nor the last step's export counts. A file is on the path when any process
entered it in that window.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = str(ROOT / "rlhf") + os.sep
BUCKET = 0.01  # seconds
STEP_MARK = ("loops/rl.py", "__init__")  # Phases.__init__: the first call of every step

_SITE = """
import os
if os.environ.get("RLHF_TRACE_DIR"):
    import bench.step_path as _sp
    _sp.install(os.environ["RLHF_TRACE_DIR"])
"""


def install(out_dir: str) -> None:
    """Note every call into an rlhf file in this process (see the module's docstring)."""
    import threading

    seen: set = set()
    detail = bool(os.environ.get("RLHF_TRACE_FUNCTIONS"))  # note each function too (slower)
    path = Path(out_dir) / f"{os.getpid()}.txt"
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life; line-buffered
    cut = len(PKG) - len("rlhf/")

    def hook(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call":
            return
        code = frame.f_code
        f = code.co_filename
        if not f.startswith(PKG):
            return
        rel = f[cut:]
        t = time.time()
        if rel.endswith(STEP_MARK[0]) and code.co_name == STEP_MARK[1] and "Phases" in code.co_qualname:
            seen.clear()  # a step's first calls are noted even in the 10 ms of the last step's end
            out.write(f"STEP {t:.6f}\n")
        key = (rel, int(t / BUCKET), code.co_qualname if detail else "")
        if key not in seen:
            seen.add(key)
            out.write(f"{rel} {t:.6f} {key[2]}\n".rstrip() + "\n")

    sys.setprofile(hook)
    threading.setprofile(hook)


def files_in_step(trace_dir: Path, step: int = 2) -> dict[str, dict[str, set[str]]]:
    """file -> process (``pid``) -> the functions it ran there (empty unless noted) during step
    ``step`` (1-based), for every file some process entered in that step."""
    marks: list[float] = []
    events: dict[str, list[tuple[str, float, str]]] = {}
    for p in trace_dir.glob("*.txt"):
        for line in p.read_text().splitlines():
            parts = line.split(" ")
            if parts[0] == "STEP":
                marks.append(float(parts[1]))
            else:
                events.setdefault(p.stem, []).append((parts[0], float(parts[1]), parts[2] if len(parts) > 2 else ""))
    marks.sort()
    if len(marks) < step + 1:
        raise SystemExit(f"the run made {len(marks)} steps; step {step} needs {step + 1} marks")
    lo, hi = marks[step - 1], marks[step]
    out: dict[str, dict[str, set[str]]] = {}
    for pid, evs in events.items():
        for rel, t, fn in evs:
            if lo <= t < hi:
                fns = out.setdefault(rel, {}).setdefault(pid, set())
                if fn:
                    fns.add(fn)
    return out


def measure(overrides: list[str], work: Path, functions: bool = False) -> dict[str, dict[str, set[str]]]:
    """Run ``rlhf-run train.steps=3 <overrides>`` traced; the files of its second step."""
    site = work / "site"
    trace = work / "trace"
    site.mkdir(parents=True, exist_ok=True)
    trace.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITE))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["RLHF_TRACE_DIR"] = str(trace)
    if functions:
        env["RLHF_TRACE_FUNCTIONS"] = "1"
    cmd = [sys.executable, "-m", "rlhf.cli", "train.steps=3",
           f"output_dir={work / 'run'}", "tracking.backend=none", "tracking.console=plain", *overrides]
    subprocess.run(cmd, env=env, check=True, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    return files_in_step(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--functions", action="store_true", help="name the functions run in each file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        files = measure(args.overrides, Path(d), args.functions)
    procs = sorted({p for ps in files.values() for p in ps})
    for f in sorted(files):
        print(f"{f:40s} {' '.join('P' + str(procs.index(p)) for p in sorted(files[f]))}")
        for p in sorted(files[f]):
            if files[f][p]:
                print(f"    P{procs.index(p)}: {', '.join(sorted(files[f][p]))}")
    print(f"{len(files)} files in {len(procs)} processes")


if __name__ == "__main__":
    main()

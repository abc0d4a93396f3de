"""bench.cpu_cost: a command's CPU seconds over the processes it starts, and per kind of process."""

from __future__ import annotations

import sys


def test_a_command_is_counted_under_its_own_name():
    from bench.cpu_cost import measure

    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    res = measure([sys.executable, "-c", spin], every=0.05)
    assert res["rc"] == 0
    assert res["cpu_s"] >= 0.5, res
    by = res["by_process"]
    assert sum(n for n, _ in by.values()) == res["processes"], res
    mine = [k for k in by if k.startswith("python import time")]
    assert mine and by[mine[0]][1] >= 0.5, by

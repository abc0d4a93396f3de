"""tests/durations.json from a junit report of the whole suite: the seconds each test took (a
module fixture's set-up counts in the first test that asked for it), which tests/conftest.py adds
up per scheduling unit to send the longest units to the pytest-xdist workers first.

    .venv/bin/python -m pytest -n 2 --dist loadgroup --junitxml=outputs/suite.xml
    .venv/bin/python scripts/suite_durations.py outputs/suite.xml     # rewrites tests/durations.json
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def nodeid(classname: str, name: str, root: Path) -> str:
    """pytest's node id of a junit testcase (classname ``tests.rl.test_x`` or ``tests.rl.test_x.Class``),
    without the ``@<unit>`` that tests/conftest.py appends under ``--dist loadgroup``."""
    name = re.sub(r"@[0-9a-f]{10}\]?$", "", name)  # junit writes "test[p]@unit]" for "test[p]@unit"
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if (root / ("/".join(parts[:i]) + ".py")).exists():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return f"{classname}::{name}"


def seconds_per_test(junit: Path, root: Path) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        totals[(nodeid(case.get("classname", ""), case.get("name", ""), root))] += float(case.get("time") or 0)
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    out = root / "tests" / "durations.json"
    out.write_text(json.dumps(seconds_per_test(Path(sys.argv[1]), root), indent=1) + "\n")
    print(f"wrote {out}")

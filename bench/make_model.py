"""Build a random-weight checkpoint with the numbers of conf/model/<preset>.yaml (no hub).

    python -m bench.make_model qwen2.5-0.5b /tmp/rlhf-gpu/models/qwen2.5-0.5b-random
"""

from __future__ import annotations

import argparse

from bench.common import make_random_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", nargs="?", default="qwen2.5-0.5b", help="a conf/model/<preset>.yaml name")
    ap.add_argument("out", nargs="?", help="folder to write (default /tmp/rlhf-gpu/models/<preset>-random)")
    a = ap.parse_args()
    print(make_random_model(a.out or f"/tmp/rlhf-gpu/models/{a.preset}-random", a.preset))

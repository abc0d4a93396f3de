"""Build a random-weight checkpoint with the numbers of conf/model/<preset>.yaml (no hub).

    python -m bench.make_model qwen2.5-0.5b /tmp/rlhf-gpu/models/qwen2.5-0.5b-random
"""

from __future__ import annotations

import sys

from bench.common import make_random_model

if __name__ == "__main__":
    preset, out = (sys.argv[1:3] + [None, None])[:2]
    preset = preset or "qwen2.5-0.5b"
    print(make_random_model(out or f"/tmp/rlhf-gpu/models/{preset}-random", preset))

"""Stand-in for ``trl`` on veRL's path only (bench/e2e_peers.py puts this folder first there).

veRL 0.9.1 (pinned to trl 0.27) patches ``AutoModelForCausalLMWithValueHead.state_dict`` whenever a
``trl`` package is importable; the bundle's TRL 1.16 (for the TRL side) no longer has that class,
so veRL's actor init fails with ImportError. The class serves veRL's critic / value-head models
only, which GRPO never builds: this stand-in gives veRL a class to patch and nothing else.
"""

from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401

__version__ = "0.0.0+bench-stand-in"

"""The resume test's uninterrupted reference runs in-process on the session's local Ray."""

from tests.rl.conftest import rl_env  # noqa: F401

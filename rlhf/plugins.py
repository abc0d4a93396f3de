"""Plugin modules named in config (``algo.plugins``, ``rollout.plugins``, ``placement.plugins``):
importing one registers its parts; a module that does not import is one line for validation."""

from __future__ import annotations

import importlib
from typing import Optional


def import_problem(key: str, module: str) -> Optional[str]:
    """None if ``module`` imports, else one line naming the key, the module, the error and the fix."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (a plugin's own error is the user's to see, in one line)
        first = f"{type(e).__name__}: {e}".splitlines()[0]
        return (f"{key}: cannot import {module!r} ({first}). Give a module importable from the "
                "working directory or PYTHONPATH.")
    return None

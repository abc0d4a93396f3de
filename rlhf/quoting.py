"""Paths written into Hydra overrides, and into the ``rlhf-run resume=...`` line a message prints,
so that Hydra's override grammar reads them back verbatim: a run dir may hold a comma (a choice
sweep to the grammar), spaces, ``=``, quotes or brackets."""

from __future__ import annotations

import shlex


def quote_value(value: str, double: bool = False) -> str:
    """``value`` as a quoted string of Hydra's override grammar (single quotes, or double with
    ``double``): Hydra's own quoting, which escapes the quotes and the backslashes before them."""
    from hydra.core.override_parser.types import Quote, QuotedString

    return QuotedString(text=value, quote=Quote.double if double else Quote.single).with_quotes()


def resume_command(run_dir: object) -> str:
    """``rlhf-run resume=<run dir>`` as a shell command line that continues the run: the dir as it
    is where the grammar reads it back unchanged (the usual ``outputs/<date>/<time>``), else quoted
    for Hydra, and the argument quoted for the shell where it needs it."""
    path = str(run_dir)
    value = path if _reads_back(path) else quote_value(path, double=True)
    return f"rlhf-run {shlex.quote(f'resume={value}')}"


def _reads_back(path: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (override,) = OverridesParser.create().parse_overrides([f"resume={path}"])
    except Exception:  # OverrideParseException: not a plain value of the grammar
        return False
    return not override.is_sweep_override() and override.value() == path

"""Overrides parsed by Hydra's parser, and the group options they pick checked against the ones there are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from rlhf.config.groups import GROUPS, INTERNAL_GROUPS, RECIPES_SOURCE, USER_DIRS_ENV, group_options, option_problem, search_dirs


def parse_overrides(overrides: Sequence[str]) -> list[Any]:
    """Hydra's parse of the overrides (raises SpecError naming the one that does not parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlhf.spec.errors import SpecError

    parser = OverridesParser.create()
    out = []
    for o in overrides:
        try:
            out.extend(parser.parse_overrides([o]))
        except Exception as e:  # OverrideParseException
            raise SpecError([
                f"cannot parse the override {o!r} ({_parse_problem(o, str(e))}). Write GROUP=OPTION or KEY=VALUE, "
                "e.g. algo=ppo or algo.lr=1e-6; quote values with spaces or special characters."
            ]) from None
    return out


def _parse_problem(override: str, text: str) -> str:
    """The first line of Hydra's parse error (not its "See https://..." line); the lexer's caret
    line becomes the character and its column."""
    lines = text.split("\n")
    lexer = "LexerNoViableAltException: "
    if lines[0].startswith(lexer) and len(lines) > 1 and lines[1].strip() == "^":
        col = lines[1].index("^") - len(lexer)
        if 0 <= col < len(override):
            return f"unexpected {override[col]!r} at column {col + 1}"
    return " ".join(lines[0].split())


def searchpath_of(overrides: Sequence[str]) -> list[str]:
    """The entries of a ``hydra.searchpath=[...]`` override, [] without one."""
    for o in overrides:
        if o.partition("=")[0].lstrip("+") == "hydra.searchpath":
            (ov,) = parse_overrides([o])
            value = ov.value()
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return []


def user_dirs(overrides: Sequence[str]) -> list[Path]:
    """The user's config folders among the overrides (``hydra.searchpath``), in Hydra's order."""
    return search_dirs(searchpath_of(overrides))


def with_config_dirs(overrides: Sequence[str], dirs: Sequence[str]) -> list[str]:
    """The overrides with the folders of ``-cd DIR`` (and of $RLHF_CONFIG_DIRS) added to Hydra's
    search path, ahead of any ``hydra.searchpath`` entries, as Hydra orders its --config-dir.
    One ``hydra.searchpath`` override then carries them to every compose, the Hydra app and a
    sweep's jobs. Raises SpecError for a folder that does not exist."""
    from rlhf.spec.errors import SpecError

    env = [d for d in os.environ.get(USER_DIRS_ENV, "").split(os.pathsep) if d]
    problems, entries = [], []
    for d, origin in [*((d, "-cd") for d in dirs), *((d, f"${USER_DIRS_ENV}") for d in env)]:
        folder = Path(d).expanduser().resolve()
        if not folder.is_dir():
            problems.append(f"{origin} {d}: no such folder. Give a folder of your own config groups and "
                            "recipes (recipe/<name>.yaml, algo/<name>.yaml, ...).")
        entries.append(f"file://{folder}")
    if problems:
        raise SpecError(problems)
    given = searchpath_of(overrides)
    if not entries and not given:
        return list(overrides)  # conf/config.yaml's own hydra.searchpath: the shipped recipes
    from rlhf.quoting import quote_value

    # a hydra.searchpath on the command line replaces conf/config.yaml's: the recipes go back at the end
    merged = [*entries, *(e for e in given if e not in entries and e != RECIPES_SOURCE), RECIPES_SOURCE]
    rest = [o for o in overrides if o.partition("=")[0].lstrip("+") != "hydra.searchpath"]
    return [*rest, f"hydra.searchpath=[{','.join(quote_value(e) for e in merged)}]"]


def check_group_choices(overrides: Sequence[str], allow_sweep: bool = False) -> list[Any]:
    """An unknown option of a group is an error with the valid ones (recipe and model_defaults are
    optional groups, so Hydra itself would silently skip an unknown one). Returns Hydra's parse of
    the overrides, checked."""
    from rlhf.spec.errors import SpecError

    problems = []
    dirs = user_dirs(overrides)
    parsed = parse_overrides(overrides)
    for ov in parsed:
        group = ov.key_or_group
        if ov.is_sweep_override() and not allow_sweep:
            problems.append(f"{ov.input_line}: a sweep of values needs -m (multirun): rlhf-run -m {ov.input_line}")
            continue
        if ov.is_delete() or ov.package or group not in GROUPS + INTERNAL_GROUPS:
            continue
        if ov.is_sweep_override():
            values = [str(v) for v in ov.sweep_string_iterator()]
        else:
            values = [str(ov.value())] if ov.value() is not None else []
        options = group_options("model" if group in INTERNAL_GROUPS else group, dirs)
        for v in values:
            if v in options and group not in INTERNAL_GROUPS:
                problem = option_problem(group, v, dirs)
                if problem:
                    problems.append(problem)
            elif v not in options:
                if group in INTERNAL_GROUPS:
                    problems.append(
                        f"{group}={v}: {group} follows model= (it is model_defaults/<model>.yaml); pick model= instead."
                    )
                else:
                    problems.append(f"{group} {v!r} not found. Choose one of: {', '.join(options) or '(none)'}.")
    if problems:
        raise SpecError(problems)
    return parsed

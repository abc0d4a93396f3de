"""Overrides parsed by Hydra's parser, and the group options they pick checked against the ones there are."""

from __future__ import annotations

from typing import Any, Sequence

from rlhf.config.groups import GROUPS, INTERNAL_GROUPS, group_options


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
            detail = str(e).split("\n")[1] if "\n" in str(e) else str(e)
            raise SpecError([
                f"cannot parse the override {o!r} ({detail.strip()}). Write GROUP=OPTION or KEY=VALUE, "
                "e.g. algo=ppo or algo.lr=1e-6; quote values with spaces or special characters."
            ]) from None
    return out


def check_group_choices(overrides: Sequence[str], allow_sweep: bool = False) -> None:
    """An unknown option of a group is an error with the valid ones (recipe and model_defaults are
    optional groups, so Hydra itself would silently skip an unknown one)."""
    from rlhf.spec.errors import SpecError

    problems = []
    for ov in parse_overrides(overrides):
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
        options = group_options("model" if group in INTERNAL_GROUPS else group)
        for v in values:
            if v not in options:
                if group in INTERNAL_GROUPS:
                    problems.append(
                        f"{group}={v}: {group} follows model= (it is model_defaults/<model>.yaml); pick model= instead."
                    )
                else:
                    problems.append(f"{group} {v!r} not found. Choose one of: {', '.join(options) or '(none)'}.")
    if problems:
        raise SpecError(problems)

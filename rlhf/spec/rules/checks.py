"""What several rules check alike."""

from __future__ import annotations

from typing import Any


def choice(problems: list[str], key: str, value: Any, options: tuple[str, ...]) -> None:
    """A problem when ``value`` is not one of ``options``."""
    if value not in options:
        problems.append(f"{key}={value!r} is not valid. Choose one of: {', '.join(options)}.")


def is_one_of(value: Any, options: tuple[Any, ...]) -> bool:
    """``value`` is one of ``options`` with its type too (True is not the ZeRO stage 1)."""
    return any(value == o and type(value) is type(o) for o in options)


def auto_bool(p: list[str], key: str, value: Any, auto_means: str) -> bool:
    """Whether ``value`` is auto, true or false; else a problem naming ``key`` and those three."""
    if is_one_of(value, ("auto", True, False)):
        return True
    p.append(f"{key}={value!r} is not valid. Use auto ({auto_means}), true or false.")
    return False

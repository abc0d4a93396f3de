"""Errors a user can act on: each one names the value and the fix."""

from __future__ import annotations


class SpecError(Exception):
    """One or more problems with a run's configuration, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def render(self) -> str:
        lines = []
        for p in self.problems:
            head, *rest = p.split("\n")
            lines.append("error: " + head)
            lines.extend("       " + r for r in rest)
        return "\n".join(lines)


class UserError(Exception):
    """A bad input found at run time (data, reward code, paths): one line, exit code 2."""

    exit_code = 2

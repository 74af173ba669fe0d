"""Fleet-file problems: every mistake in a fleet file, reported at once.

Operators edit fleet files by hand, so the loader collects every problem it
finds instead of stopping at the first, and each one names the file, line and
field in the ``file:line: field: message`` shape editors and grep understand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class FleetProblem:
    """One mistake in a fleet file.

    ``line`` is ``None`` when the mistake has no place in the text (a missing
    key, an unreadable file); ``column`` is only known for TOML syntax errors;
    ``field`` is empty for problems about the file as a whole.
    """

    file: str
    line: int | None
    field: str
    message: str
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        if self.field:
            return f"{where}: {self.field}: {self.message}"
        return f"{where}: {self.message}"


class FleetError(Exception):
    """A fleet file that cannot be used, with every problem found in it."""

    def __init__(self, problems: Iterable[FleetProblem]) -> None:
        self.problems: tuple[FleetProblem, ...] = tuple(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(str(problem) for problem in self.problems)

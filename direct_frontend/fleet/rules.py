"""How a fleet-file field is read: its :class:`Rules`, and :func:`setting` to declare one.

Shared by the schema's modules (fleet/schema.py, fleet/frontend_tables.py):
the fields are the keys of the file, and their rules what the loader checks.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rules:
    """How the loader reads one field (kept in the field's metadata under ``"rules"``).

    Numbers are checked against ``at_least``, ``above`` (strictly) and
    ``at_most``; a choice (a ``Literal`` or an enum) is called ``noun`` in
    messages.
    """

    key: str | None = None  # the TOML key, when it is not the field's name
    in_file: bool = True  # False: not a key of the file at all (FleetConfig.source)
    derived: bool = False  # no default, yet optional: the loader derives it when absent
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    noun: str | None = None
    secret: bool = False  # never quoted in a message, kept out of repr


def setting(default: _T, rules: Rules) -> _T:
    """A field with a default and the :class:`Rules` the loader checks it against."""
    field: _T = dataclasses.field(
        default=default, repr=not rules.secret, metadata={"rules": rules}
    )
    return field


NON_NEGATIVE = Rules(at_least=0)
POSITIVE = Rules(above=0)
AT_LEAST_ONE = Rules(at_least=1)

"""The sandboxed Jinja environment chat templates render in, with a cheaper ``message.x``.

Chat templates read their messages' fields as attributes (``message.content``),
and Jinja's sandbox looks an attribute up on the object first: on a plain
``dict`` that raises ``AttributeError`` (an exception per field read: about
half of a long conversation's render), and only then reads the item. For a
plain ``dict`` and a name that is not one of ``dict``'s own attributes, that
lookup can only fail, so :class:`TemplateEnvironment` reads the item at once:
the same value or the same undefined, and no attribute the sandbox guards is
reached another way (``dict``'s own attributes still go through the sandbox).
"""

from __future__ import annotations

from typing import Any, Final

from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateEnvironment"]

_DICT_ATTRIBUTES: Final = frozenset(dir(dict))


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """:class:`ImmutableSandboxedEnvironment` whose ``dict.field`` skips the failing lookup."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

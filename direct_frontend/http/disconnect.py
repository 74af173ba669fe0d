"""A client's disconnect, told by the server the moment it happens: no task waits for it.

A model request runs beside a watch for its client leaving: hypercorn
drops sends to a gone client silently, so without one the engine would
keep generating. ASGI tells the app through ``receive`` only, so the
portable watch is a task of its own reading ``receive``
(http/stream.py ``ClientWatch``): a nursery, a task started and ended, and
its wake-ups, for every request. Where our HTTP/1.1 stream shim is in use
(http/coalesce.py ``FinalBodyHTTPStream``), the server holds a
:class:`Disconnect` for each request instead, in the scope's extensions
under :data:`DISCONNECT`, and fires it when the connection closes before
the response's last body: the request's writer cancels its own scope then,
with no task. The ``http.disconnect`` message is still sent to ``receive``,
as ASGI says.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Final

import trio

#: the scope extension that holds a request's :class:`Disconnect`
DISCONNECT: Final = "direct_frontend.disconnect"


class Disconnect:
    """One request's client leaving: :meth:`fire` (the server's) cancels the scope being
    watched (:meth:`watch`), now or as soon as one is."""

    __slots__ = ("_scope", "_watched", "gone")

    def __init__(self) -> None:
        self.gone = False  # the connection closed before the response's last body
        self._scope: trio.CancelScope | None = None
        self._watched = False

    def fire(self) -> None:
        """The client left before the response was complete."""
        self.gone = True
        if self._scope is not None:
            self._scope.cancel()

    def watch(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client leaves (at once if it has already)."""
        self._scope = scope
        self._watched = True
        if self.gone:
            scope.cancel()

    def left(self) -> bool:
        """Stop watching: whether the client left (since before the watch, or during it)."""
        self._scope = None
        return self._watched and self.gone


def disconnect_of(scope: MutableMapping[str, Any]) -> Disconnect | None:
    """The request's :class:`Disconnect`, where its server gives one (else None: watch
    ``receive``)."""
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(DISCONNECT)

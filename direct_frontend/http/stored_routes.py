"""The routes of stored responses: ``/v1/responses/{id}`` (``GET``, ``DELETE``),
``/v1/responses/{id}/cancel`` and ``/v1/responses/{id}/input_items``.

Each is answered for the request's owner only (http/identity.py); what they
do is http/stored_responses.py's, and following a background response's
events (``GET ...?stream=true``) is http/background.py's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from direct_frontend.http.asgi import Handler, Headers, Receive, Scope, Send, from_body
from direct_frontend.http.background import BackgroundResponses, follow, follow_cursor
from direct_frontend.http.identity import owner_of
from direct_frontend.http.stored_responses import (
    CANCEL,
    INPUT_ITEMS,
    RESPONSE_PATH,
    respond_cancel,
    respond_delete,
    respond_input_items,
    respond_retrieve,
)
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import response_not_found
from direct_frontend.openai.response_store import ResponseStore
from direct_frontend.pipeline.settings import Settings

#: what a stored response's endpoint does: (store, id, owner, send, headers) in, status out
Answer = Callable[[ResponseStore, str, str, Send, Headers], Awaitable[int]]


class StoredRoutes:
    """The stored responses' endpoints (``responses`` None: the server keeps none, and every
    id is not found)."""

    def __init__(self, responses: ResponseStore | None,
                 background: BackgroundResponses | None, metrics: Metrics) -> None:
        self.responses = responses
        self.background = background
        self.metrics = metrics

    def route(self, path: str) -> tuple[dict[str, Handler], str] | None:
        """The methods of a stored response's path, and its metrics label; None if it is
        not one."""
        if not path.startswith(RESPONSE_PATH) or len(path) <= len(RESPONSE_PATH):
            return None
        if path.endswith(INPUT_ITEMS) and len(path) > len(RESPONSE_PATH + INPUT_ITEMS):
            return {"GET": self.input_items}, RESPONSE_PATH + "{id}" + INPUT_ITEMS
        if path.endswith(CANCEL) and len(path) > len(RESPONSE_PATH + CANCEL):
            return {"POST": self.cancel}, RESPONSE_PATH + "{id}" + CANCEL
        return {"GET": self.retrieve, "DELETE": self.delete}, RESPONSE_PATH + "{id}"

    async def retrieve(self, settings: Settings, scope: Scope, receive: Receive,
                       send: Send) -> int:
        query = scope.get("query_string", b"")

        async def answer(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
            after = follow_cursor(query)  # None: a snapshot, not its events
            if after is None:
                return await respond_retrieve(store, response_id, owner, send, headers)
            assert self.background is not None  # there is a store, so it runs
            return await follow(self.background, response_id, owner, after, receive, send,
                                headers)

        return await self._stored(settings, scope, receive, send, answer)

    async def cancel(self, settings: Settings, scope: Scope, receive: Receive,
                     send: Send) -> int:
        return await self._stored(settings, scope, receive, send, respond_cancel, CANCEL)

    async def delete(self, settings: Settings, scope: Scope, receive: Receive,
                     send: Send) -> int:
        return await self._stored(settings, scope, receive, send, respond_delete)

    async def input_items(self, settings: Settings, scope: Scope, receive: Receive,
                          send: Send) -> int:
        query = scope.get("query_string", b"")

        async def answer(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
            return await respond_input_items(store, response_id, owner, query, send, headers)

        return await self._stored(settings, scope, receive, send, answer, INPUT_ITEMS)

    async def _stored(self, settings: Settings, scope: Scope, receive: Receive, send: Send,
                      answer: Answer, suffix: str = "") -> int:
        """A stored response's endpoint; its id is the path between the prefix and
        ``suffix``."""
        path: str = scope["path"]
        response_id = path[len(RESPONSE_PATH):len(path) - len(suffix)]
        owner = owner_of(settings.frontend.auth, scope)

        async def held(body: bytes, headers: Headers) -> int:
            if self.responses is None:
                raise response_not_found(response_id)
            return await answer(self.responses, response_id, owner, send, headers)

        return await from_body(settings.frontend, receive, send, held,
                               self.metrics.request_cancelled)

"""The one writer of a request's output: the stair's events, rendered, to the client.

:class:`Writer` is the :class:`~direct_frontend.pipeline.serve_events.Sink`
a request's stair (pipeline/serve.py) writes into, and :meth:`Writer.run`
runs the stair. What the bytes say is the endpoint's :class:`Renderer`
(sans-IO: events in, bytes out); when they go is the writer's:

- a streamed response's head goes out with its first output
  (:class:`~direct_frontend.pipeline.relay_events.Opened`), so a request
  that fails before producing anything still gets a proper HTTP error; each
  batch after it is written as it comes, every event already queued from
  the engine in one ``send`` (hypercorn's per-send cost dominates,
  docs/stack.md §5), and a failure after the head ends the stream with the
  renderer's error events;
- a full response is one body, written once the walk is over: its last
  choice finished and its engine calls closed (a call left early is
  aborted first).

From its admission on, the request runs beside a disconnect watch:
hypercorn drops sends to a gone client silently, so without it the engine
would keep generating; a request waiting for an engine ends at once when
its client leaves (status 499). Where the server tells the disconnect as
it happens (http/disconnect.py) the writer's own cancel scope is the
watch; elsewhere a task beside the request reads ``receive``
(:class:`ClientWatch`). The answers before any output (a refusal,
the rate limits' headers) are the writer's too.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from direct_frontend.http.asgi import (
    JSON,
    RESPONSE_DONE,
    Headers,
    Receive,
    Send,
    log,
    send_body,
    send_error,
)
from direct_frontend.http.disconnect import Disconnect
from direct_frontend.http.rate_limits import headers_of, over_limit
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import OpenAIHTTPError, internal_error
from direct_frontend.openai.parsers.base import ParsedDelta
from direct_frontend.pipeline.ratelimit import RateLimited
from direct_frontend.pipeline.relay_events import Batch, Failed, Finished, Opened
from direct_frontend.pipeline.serve_events import (
    Admitted,
    Charged,
    Embedded,
    Placed,
    Prepared,
    Resolved,
    StairEvent,
)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def parsed(batch: Batch) -> ParsedDelta:
    """A batch's parsed delta; its text as content when the request has no parser."""
    delta = batch.parsed
    return ParsedDelta(content=batch.text) if delta is None else delta


class Renderer:
    """An endpoint's output shape (sans-IO): the bytes each event of a choice becomes.

    A streamed renderer's bytes are written as they come; a full one's
    :meth:`opened` and :meth:`batch` keep what they need and give ``b""``, and
    its :meth:`finished` gives the whole body once the last choice is done.
    """

    __slots__ = ()

    streamed = False

    def opened(self, event: Opened, index: int) -> bytes:
        """Choice ``index``'s first output is here (a stream's head has just gone out)."""
        return b""

    def batch(self, event: Batch, index: int) -> bytes:
        return b""

    async def finished(self, event: Finished, index: int) -> tuple[bytes, bool]:
        """Choice ``index`` is complete: its last bytes, and whether they end the response
        (a full response's: the body)."""
        raise NotImplementedError

    def failed(self, error: OpenAIHTTPError) -> bytes:
        """The response gave up: how a started stream ends (its error events)."""
        return b""

    def embedded(self, event: Embedded) -> bytes:
        """An embeddings response's body."""
        raise NotImplementedError


#: an endpoint's renderer for a request, made once the request holds its slots
#: (``Prepared``: the request as its model serves it; None for embeddings)
Render = Callable[[Prepared | None], Renderer]
_T = TypeVar("_T")


def _no_renderer(prepared: Prepared | None) -> Renderer:
    raise AssertionError("the writer renders nothing before it runs")


class Writer:
    """One request's writer (the stair's sink); see the module's text."""

    __slots__ = ("_disconnect", "_nursery", "_receive", "_scope", "_send", "anthropic", "ended",
                 "ends", "failed", "headers", "metrics", "model", "out", "prepared", "render",
                 "renderer", "started", "streamed")

    def __init__(self, send: Send, receive: Receive, headers: Headers, metrics: Metrics, *,
                 anthropic: bool = False, disconnect: Disconnect | None = None) -> None:
        self._send = send
        self._receive = receive
        self.headers = headers  # every answer's (the rate limits' join them when known)
        self.metrics = metrics
        self.render: Render = _no_renderer
        self.anthropic = anthropic  # refusals and rate-limit headers in Anthropic's shape
        self.model: Resolved | None = None  # the request's model, once known
        self.prepared: Prepared | None = None
        self.renderer: Renderer = Renderer()
        self.streamed = False
        self.started = False  # the head is out
        self.ended = False  # the last byte is out
        self.failed: OpenAIHTTPError | None = None
        self.out = bytearray()  # what is rendered and not yet sent
        self.ends: list[tuple[Finished, int]] = []  # a full response's finished choices
        #: the server's disconnect, if it tells one (else a ClientWatch task reads receive)
        self._disconnect = disconnect
        self._nursery: trio.Nursery | None = None  # the ClientWatch task's
        self._scope: trio.CancelScope | None = None  # the walk's, cancelled if the client leaves

    async def __call__(self, event: StairEvent, index: int = 0) -> None:
        if type(event) is Batch:  # the one event per batch of tokens: told first
            data = self.renderer.batch(event, index)
            if self.streamed:
                body = self._taken(data)
                if body:
                    await self._send({"type": "http.response.body", "body": body,
                                      "more_body": True})
            return
        step = _STEPS.get(type(event))
        if step is not None:  # an event that writes nothing: a plain call, by its type
            step(self, event)
        elif type(event) is Finished:  # its write may wait on the client: no frame more
            if self.streamed:
                await self._last(*await self.renderer.finished(event, index))
            else:  # a body is written once the walk is over (its engine calls closed)
                self.ends.append((event, index))
        else:
            await self._output(event, index)

    async def _output(self, event: StairEvent, index: int) -> None:
        """A choice's first output (a stream's head goes with it), or an embeddings
        response's vectors."""
        if type(event) is Opened:
            data = self.renderer.opened(event, index)
            if self.streamed:
                if not self.started:
                    await self._send({"type": "http.response.start", "status": 200,
                                      "headers": [*SSE_HEADERS, *self.headers]})
                    self.started = True
                self.out += data
        elif type(event) is Embedded:
            await self._last(self.renderer.embedded(event), True)

    # -- the stair's events that write nothing (those before the output, and a failure,
    # answered at the end), told apart by their exact type (the events are final structs)

    def _resolved(self, event: Resolved) -> None:
        self.model = event

    def _prepared(self, event: Prepared) -> None:
        self.prepared = event

    def _charged(self, event: Charged) -> None:
        if event.standing is not None:
            self.headers += headers_of(event.standing, anthropic=self.anthropic,
                                       wall_now=time.time())

    def _admitted(self, event: Admitted) -> None:
        self.renderer = renderer = self.render(self.prepared)
        self.streamed = renderer.streamed
        assert self._disconnect is not None and self._scope is not None
        self._disconnect.watch(self._scope)
        if self._nursery is not None:  # no server tells the disconnect: read it
            self._nursery.start_soon(ClientWatch().run, self._receive, self._disconnect.fire)

    def _placed(self, event: Placed) -> None:
        pass

    def _failed(self, event: Failed) -> None:
        self.failed = event.error

    def _taken(self, data: bytes) -> bytes:
        """What is rendered and not yet sent, with ``data`` after it, taken to be sent (as
        it is, when nothing waited before it)."""
        out = self.out
        if not out:
            return data
        out += data
        body = bytes(out)
        out.clear()
        return body

    async def _last(self, data: bytes, last: bool) -> None:
        if self.streamed:
            body = self._taken(data)
            if body or last:
                await self._send({"type": "http.response.body", "body": body,
                                  "more_body": not last})
                self.ended = last
        elif last:
            await send_body(self._send, 200, data, JSON, self.headers)
            self.started = self.ended = True

    async def run(self, render: Render,
                  walk: Callable[[Writer], Awaitable[_T]]) -> tuple[int, _T | None]:
        """Run ``walk`` (the request's stair, with this writer) to its end, its output
        rendered by ``render``'s renderer; the HTTP status, and what ``walk`` returned.

        A refusal is answered as an HTTP error before the head, as the
        renderer's error events after it; an unexpected error before the head
        is raised (the app answers it with a 500 and logs it), after it logged
        here and ended as a failure. 499: the client left.
        """
        disconnect = self._disconnect
        if disconnect is None:  # the server does not tell it: a task beside reads receive
            return await self._beside_watch(render, walk)
        self.render = render
        status = 200
        result: _T | None = None
        bug: Exception | None = None
        with trio.CancelScope() as self._scope:  # cancelled when the client leaves
            try:
                result = await walk(self)
            except OpenAIHTTPError as err:
                self.failed = err
            except RateLimited as limited:
                self.failed = over_limit(limited.refusal, anthropic=self.anthropic,
                                         wall_now=time.time())
            except Exception as exc:
                if not self.started:
                    bug = exc
                else:
                    log.exception("unexpected error while streaming")
                    self.failed = internal_error()
                    status = 500
            if bug is None and (self.failed is not None or self.ends):  # else nothing to end
                status = await self._end(status)
        if disconnect.left():
            self.metrics.request_cancelled()
            return 499, None
        if bug is not None:
            raise bug
        return status, result

    async def _beside_watch(self, render: Render,
                            walk: Callable[[Writer], Awaitable[_T]]) -> tuple[int, _T | None]:
        """:meth:`run` beside a :class:`ClientWatch` task that reads ``receive`` (started at
        the admission); its unexpected error raised as it is, after the task."""
        self._disconnect = Disconnect()
        ran: tuple[int, _T | None] = (500, None)
        bug: Exception | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                ran = await self.run(render, walk)
            except Exception as exc:
                bug = exc
            nursery.cancel_scope.cancel()
        if bug is not None:
            raise bug
        return ran

    async def refuse(self, err: OpenAIHTTPError) -> int:
        """Answer a refusal met before the stair (the body, its parse): its HTTP error."""
        await send_error(self._send, err, self.headers)
        return err.status

    async def _end(self, status: int) -> int:
        """Answer a failure, if the response has one: an HTTP error before the head, its
        error events after it."""
        err = self.failed
        if err is None:
            for end, index in self.ends:
                await self._last(*await self.renderer.finished(end, index))
            return status
        tail = self.renderer.failed(err)
        if not self.started:
            await send_error(self._send, err, self.headers)
            return err.status
        if not self.ended:
            self.out += tail
            await self._send({"type": "http.response.body", "body": bytes(self.out),
                              "more_body": False})
            self.ended = True
        return status


#: the writer's step for each event that writes nothing, by the event's exact type
_STEPS: dict[type, Callable[[Writer, Any], None]] = {
    Resolved: Writer._resolved, Prepared: Writer._prepared, Charged: Writer._charged,
    Admitted: Writer._admitted, Placed: Writer._placed, Failed: Writer._failed,
}


class ClientWatch:
    """Whether a response's client left: :meth:`run` beside the response calls ``left``
    when it does (``gone``), and ends quietly once the response is complete."""

    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False

    async def run(self, receive: Receive, left: Callable[[], None]) -> None:
        while (kind := (await receive())["type"]) != "http.disconnect":
            if kind == RESPONSE_DONE:
                return  # nothing left to watch: ending here is cheaper than being cancelled
        self.gone = True
        left()

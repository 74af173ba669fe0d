"""OpenTelemetry spans of each request, exported over OTLP/HTTP when the fleet file asks.

Off by default, and then free: the pipeline holds ``None`` where a
:class:`RequestTrace` would be and tests for it (an attribute check, no call,
no context manager, no allocation), and the ``opentelemetry`` packages (the
optional ``direct-frontend[tracing]`` extra) are not even imported.

When on, one request is one tree: the request's span (a child of the client's
W3C ``traceparent``, if it sent one) with children for admission (the queue
wait), preprocess (template and tokenize), route (the placement) and each
engine leg; a first-token event, and a ``retry`` or ``migration`` event when an
attempt moves to another engine. Every leg sends its own span's
``traceparent`` (and ``tracestate``) to the engine as gRPC metadata. Spans are
started with explicit parents, never through the ambient context, so Trio
tasks and the asyncio side cannot mix them up. Export runs on the SDK's
batch thread, off the event loop.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from direct_frontend.errors import EngineError
from direct_frontend.observability.redact import SecretFilter, url_secrets

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: the W3C trace-context headers, as HTTP headers and as gRPC metadata keys
TRACE_HEADERS = (b"traceparent", b"tracestate")
#: what to install when the fleet file configures tracing without the packages
EXTRA_HINT = "pip install 'direct-frontend[tracing]'"
_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def available() -> bool:
    """Whether the tracing extra is installed (looked up, not imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in _MODULES)
    except ModuleNotFoundError:  # a parent package is missing
        return False


class Tracing:
    """The daemon's tracer and its OTLP/HTTP exporter; one per daemon, built at start.

    Its provider is its own (not the process-global one), so two daemons in
    one process (the tests) never share spans.
    """

    def __init__(self, endpoint: str, service_name: str, sample_ratio: float) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        # the exporter's errors may quote the endpoint's path and query (an ?api_key=): every
        # log handler takes the endpoint's credentials out, until shutdown
        self._secret_filter = SecretFilter(url_secrets(endpoint))
        self._filtered = list(logging.getLogger().handlers)
        for handler in self._filtered:
            handler.addFilter(self._secret_filter)
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer: Tracer = self._provider.get_tracer("direct_frontend")
        self._propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()

    def begin(
        self, route: str, headers: Iterable[tuple[bytes, bytes]], request_id: str
    ) -> RequestTrace:
        """The span of one HTTP request to ``route``, a child of its ``traceparent`` if any."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers if name in TRACE_HEADERS
        }
        parent = self._propagator.extract(carrier) if carrier else None
        return RequestTrace(self._tracer, self._propagator, route, parent, request_id)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop (blocking: run it in a thread)."""
        self._provider.shutdown()
        for handler in self._filtered:
            handler.removeFilter(self._secret_filter)


class LegSpan:
    """One engine leg's span and the metadata its Generate call carries."""

    __slots__ = ("metadata", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.metadata: dict[str, str] = {}  # traceparent, tracestate

    def end(self, error: EngineError | None) -> None:
        """The leg is over; ``error``: why it failed, if it did."""
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", error.kind.value)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()


class RequestTrace:
    """One request's spans. Steps run one after another: one is open at a time."""

    __slots__ = ("_propagator", "_root_context", "_step", "_tracer", "root")

    def __init__(
        self,
        tracer: Tracer,
        propagator: TraceContextTextMapPropagator,
        route: str,
        parent: Context | None,
        request_id: str,
    ) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracer = tracer
        self._propagator = propagator
        self.root: Span = tracer.start_span(
            f"POST {route}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route,
                        "request.id": request_id},
        )
        self._root_context = set_span_in_context(self.root)
        self._step: Span | None = None

    def enter(self, step: str) -> None:
        """A step of the request begins (``admission``, ``preprocess``, ``route``)."""
        self._end_step()
        self._step = self._tracer.start_span(step, context=self._root_context)

    def leave(self, **attributes: str | int | bool) -> None:
        """The open step ends, with what it found out."""
        step = self._step
        if step is not None:
            step.set_attributes(attributes)
        self._end_step()

    def _end_step(self) -> None:
        if self._step is not None:
            self._step.end()
            self._step = None

    def routed(self, policy: str, engine: str, predicted: int | None, spilled: bool) -> None:
        """The route step ends at ``engine`` (no prediction is left out: OTLP has no null)."""
        attributes: dict[str, str | int | bool] = {
            "route.policy": policy, "route.engine": engine, "route.spilled": spilled,
        }
        if predicted is not None:
            attributes["route.predicted_cached_tokens"] = predicted
        self.leave(**attributes)

    def model(self, name: str) -> None:
        self.root.set_attribute("gen_ai.request.model", name)

    def leg(
        self, engine: str, kind: str, role: str, request_id: str, prompt_tokens: int,
        disaggregated: bool,
    ) -> LegSpan:
        """An engine leg's span, with the gRPC metadata that carries it to the engine."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self._tracer.start_span(
            "engine leg", context=self._root_context, kind=SpanKind.CLIENT,
            attributes={"engine.name": engine, "engine.kind": kind, "engine.role": role,
                        "engine.request_id": request_id, "leg.prompt_tokens": prompt_tokens,
                        "leg.disaggregated": disaggregated},
        )
        leg = LegSpan(span)
        self._propagator.inject(leg.metadata, context=set_span_in_context(span))
        return leg

    def first_token(self) -> None:
        self.root.add_event("first token")

    def moved(self, outcome: str, error: EngineError, from_engine: str, to_engine: str,
              tokens: int) -> None:
        """An attempt failed and the request goes on: ``outcome`` is retried or migrated."""
        event = "migration" if outcome == "migrated" else "retry"
        self.root.add_event(event, {"from_engine": from_engine, "to_engine": to_engine,
                                    "tokens_so_far": tokens, "reason": str(error)})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.root.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                                  "gen_ai.usage.output_tokens": completion_tokens})

    def end(self, status: int) -> None:
        """The response is out with ``status``: close whatever is still open."""
        from opentelemetry.trace import Status, StatusCode

        self._end_step()
        self.root.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.root.set_status(Status(StatusCode.ERROR))
        self.root.end()


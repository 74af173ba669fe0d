"""Embeddings: each input one ``Embed`` call on an embedding model's engine, retried elsewhere.

An embedding model's engines (``EngineInfo.generates`` false: a vLLM started
with ``--runner pooling``, an SGLang with ``--is-embedding``) serve ``Embed``
and not ``Generate``; generation requests never reach them
(:mod:`~direct_frontend.pipeline.capable`) and embeddings reach nothing else.
An input is placed by the model's routing policy like any request, and its
call counts in the engine's load. A call that fails where another engine
may succeed (the engine is down, overloaded, leaving) is retried on another
one under the same ``[frontend.faults]`` bounds as a generation request
before its first token; an input the engine refuses is the client's 400.
The inputs of one request run side by side, and the first to fail for good
ends the request (the others are cancelled).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Dialect
from direct_frontend.engines.neutral import EmbedCall, Embedding
from direct_frontend.engines.transport import EngineChannel
from direct_frontend.errors import EngineError
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    context_length_exceeded,
    from_engine_error,
    invalid_request,
    no_engine_available,
)
from direct_frontend.pipeline.engine_wait import EngineWait, all_saturated, timed_out
from direct_frontend.pipeline.failover import Decision, FailoverState
from direct_frontend.pipeline.leg import FaultSink, engine_failure
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import Placement, RequestView


def embedders(catalog: Catalog) -> set[str]:
    """The serving engines an embedding may go to: embedding models of a kind that embeds."""
    return {e.name for e in catalog.engines
            if e.name in catalog.embedders and dialect_for(e.kind).capabilities.embeddings}


def not_embedding(model: str) -> OpenAIHTTPError:
    """The 400 for an embeddings request to a model whose engines only generate."""
    return invalid_request(
        f"The model '{model}' does not serve embeddings: its engines are generation models "
        "(an embedding model is served by engines started as one, e.g. vLLM --runner pooling "
        "or SGLang --is-embedding).", "model",
    )


async def embed_all(
    relay: Relay, settings: Settings, model: str, request_id: str,
    inputs: Sequence[tuple[str, Sequence[int]]], routing_key: str | None = None,
    at_once: int | None = None, trace: RequestTrace | None = None,
) -> list[Embedding]:
    """Embed every ``(text, token ids)`` input, in order; raises the first one's HTTP error.

    At most ``at_once`` inputs are on the engines at a time (the admission slots
    the request holds; None: all of them).
    """
    results: list[Embedding | None] = [None] * len(inputs)
    failure: list[OpenAIHTTPError] = []
    turns = trio.Semaphore(at_once or len(inputs))
    several = len(inputs) > 1

    async def one(index: int, scope: trio.CancelScope) -> None:
        text, ids = inputs[index]
        call = EmbedCall(f"{request_id}-{index}" if several else request_id, ids, text)
        param = f"input[{index}]" if several else "input"
        try:
            async with turns:
                results[index] = await embed_one(relay, settings, model, call, routing_key,
                                                 param, trace)
        except OpenAIHTTPError as err:
            if not failure:
                failure.append(err)
                scope.cancel()

    async with trio.open_nursery() as nursery:
        for index in range(len(inputs)):
            nursery.start_soon(one, index, nursery.cancel_scope)
    if failure:
        raise failure[0]
    return [r for r in results if r is not None]


async def embed_one(
    relay: Relay, settings: Settings, model: str, call: EmbedCall, routing_key: str | None,
    param: str = "input", trace: RequestTrace | None = None,
) -> Embedding:
    """One input on one engine after another, until one embeds it or the bounds say stop.

    ``param`` names the input in a 400 (``input[k]`` in a batch); with a ``trace``
    each call is an ``engine leg`` span, carried to the engine as its metadata.
    """
    frontend = settings.frontend
    fleet = relay.dispatcher.fleet
    now = trio.current_time()
    deadline = now + frontend.request_timeout_s
    wait = EngineWait(frontend.faults.wait_for_engine_s, deadline)
    failover = FailoverState(settings.failover)
    request = RequestView(call.input_ids, 1, routing_key)

    def place(now: float) -> Placement | None:
        catalog = fleet.catalog
        usable = embedders(catalog)
        if catalog.engines and not catalog.embedders:
            raise not_embedding(model)
        exclude = {e.name for e in catalog.engines if e.name not in usable}
        placement = settings.policy.choose(catalog, request, exclude | failover.excluded(catalog))
        if placement is None:
            if wait.may_wait(now):
                return None
            raise no_engine_available(model)
        wait.placed()
        return placement

    with trio.move_on_at(deadline) as timer:
        while True:
            placement = place(trio.current_time())
            if placement is None:
                placement = await relay.wait_for_engine(wait, place)
            try:
                return await _call(fleet, placement, call, param, deadline - trio.current_time(),
                                   trace)
            except EngineError as error:
                relay.metrics.engine_error(placement.engine.name, error.kind)
                if failover.decide(error, 0, placement.engine) is not Decision.RETRY:
                    if failover.all_overloaded:
                        raise all_saturated() from None
                    raise from_engine_error(error) from None
            await trio.sleep(failover.backoff())
    assert timer.cancelled_caught
    raise timed_out(settings)


async def _call(
    faults: FaultSink, placement: Placement, call: EmbedCall, param: str, deadline_s: float,
    trace: RequestTrace | None,
) -> Embedding:
    """The Embed call at ``placement``, counted in the engine's load while it runs."""
    engine: EngineHandle = placement.engine
    limit = engine.context_length
    if limit is not None and len(call.input_ids) > limit:
        raise context_length_exceeded(len(call.input_ids), limit, param)
    channel: EngineChannel = engine.transport
    dialect: Dialect = channel.dialect
    prompt = len(call.input_ids)
    span = None if trace is None else trace.leg(
        engine.name, engine.kind, engine.role.value, call.request_id, prompt, False)
    failure: EngineError | None = None
    engine.load.begin(prompt, placement.blocks)
    try:
        reply = await channel.unary(dialect.embed(call), max(deadline_s, 0.001),
                                    None if span is None else span.metadata)
        return dialect.embedding(reply)
    except EngineError as error:
        failure = engine_failure(faults, engine, error)
        if failure is error:
            raise
        raise failure from None
    finally:
        engine.load.end(prompt, placement.blocks)
        if placement.prefilled is not None:
            placement.prefilled()
        if span is not None:
            span.end(failure)

"""One request's stair, in one place: model, defaults, prompt, limits, slot, engines, output.

The HTTP shell reads and parses a request, then hands it here once
(:meth:`Stair.serve`) with its writer (a
:class:`~direct_frontend.pipeline.serve_events.Sink`); everything after
is the stair's, in this order:

1. resolve the model the request names (a 404 if none is served by it);
2. fill in the model's sampling defaults; from here on the request runs
   under the model's settings snapshot (its policy, queue and limits), as
   the tenant its body names if ``[frontend.tenants] field`` says one does,
   at the service tier that tenant may have;
3. find its routing key (``[frontend.routing] session_key``);
4. prepare its prompts (template, tokenize; a Responses chat with
   ``truncation: "auto"`` loses its oldest turns until it fits);
5. take it from its tenant's rate limits (a 429 when it is over them);
6. hold its admission slots (one per choice), so a request that waited in
   the queue is placed on the fleet as it is when it leaves the queue;
7. place it and relay it, across engines, one relay per choice
   (:mod:`~direct_frontend.pipeline.relay`,
   :mod:`~direct_frontend.pipeline.choices`); the output is parsed there;
8. settle: the usage, what the routing policy learns, and what its output
   owes its tenant's tokens limit (whatever its end).

Its writer hears each step that concerns it as a typed event
(:mod:`~direct_frontend.pipeline.serve_events`, then the relay's). A
background request stops after step 5 and gets the rest of its stair back
(:class:`Later`), which its runner starts beside the client with a writer
of its own; it holds a background slot (pipeline/admission.py). An
embeddings request takes a shorter stair (:meth:`Stair.embed`). The
shell's other requests of a model (token counts, ``/tokenize``) come here
too, so the HTTP shell reaches the pipeline only through this module.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence

import msgspec
import trio

from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import invalid_request, model_not_found
from direct_frontend.openai.types import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Tier,
    TokenizeRequest,
    served_tier,
)
from direct_frontend.pipeline.admission import Rejected, saturated
from direct_frontend.pipeline.choices import Choices
from direct_frontend.pipeline.embed import embed_all
from direct_frontend.pipeline.models import ModelTable, ServedModel
from direct_frontend.pipeline.preempt import Hold
from direct_frontend.pipeline.preprocess import (
    Kind,
    PreparedRequest,
    chat_prompt_ids,
    prepare_each,
    prompt_ids,
    refuse_beyond_every_engine,
    truncated_to_fit,
)
from direct_frontend.pipeline.ratelimit import (
    Charge,
    RateLimited,
    RateLimiter,
    Standing,
    take,
)
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.relay_events import RelayEvent
from direct_frontend.pipeline.serve_events import (
    ADMITTED,
    Charged,
    Embedded,
    Placed,
    Prepared,
    Resolved,
    Sink,
)
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.tenancy import named_in_body
from direct_frontend.routing.affinity import routing_key

_INPUT_IDS = operator.attrgetter("input_ids")


class Ask(msgspec.Struct, frozen=True):
    """A parsed generation request, as the HTTP shell hands it to the stair (a struct: one
    is made per request, and a frozen dataclass's fields are set one call at a time)."""

    request: ChatRequest | CompletionRequest
    kind: Kind  # its prompt: a chat's messages, or a completion's prompt
    models: ModelTable  # the models served when it arrived
    request_id: str
    #: whose share of the admission queue (and whose rate limits) it takes, unless its body
    #: names another (``[frontend.tenants] field``)
    tenant: str
    headers: Iterable[tuple[bytes, bytes]] = ()  # the request's (a session header is a key)
    trace: RequestTrace | None = None
    truncate: bool = False  # a Responses chat's ``truncation: "auto"``
    background: bool = False  # a Responses ``background: true``: it stops after its charge


@dataclasses.dataclass(frozen=True, slots=True)
class EmbedAsk:
    """A parsed embeddings request, as the HTTP shell hands it to the stair."""

    request: EmbeddingRequest
    models: ModelTable
    request_id: str
    tenant: str
    headers: Iterable[tuple[bytes, bytes]] = ()
    trace: RequestTrace | None = None


class Later:
    """A background request's stair from its admission on: prepared and charged already.

    Its engine call is streamed whatever its client asked, so what it produced
    so far can be read while it runs.
    """

    __slots__ = ("_prepared", "_relay", "_settings", "_tenant")

    def __init__(self, relay: Relay, settings: Settings, prepared: PreparedRequest,
                 tenant: str) -> None:
        self._relay = relay
        self._settings = settings
        self._tenant = tenant
        request = msgspec.structs.replace(prepared.request, stream=True)
        self._prepared = dataclasses.replace(prepared, request=request)

    async def run(self, sink: Sink) -> None:
        """Hold a background slot, place it and relay it into ``sink``; settle whatever its
        end (a cancellation included). A refusal is raised (a 429 or the placement's)."""
        relay, settings, prepared = self._relay, self._settings, self._prepared
        try:
            try:
                async with settings.admission.background_slot(
                        self._tenant, served_tier(prepared.request)) as hold:
                    await sink(ADMITTED)
                    state = await relay.begin(settings, prepared)
                    state.preemptible(hold)
                    await sink(Placed(len(prepared.input_ids)))
                    ok = False
                    try:
                        failed = await relay.until_end(state, sink)
                        if failed is not None:
                            await sink(failed)
                        ok = failed is None
                    finally:
                        relay.settle(state, ok)
            except Rejected as rejected:
                raise saturated(rejected) from None
        finally:
            if prepared.charge is not None:  # its tenant's tokens limit takes its output
                prepared.charge.settle(trio.current_time())


class Stair:
    """The requests' stair (one per daemon process): the rate limits they are charged
    against and the metrics they count in; every request brings its model table."""

    def __init__(self, limiter: RateLimiter, metrics: Metrics) -> None:
        self.limiter = limiter
        self.metrics = metrics

    async def serve(self, ask: Ask, sink: Sink) -> Later | None:
        """Walk a generation request from its model to its settlement; ``sink`` hears each
        step. A background request comes back after its charge: the rest of its stair.

        Refusals are raised: ``OpenAIHTTPError`` (404, 400, 429 queue full, 503)
        and :class:`RateLimited`; a client that leaves cancels it.
        """
        served = _model(ask.models, ask.request.model)
        await sink(Resolved(served.name, served.series))
        request = served.prepare_request(ask.request)  # the model's sampling defaults
        settings = served.settings  # the model's policy, queue and limits from here on
        tenant = named_in_body(settings.frontend.tenants, ask.tenant, request.user,
                               request.safety_identifier)
        # the tier it is served at (what its response reports): its tenant's to have
        request = _at_tier(request, settings.admission.tier(tenant, request.service_tier))
        trace = ask.trace
        if trace is not None:
            trace.model(request.model)
            trace.enter("preprocess")
        key = routing_key(settings.frontend.routing.session_key, ask.headers, request.user,
                          request.prompt_cache_key)
        prompts = await prepare_each(ask.kind, request, ask.request_id, served.tokenizing, key)
        if ask.truncate and (limit := served.context_length) is not None:
            first = prompts[0]
            prompts = (await truncated_to_fit(first, served.tokenizing, limit,
                                              first.request.max_tokens or 1),)
        counts = tuple(map(len, map(_INPUT_IDS, prompts)))  # in C: no generator per request
        refuse_beyond_every_engine(counts, served.catalog, ask.kind)
        if trace is not None:
            trace.leave(prompt_tokens=sum(counts))
        await sink(Prepared(prompts[0].request, ask.request_id, counts,
                            served.relay.text_model.token_bytes))
        # over its tenant's rate limit: refused here, before it queues or reaches an engine
        charge, standing = self._charge(settings, tenant, sum(counts))
        try:
            if charge is not None:  # the relay counts each choice's output into it
                prompts = tuple(dataclasses.replace(p, charge=charge) for p in prompts)
            await sink(Charged(standing))
            if ask.background:
                return self._later(served, settings, prompts[0], tenant)
            if trace is not None:
                trace.enter("admission")
            try:
                async with settings.admission.slot(request.n * len(prompts), tenant,
                                                   served_tier(request)) as hold:
                    if trace is not None:
                        trace.leave()
                    await sink(ADMITTED)
                    await _relay(served.relay, settings, prompts, trace, sink, hold)
            except Rejected as rejected:
                raise saturated(rejected) from None
            return None
        finally:
            if charge is not None and not ask.background:  # what it generated, whatever its end
                charge.settle(trio.current_time())

    def _charge(self, settings: Settings, tenant: str,
                prompt_tokens: int) -> tuple[Charge | None, Standing | None]:
        """Take a request of ``tenant`` from its rate limits (pipeline/ratelimit.py)."""
        try:
            return take(self.limiter, settings.frontend.tenants, tenant, prompt_tokens,
                        trio.current_time())
        except RateLimited as limited:
            self.metrics.rate_limited(limited.label, limited.refusal.kind)
            raise

    @staticmethod
    def _later(served: ServedModel, settings: Settings, prepared: PreparedRequest,
               tenant: str) -> Later:
        """The rest of a background request's stair; a 429 now if the queue is full (its
        client hears it now rather than a failure after the fact)."""
        try:
            settings.admission.refuse_if_full(1, tenant, served_tier(prepared.request))
        except Rejected as rejected:
            raise saturated(rejected) from None
        return Later(served.relay, settings, prepared, tenant)

    async def embed(self, ask: EmbedAsk, sink: Sink) -> None:
        """Walk an embeddings request: tokenize each input, charge, hold a slot per input,
        embed them on the model's engines; ``sink`` hears each step and the vectors."""
        request = ask.request
        trace = ask.trace
        if trace is not None:
            trace.model(request.model)
        served = _model(ask.models, request.model)
        await sink(Resolved(served.name, served.series))
        settings = served.settings
        tenant = named_in_body(settings.frontend.tenants, ask.tenant, request.user)
        key = routing_key(settings.frontend.routing.session_key, ask.headers, request.user)
        several = len(request.inputs) > 1
        if trace is not None:
            trace.enter("preprocess")
        inputs = [
            await prompt_ids(one, f"input[{k}]" if several else "input", served.tokenizing,
                             cached=False)
            for k, one in enumerate(request.inputs)
        ]
        tokens = sum(len(ids) for _, ids in inputs)
        if trace is not None:
            trace.leave(prompt_tokens=tokens)
        _, standing = self._charge(settings, tenant, tokens)  # nothing to settle after
        await sink(Charged(standing))
        if trace is not None:
            trace.enter("admission")
        # at the tier its ``service_tier`` gets (a batch line's ``flex``; else ``default``)
        tier = settings.admission.tier(tenant, request.service_tier)
        try:
            async with settings.admission.slot(len(inputs), tenant, tier):
                if trace is not None:
                    trace.leave()
                await sink(ADMITTED)
                embeddings = await embed_all(
                    served.relay, settings, request.model, ask.request_id, inputs, key,
                    at_once=min(len(inputs), settings.admission.config.max_in_flight),
                    trace=trace,
                )
        except Rejected as rejected:
            raise saturated(rejected) from None
        size = len(embeddings[0].vector)
        if request.dimensions is not None and request.dimensions != size:
            raise invalid_request(
                f"This model's embeddings have {size} dimensions, and its engines do not "
                f"shorten them: 'dimensions' may only be {size}.", "dimensions",
            )
        prompt_tokens = sum(e.prompt_tokens or len(ids)
                            for e, (_, ids) in zip(embeddings, inputs, strict=True))
        if trace is not None:
            trace.usage(prompt_tokens, 0)
        await sink(Embedded([e.vector for e in embeddings], prompt_tokens))

    # -- a model's tokenizer, with no engine ---------------------------------------------

    @staticmethod
    async def prompt_tokens(models: ModelTable, chat: ChatRequest) -> int:
        """The tokens of the prompt ``chat`` would send its model (no engine asked)."""
        served = _model(models, chat.model)
        prepared = served.prepare_request(chat)
        assert isinstance(prepared, ChatRequest)
        _, ids = await chat_prompt_ids(prepared, served.tokenizing)
        return len(ids)

    @staticmethod
    async def tokenize(models: ModelTable, request: TokenizeRequest) -> Tokens:
        """The prompt's token ids, as a generation request would count them."""
        served = _model(models, request.model)
        tokenizing = served.tokenizing
        if request.chat is not None:
            _, ids = await chat_prompt_ids(
                request.chat, tokenizing, add_generation_prompt=request.add_generation_prompt,
                add_special_tokens=request.add_special_tokens,
            )
        else:
            assert request.prompt is not None
            ids = tuple(await tokenizing.encode(request.prompt, "prompt",
                                                add_special_tokens=request.add_special_tokens))
        text_model = tokenizing.text_model
        strings = [text_model.id_to_token(i) for i in ids] if request.return_token_strs else None
        return Tokens(tuple(ids), served.context_length, strings)

    @staticmethod
    def detokenize(models: ModelTable, request: DetokenizeRequest) -> str:
        """The text of the token ids, special tokens included (as vLLM's server decodes)."""
        text_model = _model(models, request.model).tokenizing.text_model
        vocab = text_model.vocab_size
        for k, token in enumerate(request.tokens):
            if token >= vocab:
                raise invalid_request(f"token ids must be in [0, {vocab}), got {token}",
                                      f"tokens[{k}]")
        return text_model.decode(request.tokens, skip_special_tokens=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt's token ids, the model's context length, and each id's string if asked."""

    ids: tuple[int, ...]
    context_length: int | None
    strings: list[str | None] | None = None


def _at_tier(request: ChatRequest | CompletionRequest,
             tier: Tier) -> ChatRequest | CompletionRequest:
    """``request`` served at ``tier`` (copied only when that changes it)."""
    if tier == request.service_tier:
        return request
    return msgspec.structs.replace(request, service_tier=tier)


def _model(models: ModelTable, name: str) -> ServedModel:
    served = models.get(name)
    if served is None:
        raise model_not_found(name)
    return served


async def _relay(relay: Relay, settings: Settings, prompts: Sequence[PreparedRequest],
                 trace: RequestTrace | None, sink: Sink, hold: Hold) -> None:
    """Place the request's choices, relay them into ``sink`` and settle them (not when
    cancelled: the client left, and its output is no one's). One choice may be preempted
    while it runs (``hold``: its admission slot)."""
    prepared = prompts[0]
    if prepared.request.n == 1 and len(prompts) == 1:
        state = await relay.begin(settings, prepared, trace)
        state.preemptible(hold)
        await sink(Placed(len(prepared.input_ids)))
        failed = await relay.until_end(state, sink)
        if failed is not None:
            await sink(failed)
        relay.settle(state, failed is None)
        return
    choices = await Choices.begin(relay, settings, prompts, trace)
    await sink(Placed(sum(len(p.input_ids) for p in prompts)))
    writing = trio.Lock()  # one choice's write at a time; a failing choice waits for it

    async def emit(index: int, event: RelayEvent) -> None:
        async with writing:
            await sink(event, index)

    await choices.run(relay, emit, writing)
    choices.settle(relay, choices.failed is None)

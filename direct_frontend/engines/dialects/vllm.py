"""vLLM's SMG contract (``vllm.grpc.engine.VllmEngine``).

Quirks handled here (docs/engine-contracts.md §5): the response oneof numbers
chunk/complete 1/2 and carries no ``request_id`` (the generated class knows
the numbers; nothing here may reuse another kind's messages); ``temperature``
is optional and unset means 1.0, and ``max_tokens`` unset means "up to
max_model_len", so both are always sent; chunk ``completion_tokens`` is this
chunk's own count, summed here; in streaming mode the terminal ``complete``
repeats the last delta with ``completion_tokens`` = its length, so neither
its tokens nor its count are added again, while in non-streaming mode it is
the only message and holds every token. ``finish_reason`` may be "abort" or
"error" (engine-side failures). ``max_context_length`` is ``max_model_len``,
the real window.

A leg of a prefill/decode pair carries ``kv_transfer_params_json`` (request
field 8, a JSON object passed verbatim); a prefill leg's handoff comes back
in the complete's field 12 and is surfaced on :class:`Finished` (§9.2). The
prefill leg runs first, with ``max_tokens = 1`` and ``{"do_remote_decode":
true, "do_remote_prefill": false}``. NIXL (and any connector but Mooncake)
returns handoff parameters in its terminal message, relayed verbatim to the
decode leg; Mooncake instead pairs the legs by a router-minted
``transfer_id``, and the decode leg names the prefill engine. Pairs form
per connector, and a Mooncake engine with data-parallel ranks cannot be a
named prefill engine.

Every constraint kind has its own member of the ``constraint`` oneof
(``choice`` a ``ChoiceConstraint``, ``json_object`` a bool; "tools or the
response format" is a ``structural_tag`` in xgrammar's format, which the
engine's xgrammar backend compiles, as it does the older
``structures``/``triggers`` form); ``logit_bias``
is a map keyed by token id. ``seed`` is an int32 here while OpenAI allows
int64: a seed outside int32 is folded to its low 32 bits (two's complement),
so a given seed still always reproduces the same output. Stop strings are
applied by the frontend, as for every kind, so ``stop`` is never sent (it
would also switch on the servicer's detokenizer for nothing).

Logprobs: ``logprobs``/``prompt_logprobs`` ask one more than the client's
top count (:func:`logprob_count`). Chunks carry their delta's logprobs, the
streaming ``complete`` repeats the last delta's (never appended), a
non-streaming one holds all; prompt logprobs come with the first chunk.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from direct_frontend.engines.dialects.base import (
    Capabilities,
    DiscoverySources,
    LegPlan,
    PairingFacts,
    Rpc,
    Source,
    bootstrap_address,
)
from direct_frontend.engines.dialects.ids import fill_prompt
from direct_frontend.engines.dialects.smg import (
    SmgDialect,
    SmgStreamDecoder,
    smg_sampling,
)
from direct_frontend.engines.neutral import (
    Constraint,
    ConstraintKind,
    Disaggregation,
    EngineInfo,
    EngineRole,
    GenerateCall,
    SamplingOptions,
)
from direct_frontend.protos import common_pb2 as common_pb
from direct_frontend.protos import vllm_engine_pb2 as pb

if TYPE_CHECKING:
    from direct_frontend.multimodal.payload import MediaPayload
    from direct_frontend.multimodal.processors import Tensor

SERVICE = "/vllm.grpc.engine.VllmEngine"
ROLES = {
    "kv_producer": EngineRole.PREFILL,
    "kv_consumer": EngineRole.DECODE,
    "kv_both": EngineRole.BOTH,
    "": EngineRole.BOTH,
}


MOONCAKE = "MooncakeConnector"
NIXL = "NixlConnector"


def _json(value: dict[str, object]) -> str:
    return json.dumps(value, separators=(",", ":"))


#: what a prefill leg asks of its engine: compute the KV, keep it for a remote decode
PREFILL_PARAMS = _json({"do_remote_decode": True, "do_remote_prefill": False})


def kv_connector(info: EngineInfo) -> str:
    """An engine's KV connector as discovery reported it (NIXL when unreported)."""
    return dict(info.details).get("kv_connector") or NIXL


def prefill_leg(call: GenerateCall, params_json: str = PREFILL_PARAMS) -> GenerateCall:
    """The prefill leg: one token (discarded), the KV kept for the decode engine.

    Its token is never output, so it carries no constraint (the decode leg's
    grammar starts at the first token the client sees), and no grammar is
    compiled on the prefill engine for nothing.
    """
    sampling = dataclasses.replace(call.sampling, max_tokens=1, min_tokens=0, constraint=None)
    return dataclasses.replace(
        call, sampling=sampling, stream=False,
        disaggregation=Disaggregation(kv_transfer_params_json=params_json),
    )


def mooncake_legs(call: GenerateCall, prefill: PairingFacts, transfer_id: str) -> LegPlan:
    """Both legs name the router's ``transfer_id``; the decode leg names the prefill engine."""
    host, port = bootstrap_address(prefill)
    host = f"[{host}]" if ":" in host else host
    prefill_params = _json(
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    )
    decode_params = _json({
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": dict(prefill.info.details).get("kv_engine_id", ""),
        "remote_bootstrap_addr": f"http://{host}:{port}",
    })
    return LegPlan(
        prefill_call=prefill_leg(call, prefill_params),
        decode_call=dataclasses.replace(
            call, disaggregation=Disaggregation(kv_transfer_params_json=decode_params)
        ),
        parallel=False,
        relays_kv_params=False,
    )


def constraint_field(constraint: Constraint) -> tuple[str, object]:
    """The ``constraint`` oneof member and value a neutral constraint is sent as."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return "json_object", True
    if kind is ConstraintKind.CHOICE:
        return "choice", {"choices": constraint.choices}
    if kind is ConstraintKind.TOOLS_OR_FORMAT:  # the engine compiles either tag format
        return "structural_tag", constraint.text
    return kind.value, constraint.text  # json_schema, regex, grammar, structural_tag


def int32_seed(seed: int) -> int:
    """Fold any integer seed into int32 deterministically (identity within range)."""
    low = seed & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


#: the engine's default ``--max-logprobs``: a request asking more is refused
MAX_LOGPROBS = 20


def logprob_count(top: int) -> int:
    """What to ask for ``top`` alternatives per position.

    The servicer sends a position's first n entries, and vLLM lists the
    sampled token first, then the ranked ones: asking one more always covers
    the true top ``top`` (sorted and trimmed on decoding), within the engine's
    cap.
    """
    return min(top + 1, MAX_LOGPROBS) if top > 0 else 0


class VllmStreamDecoder(SmgStreamDecoder):
    """Decoder for one vLLM Generate stream (chunk counts are per-chunk deltas)."""

    counts_per_chunk: ClassVar[bool] = True

    def _final_count(self, done: Any, extra: tuple[int, ...]) -> int:
        if self._stream:  # output_ids and completion_tokens describe the last delta only
            return self._completion + len(extra)
        count: int = max(done.completion_tokens, len(extra))
        return count

    def _handoff(self, done: Any) -> str | None:
        return done.kv_transfer_params_json if done.HasField("kv_transfer_params_json") else None


class VllmDialect(SmgDialect):
    kind: ClassVar[str] = "vllm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_decode=True, optional=frozenset({"seed", "logit_bias"}),
        embeddings=True, dp_rank_pin=True, images=True,
    )
    service: ClassVar[str] = SERVICE
    pb: ClassVar[ModuleType] = pb
    decoder: ClassVar[type[SmgStreamDecoder]] = VllmStreamDecoder

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock, to turn the reported uptime into a start time

    def build(self, call: GenerateCall) -> Rpc:
        s = call.sampling
        params = smg_sampling(
            s,
            top_k=s.top_k,  # a uint32 here; 0 = disabled
            max_tokens=s.max_tokens,  # unset would mean up to max_model_len
            min_tokens=s.min_tokens,
        )
        _rarer_params(s, params)
        media = call.media
        refs = None if media is None else _media_refs(media)
        request = pb.GenerateRequest(
            request_id=call.request_id, sampling_params=params, stream=call.stream,
        )
        runs = None
        if refs is None or media is None:
            runs = fill_prompt(request.tokenized, "input_ids", call.original_text, call.input_ids)
        else:
            request.tokenized.original_text = call.original_text
            request.tokenized.input_ids.extend(media.anchor_ids(call.input_ids))
        if call.dp_rank is not None:
            request.data_parallel_rank = call.dp_rank
        pd = call.disaggregation
        if pd is not None and pd.kv_transfer_params_json is not None:
            request.kv_transfer_params_json = pd.kv_transfer_params_json  # verbatim (§9.2)
        if media is not None:
            _attach_media(request, media, refs)
        return Rpc(f"{SERVICE}/Generate", request, pb.GenerateResponse, runs=runs)

    def media_ref_schemes(self, info: EngineInfo) -> frozenset[str] | None:
        """A servicer with a media processor (``GetServerInfo.mm_processor`` not empty)
        takes ``media_refs`` of the schemes it lists (``mm_media_ref_schemes``)."""
        details = dict(info.details)
        if not details.get("mm_processor"):
            return None
        schemes = details.get("mm_media_ref_schemes", "")
        return frozenset(s.strip().lower() for s in schemes.split(",") if s.strip())

    def takes_raw_pixels(self, info: EngineInfo) -> bool:
        """vLLM normalises on device where its model class supports it (on by default in
        0.32, ``GetServerInfo.mm_device_do_normalize``): the model then takes raw 8-bit
        pixels, and normalised ones would be normalised twice."""
        return dict(info.details).get("mm_device_do_normalize") == "true"

    def abort(self, request_id: str, reason: str = "") -> Rpc:
        # The contract takes a list and no reason; the reply is empty (errors are statuses).
        return Rpc(f"{SERVICE}/Abort", pb.AbortRequest(request_ids=[request_id]), pb.AbortResponse)

    def discovery(self) -> Sequence[Rpc]:
        """Model and server info, and GetLoads: the one call here that states the KV cache size."""
        return (*super().discovery(), self.get_loads())

    discovers: ClassVar[DiscoverySources] = DiscoverySources(
        model=Source("GetModelInfo.served_model_name"),
        context_length=Source("GetModelInfo.max_context_length = max_model_len"),
        block_size=Source("GetServerInfo.block_size (0 until resolved)"),
        kv_capacity=Source(
            "GetLoads max_total_num_tokens / the ranks listed (each entry has their sum)"
        ),
        data_parallel=Source(
            "GetServerInfo.data_parallel_size, GetLoads' first rank",
            "KV-aware routing pins requests to ranks (one kv_events endpoint per rank, or "
            "dp_ranks)",
        ),
        serves=Source("GetModelInfo.is_generation (false: --runner pooling, /v1/embeddings only)"),
        role=Source("GetServerInfo.kv_role"),
        # the stock servicer reports uptime 0
        restarts=Source(
            "GetServerInfo.uptime_seconds when above 0, the KV-event publisher starting over; "
            "with neither, a new connection after an outage"
        ),
    )

    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        model, server, loads = responses
        # Only the uptime is reported: the start it implies is stable across calls to
        # within the call latency, so whole seconds name one incarnation. A stock
        # servicer (0.14.1) leaves uptime at 0: then the restart is unknowable here and
        # the incarnation is empty (the KV-event publisher or the connection tells it,
        # control/restarts.py).
        if server.uptime_seconds > 0:
            started = self._clock() - server.uptime_seconds
            incarnation = datetime.fromtimestamp(round(started), UTC).isoformat()
        else:
            started, incarnation = None, ""
        return EngineInfo(
            served_model_name=model.served_model_name,
            model_path=model.model_path,
            generates=model.is_generation,  # False: started with --runner pooling
            context_length=model.max_context_length or None,  # max_model_len: the window
            max_input_length=model.max_req_input_len or None,
            eos_token_ids=tuple(model.eos_token_ids),
            block_size=server.block_size or None,  # 0 until the engine resolved it
            role=ROLES.get(server.kv_role),
            data_parallel_size=server.data_parallel_size or 1,
            first_dp_rank=first_rank(loads),
            incarnation=incarnation,
            started_at=started,
            kv_capacity_tokens=kv_capacity(loads),
            details=(
                ("kv_role", server.kv_role),
                ("kv_connector", server.kv_connector),
                ("kv_engine_id", server.kv_engine_id),
                ("kv_cache_dtype", server.kv_cache_dtype),
                ("model_dtype", server.model_dtype),
                ("server_type", server.server_type),
                ("mm_processor", server.mm_processor),
                ("mm_media_ref_schemes", server.mm_media_ref_schemes),
                ("mm_device_do_normalize", "true" if server.mm_device_do_normalize else "false"),
            ),
        )

    def pairing_group(self, engine: PairingFacts) -> str | None:
        """By KV connector too: a NIXL prefill cannot hand its KV to a Mooncake decode."""
        return f"vllm/{kv_connector(engine.info)}"

    def can_prefill(self, engine: PairingFacts) -> bool:
        # Mooncake names the prefill engine by id, which gets a _dp<rank> suffix with DP > 1;
        # we do not pin ranks, so such an engine cannot be named reliably.
        return not (kv_connector(engine.info) == MOONCAKE and engine.info.data_parallel_size > 1)

    def pair_legs(self, call: GenerateCall, prefill: PairingFacts, rng: random.Random) -> LegPlan:
        """The prefill leg first; then NIXL (and any connector but Mooncake) relays the
        handoff the prefill leg returns, while Mooncake pairs by a minted transfer id."""
        if kv_connector(prefill.info) == MOONCAKE:
            return mooncake_legs(call, prefill, f"{rng.getrandbits(128):032x}")
        return LegPlan(prefill_leg(call), call, parallel=False, relays_kv_params=True)


def _rarer_params(s: SamplingOptions, params: dict[str, Any]) -> None:
    """Add the sampling fields most requests leave unset to ``params``."""
    if s.seed is not None:
        params["seed"] = int32_seed(s.seed)
    if s.logprobs is not None:
        params["logprobs"] = logprob_count(s.logprobs)
    if s.prompt_logprobs is not None:
        params["prompt_logprobs"] = logprob_count(s.prompt_logprobs)
    if s.logit_bias:
        params["logit_bias"] = dict(s.logit_bias)
    if s.constraint is not None:
        field, value = constraint_field(s.constraint)
        params[field] = value


def _media_refs(media: MediaPayload) -> tuple[str, ...] | None:
    """The images as URLs, for a servicer that fetches and processes them itself (None: it
    takes preprocessed tensors)."""
    return None if media.ref_schemes is None else media.references(media.ref_schemes)


def _attach_media(request: Any, media: MediaPayload, refs: tuple[str, ...] | None) -> None:
    """A request's images: as ``media_refs`` (``refs``), else as preprocessed tensors."""
    if refs is not None:
        for url in refs:
            request.media_refs.items.add(modality=common_pb.IMAGE, url=url)
    else:
        mm_inputs(request.mm_inputs, media)


def _tensor(message: Any, tensor: Tensor) -> None:
    message.shape.extend(tensor.shape)
    message.dtype = tensor.dtype
    message.inline = tensor.data


def mm_inputs(message: Any, media: MediaPayload) -> None:
    """A request's images as the servicer's ``MultimodalInputs`` (smg-grpc-servicer 0.14.1).

    The servicer builds vLLM's multimodal input from it without running the
    model's processor: ``pixel_values`` (raw 8-bit pixels for an engine that
    normalises on device, else normalised float32) and the model-specific tensors become
    the model's keyword arguments, sliced per image as ``batched_keys`` and
    ``flat_keys`` say; ``mm_placeholders`` are the images' runs in the prompt
    (already expanded); ``mm_hashes`` their identities, which key the encoder
    cache and the KV blocks the runs fill.
    """
    batch = media.batch
    message.modality = common_pb.IMAGE
    _tensor(message.pixel_values, media.pixel_values)
    for name, tensor in batch.tensors:
        _tensor(message.model_specific_tensors[name], tensor)
    message.im_token_id = media.image_token_id
    for offset, length in media.placeholders:
        message.mm_placeholders.add(offset=offset, length=length)
    message.mm_hashes.extend(media.hashes)
    message.batched_keys.extend(batch.batched_keys)
    for name, sizes in batch.flat_keys:
        message.flat_keys[name] = sizes
    message.keep_on_cpu_keys.extend(batch.keep_on_cpu_keys)


def first_rank(loads: Any) -> int | None:
    """The lowest data-parallel rank a GetLoads reply lists (None: no reply, or none listed).

    The stock servicer lists the ranks it serves, its first always: under
    multi-node data parallelism one servicer serves one node's ranks, from
    its start rank on, and a request pinned to another rank is refused.
    """
    ranks = [load.dp_rank for load in (loads.loads if loads is not None else ())]
    return min(ranks, default=None)


def kv_capacity(loads: Any) -> int | None:
    """One rank's KV cache in tokens from a GetLoads reply (None: not reported).

    Each data-parallel rank has a cache of its own, and routing weighs each on
    its own; but the stock servicer (0.14.1 on vLLM 0.32) reports in every
    rank's entry the engine client's ``num_gpu_blocks``, which is the sum over
    the ranks it serves (a real DP=2 engine: 32,768 in each entry, 16,384 per
    rank). So the figure is divided by the ranks listed.
    """
    entries = list(loads.loads) if loads is not None else []
    sizes = [load.max_total_num_tokens for load in entries if load.max_total_num_tokens > 0]
    return min(sizes) // len(entries) if sizes else None

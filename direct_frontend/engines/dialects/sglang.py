"""SGLang's SMG contract (``sglang.grpc.scheduler.SglangScheduler``).

Quirks handled here (docs/engine-contracts.md §4): the prompt must be token ids;
``temperature`` and ``max_new_tokens`` are always sent (an unset cap means no
cap at all); chunk counts are cumulative; in streaming mode the terminal
``complete`` repeats the last delta, so its ``output_ids`` are never appended;
``max_context_length`` is the KV pool size, not the model window, so it is not
used as the context length; an engine-side abort ends the stream with status
INTERNAL "Request aborted", classified like the other kinds' in-band aborts.

A leg of a prefill/decode pair carries ``DisaggregatedParams`` (request
field 10: the prefill engine's bootstrap host and port, and a random room in
``[0, 2^31 - 1)``), the same on both legs, which run in parallel; the client
is served from the decode leg (§9.1).

A request's ``seed`` cannot be sent: ``SamplingParams`` has no seed field.
SGLang's engine has one (``sampling_seed``, used by its deterministic
sampling), but its gRPC servicer builds the engine's sampling parameters
from the contract's fields only, and ``custom_params`` feed a custom logit
processor, not the sampler. So the capability is missing: a seeded request
goes to another kind, or is refused with a 400 naming ``seed``, instead of
being sampled unseeded behind the client's back.

Structured outputs go in the ``constraint`` oneof (regex, json_schema,
ebnf_grammar, structural_tag: a client's tag, and "tools or the response
format" in xgrammar's format, which SGLang's xgrammar backend compiles
beside the older ``structures``/``triggers`` form); as SGLang's own server
does, ``json_object`` is the schema ``{"type":"object"}``, and a choice
becomes the regex of its alternatives. ``logit_bias`` is a map keyed by the
token id's decimal string. Stop strings are applied by the frontend, as for
every kind.

Logprobs: ``return_logprob`` with ``top_logprobs_num`` (one count for output
and prompt) and ``logprob_start_len`` -1 unless the prompt's are wanted (0, its
proto default, would score the whole prompt). Chunks carry each delta's own
logprobs (the servicer's "incremental"), the streaming ``complete`` repeats the
last delta's, a non-streaming one holds all; prompt logprobs come once, with
the first chunk that has them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from google.protobuf import json_format
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from direct_frontend.engines.dialects.base import (
    ANY_OBJECT_SCHEMA,
    Capabilities,
    DiscoverySources,
    LegPlan,
    LoraReply,
    PairingFacts,
    Rpc,
    Source,
    bootstrap_address,
    choice_regex,
    classify_exception,
    engine_aborted,
)
from direct_frontend.engines.dialects.ids import fill_prompt
from direct_frontend.engines.dialects.smg import (
    SmgDialect,
    SmgStreamDecoder,
    smg_sampling,
)
from direct_frontend.engines.neutral import (
    INT32_MAX,
    Constraint,
    ConstraintKind,
    Disaggregation,
    EngineInfo,
    EngineRole,
    GenerateCall,
)
from direct_frontend.errors import EngineError
from direct_frontend.protos import sglang_scheduler_pb2 as pb

if TYPE_CHECKING:
    from direct_frontend.multimodal.payload import MediaPayload

SERVICE = "/sglang.grpc.scheduler.SglangScheduler"
ROLES = {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE, "null": EngineRole.BOTH}
ROOM_LIMIT = 2**31 - 1  # bootstrap_room is an int32: rooms are drawn from [0, ROOM_LIMIT)


def constraint_field(constraint: Constraint) -> tuple[str, str]:
    """The ``constraint`` oneof member and value a neutral constraint is sent as."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return "json_schema", constraint.text
    if kind is ConstraintKind.JSON_OBJECT:
        return "json_schema", ANY_OBJECT_SCHEMA
    if kind is ConstraintKind.REGEX:
        return "regex", constraint.text
    if kind is ConstraintKind.CHOICE:
        return "regex", choice_regex(constraint.choices)
    if kind is ConstraintKind.GRAMMAR:
        return "ebnf_grammar", constraint.text
    return "structural_tag", constraint.text  # a client's tag, or tools-or-format


class SglangStreamDecoder(SmgStreamDecoder):
    """Decoder for one SGLang Generate stream (chunk counts are cumulative)."""

    def _final_count(self, done: Any, extra: tuple[int, ...]) -> int:
        count: int = max(done.completion_tokens, self._delivered + len(extra))
        return count


class SglangDialect(SmgDialect):
    kind: ClassVar[str] = "sglang"
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_decode=True, bootstrap_server=True, optional=frozenset({"logit_bias"}),
        # The contract has data_parallel_rank (16), but the stock servicer (smg-grpc-servicer
        # 0.14.1) never passes it on to the scheduler: SGLang's DP controller places requests.
        lora_adapters=True, embeddings=True, images=True,
    )
    service: ClassVar[str] = SERVICE
    pb: ClassVar[ModuleType] = pb
    decoder: ClassVar[type[SmgStreamDecoder]] = SglangStreamDecoder

    def build(self, call: GenerateCall) -> Rpc:
        s = call.sampling
        params = smg_sampling(
            s,
            top_k=s.top_k if 0 < s.top_k <= INT32_MAX else -1,  # an int32; beyond: all tokens
            max_new_tokens=s.max_tokens,  # unset would mean no cap at all
            min_new_tokens=s.min_tokens,
        )
        if s.logit_bias:
            params["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
        if s.constraint is not None:
            field, value = constraint_field(s.constraint)
            params[field] = value
        # Sub-messages as dicts: protobuf builds them in place instead of copying.
        request = pb.GenerateRequest(
            request_id=call.request_id, sampling_params=params, stream=call.stream,
        )
        runs = fill_prompt(request.tokenized, "input_ids", call.original_text, call.input_ids)
        if s.logprobs is not None:  # logprobs: one top count serves output and prompt
            request.return_logprob = True
            request.top_logprobs_num = max(s.logprobs, s.prompt_logprobs or 0)
            # 0 would score the whole prompt: -1 is "no prompt logprobs"
            request.logprob_start_len = -1 if s.prompt_logprobs is None else 0
        if call.lora_id is not None:
            request.lora_id = call.lora_id
        pd = call.disaggregation
        if pd is not None and pd.bootstrap_room is not None:
            # The same rendezvous goes on both legs of a P/D pair (§9.1).
            request.disaggregated_params.bootstrap_host = pd.bootstrap_host
            request.disaggregated_params.bootstrap_port = pd.bootstrap_port
            request.disaggregated_params.bootstrap_room = pd.bootstrap_room
        if call.media is not None:
            mm_inputs(request.mm_inputs, call.media)
        return Rpc(f"{SERVICE}/Generate", request, pb.GenerateResponse, runs=runs)

    def abort(self, request_id: str, reason: str = "") -> Rpc:
        request = pb.AbortRequest(request_id=request_id, reason=reason or "client cancelled")
        return Rpc(f"{SERVICE}/Abort", request, pb.AbortResponse)

    def load_lora(self, lora_id: str, name: str, path: str) -> Rpc:
        request = pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path, lora_id=lora_id)
        return Rpc(f"{SERVICE}/LoadLoRAAdapter", request, pb.LoadLoRAAdapterResponse)

    def unload_lora(self, lora_id: str, name: str) -> Rpc:
        request = pb.UnloadLoRAAdapterRequest(lora_name=name, lora_id=lora_id)
        return Rpc(f"{SERVICE}/UnloadLoRAAdapter", request, pb.UnloadLoRAAdapterResponse)

    def list_loras(self) -> Rpc:
        request = pb.ListLoadedLoRAAdaptersRequest()
        return Rpc(f"{SERVICE}/ListLoadedLoRAAdapters", request,
                   pb.ListLoadedLoRAAdaptersResponse)

    def lora_reply(self, reply: Any) -> LoraReply:
        if isinstance(reply, pb.ListLoadedLoRAAdaptersResponse):
            return LoraReply(True, "", tuple(a.lora_id for a in reply.loaded_adapters))
        return LoraReply(bool(reply.success), reply.message, tuple(reply.loaded_lora_ids))

    discovers: ClassVar[DiscoverySources] = DiscoverySources(
        model=Source("GetModelInfo.served_model_name"),
        context_length=Source(
            "server_args.context_length, if set (max_context_length is the KV pool)",
            "set context_length",
        ),
        block_size=Source("server_args.page_size"),
        kv_capacity=Source("GetServerInfo.max_total_num_tokens"),
        data_parallel=Source(
            "GetServerInfo dp_size",
            "never pinned to a rank: its stock servicer drops data_parallel_rank",
        ),
        serves=Source("GetModelInfo.is_generation (false: --is-embedding, /v1/embeddings only)"),
        role=Source("server_args.disaggregation_mode"),
        restarts=Source("GetServerInfo.start_time"),
    )

    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        model, server = responses
        has_args = server.HasField("server_args")
        args = json_format.MessageToDict(server.server_args) if has_args else {}
        has_scheduler = server.HasField("scheduler_info")
        scheduler = json_format.MessageToDict(server.scheduler_info) if has_scheduler else {}
        role = ROLES.get(str(args.get("disaggregation_mode", "null")), EngineRole.BOTH)
        bootstrap = args.get("disaggregation_bootstrap_port")
        bootstrap_port = int(bootstrap) if isinstance(bootstrap, (int, float)) else 0
        window = args.get("context_length")
        page = args.get("page_size")
        started = server.HasField("start_time")
        incarnation = server.start_time.ToJsonString() if started else ""
        return EngineInfo(
            served_model_name=model.served_model_name,
            model_path=model.model_path,
            generates=model.is_generation,  # False: started with --is-embedding
            # max_context_length is the KV pool size; only server_args has the window.
            context_length=int(window) if isinstance(window, (int, float)) and window else None,
            max_input_length=model.max_req_input_len or None,
            eos_token_ids=tuple(model.eos_token_ids),
            block_size=int(page) if isinstance(page, (int, float)) and page else None,
            role=role,
            data_parallel_size=int(args.get("dp_size", 1) or 1),
            incarnation=incarnation,
            started_at=server.start_time.ToNanoseconds() / 1e9 if started else None,
            bootstrap_port=bootstrap_port or None,
            kv_capacity_tokens=server.max_total_num_tokens or _positive(scheduler.get(
                "max_total_num_tokens")),
            details=(
                ("kv_pool_tokens", str(model.max_context_length)),
                ("bootstrap_port", str(args.get("disaggregation_bootstrap_port", ""))),
                ("sglang_version", server.sglang_version),
            ),
        )

    def pair_legs(self, call: GenerateCall, prefill: PairingFacts, rng: random.Random) -> LegPlan:
        """Both legs carry one rendezvous and run at once; the prefill result is only drained."""
        host, port = bootstrap_address(prefill)
        rendezvous = Disaggregation(
            bootstrap_host=host, bootstrap_port=port, bootstrap_room=rng.randrange(ROOM_LIMIT)
        )
        return LegPlan(
            prefill_call=dataclasses.replace(call, stream=False, disaggregation=rendezvous),
            decode_call=dataclasses.replace(call, disaggregation=rendezvous),
            parallel=True,
            relays_kv_params=False,
        )

    def classify(self, exc: BaseException) -> EngineError:
        """SGLang reports an engine-side abort as INTERNAL; read it as the others' abort."""
        if (
            isinstance(exc, GRPCError)
            and exc.status is Status.INTERNAL
            and "abort" in (exc.message or "").lower()
        ):
            return engine_aborted()
        return classify_exception(exc)


def _positive(value: Any) -> int | None:
    """A Struct number as a positive int (None: absent, zero or not a number)."""
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def mm_inputs(message: Any, media: MediaPayload) -> None:
    """A request's images as SGLang's ``MultimodalInputs``: ``pixel_values`` and the
    model-specific tensors (``image_grid_thw``) preprocessed, the placeholder runs in the
    prompt's (expanded) ids, the image token. The contract has no field for the images'
    hashes; SGLang keys its radix cache by its own."""
    batch = media.batch
    message.modalities.append("image")
    pixels = batch.pixel_values
    message.pixel_values.data = pixels.data
    message.pixel_values.shape.extend(pixels.shape)
    message.pixel_values.dtype = pixels.dtype
    for name, tensor in batch.tensors:
        entry = message.model_specific_tensors[name]
        entry.data = tensor.data
        entry.shape.extend(tensor.shape)
        entry.dtype = tensor.dtype
    message.im_token_id = media.image_token_id
    for offset, length in media.placeholders:
        message.mm_placeholders.add(offset=offset, length=length)

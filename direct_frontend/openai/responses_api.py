"""``POST /v1/responses`` bodies, stateless: read into the chat request the pipeline runs.

The Responses API is what the OpenAI Agents SDK and coding agents speak by
default. Its input items map one to one onto chat messages (a
``function_call`` is an assistant message's tool call, a
``function_call_output`` a ``tool`` message, ``instructions`` a leading system
message), its function tools onto chat tools, so the request is translated
into a chat completions body and validated by the same code: one pipeline,
one set of parsers. Nothing is stored: ``store`` is accepted and ignored (a
response is never kept), and ``previous_response_id`` (which needs a stored
one) is a 400. Reasoning items sent back are dropped, as a stateless server
that does not encrypt reasoning must: the template renders the turns without them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import msgspec

from direct_frontend.openai.errors import invalid_request
from direct_frontend.openai.parse import MAX_JSON_DEPTH, nesting_depth_exceeds, parse_chat_request
from direct_frontend.openai.types import ChatRequest

_decoder: Final = msgspec.json.Decoder(dict[str, Any])
_encode: Final = msgspec.json.Encoder().encode

#: Responses fields with the same meaning (and name) in a chat completions body
_SAME: Final = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user",
                "top_logprobs", "seed", "stop", "top_k", "min_p", "repetition_penalty")
@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses body: the chat request it runs as, and what the Response echoes."""

    chat: ChatRequest
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    max_output_tokens: int | None


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Validate a Responses body; raises ``OpenAIHTTPError`` (400) naming the field."""
    if nesting_depth_exceeds(body):
        raise invalid_request(
            f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep."
        )
    try:
        raw = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_request(f"The request body is not a JSON object: {exc}.") from None
    if raw.get("previous_response_id") is not None:
        raise invalid_request(
            "previous_response_id needs a stored response, and this server stores none: send "
            "the whole conversation in 'input'.", "previous_response_id",
        )
    if "input" not in raw:
        raise invalid_request("Missing required parameter: 'input'.", "input")
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_request("Invalid type for 'instructions': expected a string.",
                              "instructions")
    chat: dict[str, Any] = {k: raw[k] for k in _SAME if k in raw}
    messages = ([{"role": "system", "content": instructions}] if instructions else [])
    messages += _messages(raw["input"])
    chat["messages"] = messages
    tools = raw.get("tools") or []
    chat["tools"] = [_tool(i, tool) for i, tool in enumerate(_list(tools, "tools"))]
    if "tool_choice" in raw:
        chat["tool_choice"] = raw["tool_choice"]
    if raw.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = raw["max_output_tokens"]
    reasoning = raw.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    text = raw.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        chat["response_format"] = _format(text["format"])
    if raw.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    request = parse_chat_request(_encode(chat))
    return ResponsesRequest(request, instructions, tools, raw.get("tool_choice", "auto"),
                            raw.get("max_output_tokens"))


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid_request(f"Invalid type for '{param}': expected an array.", param)
    return value


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise invalid_request(f"Tool type '{kind}' is not supported; only 'function' tools are.",
                              f"tools[{i}].type")
    if not isinstance(tool.get("name"), str):
        raise invalid_request(f"Missing required parameter: 'tools[{i}].name'.",
                              f"tools[{i}].name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as a chat ``response_format``."""
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or the text of its input/output text parts."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise invalid_request(
                f"Content part type '{kind}' is not supported; only text parts are.",
                f"{where}.content[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _messages(items: Any) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls share one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(_list(items, "input")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"Invalid type for '{where}': expected an object.", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid_request(f"Invalid value for '{where}.role': '{role}'.",
                                      f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise invalid_request(f"Missing required parameter: '{where}.{field}'.",
                                          f"{where}.{field}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (
                    last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid_request(f"Missing required parameter: '{where}.call_id'.",
                                      f"{where}.call_id")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str)
                             else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # stateless and unencrypted: earlier reasoning is not replayed
        else:
            raise invalid_request(f"Input item type '{kind}' is not supported.", f"{where}.type")
    if not messages:
        raise invalid_request("'input' holds no message.", "input")
    return messages

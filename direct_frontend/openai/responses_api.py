"""``POST /v1/responses`` bodies: read into the chat request the pipeline runs.

The Responses API is what the OpenAI Agents SDK and coding agents speak by
default. Its input items map one to one onto chat messages (a
``function_call`` is an assistant message's tool call, a
``function_call_output`` a ``tool`` message, ``instructions`` a leading system
message), its function tools onto chat tools, so the request is translated
into a chat completions body and validated by the same code: one pipeline,
one set of parsers. A request that continues a stored response
(``previous_response_id``) is read with that response's history in front of
its own input (openai/response_store.py; the HTTP shell looks it up), and
its own input items come back normalized, with ids, for the record it makes.
``instructions`` are never carried over, as the API says. A reasoning item
(sent back or stored) is its assistant turn's reasoning: the chat template
renders it where its model expects it (within a tool loop), or not at all.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any, Final

import msgspec

from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.errors import invalid_request
from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.openai.response_store import Lineage
from direct_frontend.openai.types import ChatRequest

_encode: Final = msgspec.json.Encoder().encode

#: Responses fields with the same meaning (and name) in a chat completions body
_SAME: Final = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user",
                "prompt_cache_key", "seed", "stop", "top_k", "min_p", "repetition_penalty",
                "service_tier", "safety_identifier")
#: the ``include`` value that asks for the output text's logprobs
LOGPROBS: Final = "message.output_text.logprobs"
@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses body: the chat request it runs as, and what the Response echoes."""

    chat: ChatRequest
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    max_output_tokens: int | None
    store: bool = True  # the client's word; the server may still keep nothing
    previous_response_id: str | None = None
    #: the continued response's history (stored JSON items, shared with its record)
    history: tuple[bytes, ...] = ()
    #: this request's own input items, normalized and with ids: what its record adds
    items: tuple[dict[str, Any], ...] = ()
    #: run beside the client (http/background.py): answered at once, polled, cancellable
    background: bool = False
    #: ``auto``: the oldest turns are dropped for the model when the input outgrows its context
    truncation: str = "disabled"
    #: the conversation it reads as history and appends its input and output to
    conversation: str | None = None
    #: the number the conversation's next item had when its history was read
    conversation_upto: int = 0

    def lineage(self) -> Lineage:
        """Where its history is stored already: what its record need not store again."""
        return Lineage(self.previous_response_id, self.conversation, self.conversation_upto,
                       len(self.history))


def previous_response_id(raw: dict[str, Any]) -> str | None:
    """The response a body continues, if it names one."""
    previous = raw.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid_request("Invalid type for 'previous_response_id': expected a string.",
                              "previous_response_id")
    return previous


def parse_responses_request(
    body: bytes | dict[str, Any],
    history: tuple[bytes, ...] = (),
    history_items: list[dict[str, Any]] | None = None,
    conversation: str | None = None,
) -> ResponsesRequest:
    """Validate a Responses body; raises ``OpenAIHTTPError`` (400) naming the field.

    ``history``: the stored items of the response the body continues (found by
    the caller), ``history_items`` the same decoded; ``conversation``: the
    conversation they are the items of (then the request adds to it).
    """
    raw = read_json_object(body) if isinstance(body, bytes) else body
    if "input" not in raw:
        raise invalid_request("Missing required parameter: 'input'.", "input")
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_request("Invalid type for 'instructions': expected a string.",
                              "instructions")
    store, background = _store_and_background(raw)
    truncation = raw.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise invalid_request(f"Invalid value for 'truncation': {truncation!r} ('auto' or "
                              "'disabled').", "truncation")
    chat: dict[str, Any] = {k: raw[k] for k in _SAME if k in raw}
    chat.update(_logprobs(raw))
    messages = ([{"role": "system", "content": instructions}] if instructions else [])
    earlier = history_items or []
    own = _input_list(raw["input"])
    messages += _messages(earlier + own, len(earlier),
                          "previous_response_id" if conversation is None else "conversation")
    chat["messages"] = messages
    tools = raw.get("tools") or []
    chat["tools"] = [_tool(i, tool) for i, tool in enumerate(_list(tools, "tools"))]
    chat.update(_generation(raw))
    request = parse_chat_request(_encode(chat))
    return ResponsesRequest(request, instructions, tools, raw.get("tool_choice", "auto"),
                            raw.get("max_output_tokens"), store, previous_response_id(raw),
                            history, tuple(normalized_item(item) for item in own), background,
                            truncation, conversation)


def _store_and_background(raw: dict[str, Any]) -> tuple[bool, bool]:
    """``store`` (default true) and ``background`` (default false); a background response
    must be stored."""
    store = raw.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise invalid_request("Invalid type for 'store': expected a boolean.", "store")
    background = raw.get("background") or False
    if not isinstance(background, bool):
        raise invalid_request("Invalid type for 'background': expected a boolean.", "background")
    if background and not store:
        raise invalid_request("A background response is kept to be polled: 'background' "
                              "needs 'store' true.", "background")
    return store, background


def _logprobs(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat fields asking for logprobs: ``top_logprobs``, or ``include`` naming them."""
    include = raw.get("include") or []
    if raw.get("top_logprobs") is None and not (isinstance(include, list) and LOGPROBS in include):
        return {}
    # the chat parser checks top_logprobs' range
    return {"logprobs": True, "top_logprobs": raw.get("top_logprobs") or 0}


def _generation(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of ``tool_choice``, ``max_output_tokens``, ``reasoning.effort``,
    ``text.format`` and ``stream``."""
    chat: dict[str, Any] = {}
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
    return chat


def _input_list(value: Any) -> list[Any]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return _list(value, "input")


#: the id prefix of an input item the client sent without one, by its type
_ID_PREFIX: Final = {"message": "msg", "function_call": "fc",
                     "function_call_output": "fco", "reasoning": "rs"}


def item_id(prefix: str) -> str:
    """A new item's id, as the API writes them (``msg_…``, ``fc_…``)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def normalized_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the API lists it (``input_items``): typed, with an id, content in parts."""
    kind = item.get("type", "message")
    out = {"type": kind, **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    if not isinstance(out.get("id"), str):
        out["id"] = item_id(_ID_PREFIX.get(kind, "item"))
    return out


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


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts
                           if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or the text of its input/output text parts."""
    text = _content_of(content, where, images=False)
    assert isinstance(text, str)
    return text


def _content_of(content: Any, where: str, images: bool = True) -> str | list[dict[str, Any]]:
    """A message's content as chat takes it: its text, or (with ``input_image`` parts,
    where ``images`` allows them) its text and image parts in order."""
    if isinstance(content, str):
        return content
    texts = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "input_image" and images:
            parts.append(_image(part, at))
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            only = "text and 'input_image' parts are" if images else "text parts are"
            raise invalid_request(
                f"Content part type '{kind}' is not supported; only {only}.", f"{at}.type",
            )
        texts.append(part["text"])
        if parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += part["text"]
        else:
            parts.append({"type": "text", "text": part["text"]})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(texts)


def _image(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An ``input_image`` part (``image_url``: a data or http(s) URL) as a chat part."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        what = "'file_id' images are not supported; send 'image_url'" if part.get(
            "file_id") is not None else "Missing required parameter"
        raise invalid_request(f"{what}: '{at}.image_url'.", f"{at}.image_url")
    image: dict[str, Any] = {"url": url}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image, "x_direct_frontend_param": at}


def check_items(items: list[Any], param: str) -> None:
    """400 naming ``param[i]`` unless every item is one a request's input may hold."""
    _messages(items, param=param, need_message=False)


def _messages(items: list[Any], earlier: int = 0, history: str = "previous_response_id",
              param: str = "input", need_message: bool = True) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls share one assistant turn.

    The first ``earlier`` items are a stored history (an error in one names
    ``history``), the rest the request's ``param``. A reasoning
    item's text goes with the assistant turn that follows it (the template
    decides whether to render it).
    """
    turns = _Turns()
    for i, item in enumerate(items):
        where = f"{param}[{i - earlier}]" if i >= earlier else history
        if not isinstance(item, dict):
            raise invalid_request(f"Invalid type for '{where}': expected an object.", where)
        kind = item.get("type", "message")
        read = _ITEMS.get(kind) if isinstance(kind, str) else None
        if read is None:
            raise invalid_request(f"Input item type '{kind}' is not supported.", f"{where}.type")
        read(turns, item, where)
    if not turns.messages and need_message:
        raise invalid_request(f"'{param}' holds no message.", param)
    return turns.messages


@dataclasses.dataclass(slots=True)
class _Turns:
    """The chat messages read so far, and a reasoning item's text waiting for its assistant
    turn."""

    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reasoning: str = ""

    def assistant(self, turn: dict[str, Any]) -> dict[str, Any]:
        """``turn``, an assistant's, with the waiting reasoning (which it takes)."""
        if self.reasoning:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + self.reasoning
            self.reasoning = ""
        return turn


def _message_item(turns: _Turns, item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid_request(f"Invalid value for '{where}.role': '{role}'.", f"{where}.role")
    turn = {"role": role, "content": _content_of(item.get("content"), where,
                                                 images=role == "user")}
    turns.messages.append(turns.assistant(turn) if role == "assistant" else turn)


def _function_call_item(turns: _Turns, item: dict[str, Any], where: str) -> None:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise invalid_request(f"Missing required parameter: '{where}.{field}'.",
                                  f"{where}.{field}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    messages = turns.messages
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and (
            last.get("tool_calls") or not last["content"]):
        turns.assistant(last).setdefault("tool_calls", []).append(call)
    else:
        messages.append(turns.assistant({"role": "assistant", "content": None,
                                         "tool_calls": [call]}))


def _function_call_output_item(turns: _Turns, item: dict[str, Any], where: str) -> None:
    if not isinstance(item.get("call_id"), str):
        raise invalid_request(f"Missing required parameter: '{where}.call_id'.",
                              f"{where}.call_id")
    output = item.get("output")
    turns.messages.append({"role": "tool", "tool_call_id": item["call_id"],
                           "content": output if isinstance(output, str)
                           else _text_of(output, where)})


def _reasoning_item(turns: _Turns, item: dict[str, Any], where: str) -> None:
    turns.reasoning += _reasoning_text(item)


#: an input item's type -> what it adds to the chat messages
_ITEMS: Final[dict[str, Callable[[_Turns, dict[str, Any], str], None]]] = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_call_output_item,
    "reasoning": _reasoning_item,
}

"""Anthropic's ``POST /v1/messages`` bodies, read into the chat request the pipeline runs.

Agents built on the Anthropic SDK (Claude Code among them) speak the
Messages API. Like the Responses API it maps onto chat completions one to
one: ``system`` is a leading system message, a ``tool_use`` block an
assistant's tool call, a ``tool_result`` block a ``tool`` message, tools'
``input_schema`` their ``parameters``, ``tool_choice`` ``any`` is
``required``. So the body becomes a chat body validated by the same code:
one pipeline, one set of parsers. A ``thinking`` block sent back is its
assistant turn's reasoning, for the chat template (nothing is signed here:
the signature is not checked).

Errors keep the chat parser's words and field names but go out in
Anthropic's shape (:func:`anthropic_error_body`): the SDK raises its typed
errors from ``error.type``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, Final

import msgspec

from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.openai.types import ChatRequest

_encode: Final = msgspec.json.Encoder().encode

#: Anthropic's error type for each HTTP status we answer with
_ERROR_TYPES: Final = {400: "invalid_request_error", 401: "authentication_error",
                       403: "permission_error", 404: "not_found_error",
                       413: "request_too_large", 429: "rate_limit_error",
                       503: "overloaded_error", 529: "overloaded_error"}


def parse_messages_request(body: bytes, *, counting: bool = False) -> ChatRequest:
    """A Messages body as the chat request it runs as; a 400 naming the field if it is bad.

    ``counting``: a ``count_tokens`` body, which has no ``max_tokens``.
    """
    raw = read_json_object(body)
    if "messages" not in raw:
        raise invalid_request("messages: Field required", "messages")
    if not counting and raw.get("max_tokens") is None:
        raise invalid_request("max_tokens: Field required", "max_tokens")
    chat: dict[str, Any] = {k: raw[k] for k in ("model", "temperature", "top_p", "top_k",
                                                "max_tokens", "stream") if k in raw}
    chat.update(_sampling(raw))
    messages = _system(raw.get("system"))
    for i, message in enumerate(_list(raw["messages"], "messages")):
        messages += _turn(i, message)
    if not messages:
        raise invalid_request("messages: at least one message is required", "messages")
    chat["messages"] = messages
    chat.update(_tools(raw))
    chat.update(_thinking(raw.get("thinking")))
    if raw.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    if counting:
        chat.setdefault("max_tokens", 1)
    return parse_chat_request(_encode(chat))


def _sampling(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of ``stop_sequences`` and ``metadata.user_id``."""
    chat: dict[str, Any] = {}
    stops = raw.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_request("stop_sequences: expected a list of strings", "stop_sequences")
    if stops:
        chat["stop"] = stops
    metadata = raw.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    return chat


def _tools(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of ``tools`` and ``tool_choice``."""
    tools = raw.get("tools") or []
    chat: dict[str, Any] = {"tools": [_tool(i, tool) for i, tool in
                                      enumerate(_list(tools, "tools"))]}
    if raw.get("tool_choice") is not None:
        choice, parallel = _tool_choice(raw["tool_choice"])
        chat["tool_choice"] = choice
        if not parallel:
            chat["parallel_tool_calls"] = False
    return chat


def _thinking(thinking: Any) -> dict[str, Any]:
    """The chat fields of ``thinking`` (enabled or disabled, and its budget)."""
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        return {}
    on = thinking["type"] == "enabled"  # under the names thinking templates read it by
    chat: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": on, "thinking": on}}
    budget = thinking.get("budget_tokens")
    if on and budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise invalid_request("thinking.budget_tokens: Input should be a positive "
                                  "integer", "thinking.budget_tokens")
        chat["thinking_token_budget"] = budget
    return chat


def anthropic_error_body(err: OpenAIHTTPError) -> bytes:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else
                            "invalid_request_error")
    message = err.message
    if err.code == "invalid_image" and err.param:  # the shape has no param: name the block
        message = f"{err.param}: {message}"
    return _encode({"type": "error", "error": {"type": kind, "message": message}})


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid_request(f"{param}: Input should be a valid list", param)
    return value


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": _texts(system, "system")}]


def _texts(blocks: Any, where: str) -> str:
    """The text of a list of text blocks (``cache_control`` and ``citations`` are ignored)."""
    texts = []
    for j, block in enumerate(_list(blocks, where)):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid_request(f"{where}.{j}: content block type '{kind}' is not supported "
                                  "here; only text blocks are", f"{where}.{j}.type")
        texts.append(block["text"])
    return "".join(texts)


def _turn(i: int, message: Any) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: a user turn's tool results become ``tool`` messages."""
    where = f"messages.{i}"
    if not isinstance(message, dict):
        raise invalid_request(f"{where}: Input should be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise invalid_request(f"{where}.role: Input should be 'user' or 'assistant'",
                              f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    turn = _Turn(role)
    for j, block in enumerate(_list(content, f"{where}.content")):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        read = _BLOCKS.get((kind, role)) if isinstance(kind, str) else None
        if read is None or not read(turn, block, at):
            raise invalid_request(f"{at}: content block type '{kind}' is not supported in a "
                                  f"{role} message", f"{at}.type")
    return turn.messages()


@dataclasses.dataclass(slots=True)
class _Turn:
    """What one turn's content blocks add up to, read in order."""

    role: str
    texts: list[str] = dataclasses.field(default_factory=list)
    #: a user turn's texts and images, when it has images
    parts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    thoughts: list[str] = dataclasses.field(default_factory=list)
    #: a user turn's tool results, as ``tool`` messages
    out: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages of the turn."""
        if self.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts) or None}
            if self.calls:
                turn["tool_calls"] = self.calls
            if self.thoughts:
                turn["reasoning_content"] = "".join(self.thoughts)
            return [turn]
        if any(part["type"] == "image_url" for part in self.parts):
            self.out.append({"role": "user", "content": self.parts})
        elif self.texts:  # results answer the calls before them; the user's words follow
            self.out.append({"role": "user", "content": "".join(self.texts)})
        return self.out


def _text_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    text = block.get("text")
    if not isinstance(text, str):
        return False
    turn.texts.append(text)
    if turn.parts and turn.parts[-1]["type"] == "text":
        turn.parts[-1]["text"] += text
    else:
        turn.parts.append({"type": "text", "text": text})
    return True


def _image_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    turn.parts.append(_image(block, at))
    return True


def _thinking_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    if isinstance(block.get("thinking"), str):
        turn.thoughts.append(block["thinking"])
    return True


def _redacted_thinking_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    return True  # encrypted by another server: nothing here can read it


def _tool_use_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    for field in ("id", "name"):
        if not isinstance(block.get(field), str):
            raise invalid_request(f"{at}.{field}: Field required", f"{at}.{field}")
    turn.calls.append({"id": block["id"], "type": "function", "function": {
        "name": block["name"], "arguments": json.dumps(block.get("input") or {},
                                                       ensure_ascii=False)}})
    return True


def _tool_result_block(turn: _Turn, block: dict[str, Any], at: str) -> bool:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid_request(f"{at}.tool_use_id: Field required", f"{at}.tool_use_id")
    result = block.get("content", "")
    text = result if isinstance(result, str) else _texts(result, f"{at}.content")
    turn.out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    return True


#: (block type, role) -> what the block adds to its turn; False: a block of that type that
#: is not one (a text block without text)
_BLOCKS: Final[dict[tuple[str, str], Callable[[_Turn, dict[str, Any], str], bool]]] = {
    ("text", "user"): _text_block,
    ("text", "assistant"): _text_block,
    ("image", "user"): _image_block,
    ("thinking", "assistant"): _thinking_block,
    ("redacted_thinking", "assistant"): _redacted_thinking_block,
    ("tool_use", "assistant"): _tool_use_block,
    ("tool_result", "user"): _tool_result_block,
}


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block (base64 or URL source) as a chat ``image_url`` part naming ``at``."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise invalid_request(f"{at}.source: a base64 image needs 'media_type' and 'data'",
                                  f"{at}.source")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise invalid_request(f"{at}.source.type: an image source is 'base64' (media_type, "
                              "data) or 'url' (url)", f"{at}.source.type")
    return {"type": "image_url", "image_url": {"url": url}, "x_direct_frontend_param": at}


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """An Anthropic client tool as a chat tool."""
    where = f"tools.{i}"
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise invalid_request(f"{where}.name: Field required", f"{where}.name")
    if tool.get("type") not in (None, "custom"):
        raise invalid_request(f"{where}: tool type '{tool['type']}' is not supported; only "
                              "client tools (name, input_schema) are", f"{where}.type")
    function: dict[str, Any] = {"name": tool["name"],
                                "parameters": tool.get("input_schema") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """``tool_choice`` as chat's, and whether several calls may be made at once."""
    if not isinstance(choice, dict):
        raise invalid_request("tool_choice: Input should be an object", "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise invalid_request(f"tool_choice.type: '{kind}' is not one of 'auto', 'any', 'tool', "
                          "'none' (a 'tool' choice names it)", "tool_choice.type")

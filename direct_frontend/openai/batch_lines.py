"""A batch's lines: its input read and checked, the order they run in, and their results in
OpenAI's output-file lines (sans-IO).

Input: one request a line, ``{"custom_id", "method": "POST", "url", "body"}``,
every ``url`` the batch's endpoint, every ``body`` for one model, each
``custom_id`` once. What is wrong is reported as OpenAI reports it in a
failed batch's ``errors`` (``invalid_json_line``, ``duplicate_custom_id``,
``url_mismatch``, ``model_mismatch``, ``empty_file``, ``too_many_tasks``, and
``invalid_request`` naming the field), each with its line number.

Order: lines whose prompts begin alike run one after another, so the
engine that computed a prefix's KV cache for the first is the one the
KV-aware policy places the next on, while it is still cached. Sorting the
lines by the text their prompts begin with (the model's tools and messages,
or prompt, or input, as JSON) puts every group of lines sharing a prefix
side by side, longest shared prefixes closest (a sorted list is a trie's
walk); ties keep the file's order.

Every line's body runs at the ``flex`` service tier (its own ``service_tier``
is replaced): a batch takes the capacity interactive requests leave.

Output: ``{"id": "batch_req_…", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}``: the output file holds the lines
answered 200, the error file the others (an HTTP error's body is the
endpoint's error object), and a line that never ran (the batch was
cancelled or expired first) has ``response: null`` and ``error: {"code",
"message"}``.
"""

from __future__ import annotations

import secrets
from typing import Any, Final, Literal, NamedTuple

import msgspec

from direct_frontend.openai.batches import BatchError
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request

#: the errors a failed batch lists at most (the first ones in the file)
MAX_ERRORS: Final = 100
#: the characters of a prompt's beginning the order compares
KEY_CHARS: Final = 2048
#: ``/v1/embeddings`` batches: at most this many inputs over all lines (OpenAI's limit)
MAX_EMBEDDING_INPUTS: Final = 50_000
TIER: Final = "flex"
#: answers after which a line is asked again later: the server had no room for it then
RETRY_STATUSES: Final = frozenset({429, 503})
#: why a line that never ran did not: the code and message of its error line
UNRUN: Final = {
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was "
                  "cancelled."),
    "expired": ("batch_expired", "This request could not be executed before the completion "
                "window expired."),
    "failed": ("batch_failed", "This request was not executed because the batch failed."),
}

_encode: Final = msgspec.json.Encoder().encode
Outcome = Literal["completed", "failed", "retry"]


class Line(msgspec.Struct, frozen=True):
    """One request of a batch: its place in the run order, its line in the file (from 1),
    its ``custom_id``, and the body it is sent with."""

    ord: int
    line: int
    custom_id: str
    body: bytes


class BatchInput(msgspec.Struct, frozen=True):
    """A batch's input, checked: its lines in run order, and the model they ask for."""

    lines: tuple[Line, ...]
    model: str | None


class _Wrong(NamedTuple):
    """What is wrong with one line: a batch error's code, message and field."""

    code: str
    message: str
    param: str | None = None


def read_input(data: bytes, endpoint: str, max_lines: int) -> BatchInput | list[BatchError]:
    """The batch's lines from its input file, in run order; else what is wrong with them."""
    errors: list[BatchError] = []
    found: list[tuple[str, int, str, dict[str, Any]]] = []
    seen: set[str] = set()
    model: str | None = None
    inputs = 0

    def wrong(code: str, message: str, number: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append(BatchError(code, message, param, number))

    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(found) >= max_lines:
            wrong("too_many_tasks", f"The batch input file holds more than {max_lines} "
                  "requests.", None)
            break
        line = _read_line(raw, endpoint, seen, model)
        if isinstance(line, _Wrong):
            wrong(line.code, line.message, number, line.param)
            continue
        custom_id, body, model = line
        inputs += _inputs(endpoint, body)
        found.append((prefix_key(endpoint, body), number, custom_id, body))
    if not found and not errors:
        wrong("empty_file", "The batch input file is empty.", None)
    if inputs > MAX_EMBEDDING_INPUTS:
        wrong("too_many_tasks", f"An embeddings batch takes at most {MAX_EMBEDDING_INPUTS} "
              "inputs over all its requests.", None)
    if errors:
        return errors
    found.sort(key=lambda entry: (entry[0], entry[1]))
    return BatchInput(tuple(Line(i, number, custom_id, line_body(body))
                            for i, (_, number, custom_id, body) in enumerate(found)), model)


def _read_line(raw: bytes, endpoint: str, seen: set[str],
               model: str | None) -> tuple[str, dict[str, Any], str] | _Wrong:
    """One line's ``custom_id``, body and model (``seen`` takes its ``custom_id`` once it is
    no duplicate); else what is wrong with it. ``model``: the batch's, from its first line."""
    try:
        request = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        request = None
    if not isinstance(request, dict):
        return _Wrong("invalid_json_line", "This line is not parseable as valid JSON.")
    custom_id, body, url = request.get("custom_id"), request.get("body"), request.get("url")
    if not isinstance(custom_id, str) or not custom_id:
        return _Wrong("invalid_request", "Each request needs a 'custom_id', a non-empty string.",
                      "custom_id")
    if custom_id in seen:
        return _Wrong("duplicate_custom_id", "The custom_id for this request is a duplicate of "
                      "another request. The custom_id parameter must be unique for each "
                      "request in a batch.", "custom_id")
    seen.add(custom_id)
    if request.get("method") != "POST":
        return _Wrong("invalid_request", "The request's 'method' must be 'POST'.", "method")
    if url != endpoint:
        return _Wrong("url_mismatch", f"The provided URL '{str(url)[:80]}' does not match the "
                      f"batch endpoint '{endpoint}'.", "url")
    if not isinstance(body, dict):
        return _Wrong("invalid_request", "The request's 'body' must be a JSON object.", "body")
    line_model = _line_model(body, model)
    if isinstance(line_model, _Wrong):
        return line_model
    return custom_id, body, line_model


def _line_model(body: dict[str, Any], model: str | None) -> str | _Wrong:
    """The model a line's body asks for, which must be the batch's (``model``, once known)."""
    line_model = body.get("model")
    if not isinstance(line_model, str) or not line_model:
        return _Wrong("invalid_request", "The request's body needs a 'model'.", "body.model")
    if model is not None and line_model != model:
        return _Wrong("model_mismatch", f"The model '{line_model[:80]}' differs from the "
                      f"batch's model '{model}': a batch's requests are for one model.",
                      "body.model")
    return line_model


def _inputs(endpoint: str, body: dict[str, Any]) -> int:
    """How many embedding inputs a line's body asks for (0 on other endpoints)."""
    if endpoint != "/v1/embeddings":
        return 0
    given = body.get("input")
    return len(given) if isinstance(given, list) and given and not isinstance(given[0], int) else 1


def prefix_key(endpoint: str, body: dict[str, Any]) -> str:
    """The beginning of what a request's prompt is made from, as text to sort by."""
    if endpoint == "/v1/chat/completions":
        parts: Any = [body.get("tools"), body.get("messages")]
    elif endpoint == "/v1/responses":
        parts = [body.get("instructions"), body.get("tools"), body.get("input")]
    elif endpoint == "/v1/completions":
        parts = body.get("prompt")
    else:
        parts = body.get("input")
    try:
        text = _encode(parts).decode()
    except (TypeError, msgspec.EncodeError):  # not JSON-encodable: cannot be, it was decoded
        text = ""
    return text[:KEY_CHARS]


def line_body(body: dict[str, Any]) -> bytes:
    """The body a line is sent with: its own, at the batch's service tier."""
    return _encode({**body, "service_tier": TIER})


def refusal(body: bytes) -> OpenAIHTTPError | None:
    """The 400 a line gets without running: what a batch cannot give it (a stream, a
    background response); None when it can run."""
    try:
        fields = msgspec.json.decode(body)
    except msgspec.DecodeError:  # we encoded it
        return None
    if fields.get("stream") is True:
        return invalid_request("A batch's requests cannot stream: 'stream' must be false or "
                               "absent.", "stream")
    if fields.get("background") is True:
        return invalid_request("A batch's requests run in the background already: "
                               "'background' must be false or absent.", "background")
    return None


def outcome(status: int, retry_after_s: float | None = None) -> Outcome:
    """What a line's answer makes it: done (``completed``: the output file; ``failed``: the
    error file), or ``retry`` later: the server had no room for it then (a 429 or a 503) and
    said when to ask again (a 429 without ``retry-after``, a prompt larger than a rate limit
    will ever allow, is final)."""
    if status == 200:
        return "completed"
    if status in RETRY_STATUSES and retry_after_s is not None:
        return "retry"
    return "failed"


def new_line_id() -> str:
    return f"batch_req_{secrets.token_hex(16)}"


def result_line(custom_id: str, status: int, request_id: str, body: bytes) -> bytes:
    """An answered line as its output (or error) file holds it; ``body``: the endpoint's."""
    if not body.lstrip().startswith((b"{", b"[")):  # every answer of ours is an object
        body = _encode(body.decode("utf-8", "replace"))
    return _encode({
        "id": new_line_id(), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id,
                     "body": msgspec.Raw(body)},
        "error": None,
    })


def unrun_line(custom_id: str, why: str) -> bytes:
    """A line that never ran, as the error file holds it (``why``: the batch's end)."""
    code, message = UNRUN.get(why, UNRUN["failed"])
    return _encode({"id": new_line_id(), "custom_id": custom_id, "response": None,
                    "error": {"code": code, "message": message}})

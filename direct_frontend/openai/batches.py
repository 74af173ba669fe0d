"""The Batch API's batch object and the body that creates one (sans-IO).

A batch runs every request of an uploaded JSONL file against one endpoint
and writes their answers to an output file (those that succeeded) and an
error file (those that did not). Its object is OpenAI's: ``status`` goes
``validating`` → ``in_progress`` → ``finalizing`` → ``completed`` (or
``failed`` when its file cannot run, ``cancelling`` → ``cancelled``,
``expired`` past its completion window), with the time of each step
(``in_progress_at`` …), ``request_counts`` and the ids of its files. Every
batch has an owner (http/identity.py): for anyone else it does not exist.
Ids carry 192 bits from the OS's CSPRNG.
"""

from __future__ import annotations

import secrets
from typing import Any, Final, Literal

import msgspec

from direct_frontend.openai.conversations import metadata_of
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.lists import list_page

PREFIX: Final = "batch_"
#: the endpoints a batch's lines may ask for
ENDPOINTS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                    "/v1/embeddings")
#: the one completion window OpenAI takes, and how long it is
WINDOW: Final = "24h"
WINDOW_S: Final = 24 * 3600

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                 "cancelling", "cancelled"]
#: a batch in one of these has work left, and a process holding its lease runs it
ACTIVE: Final = ("validating", "in_progress", "finalizing", "cancelling")
#: what a batch's run can end as, and the field that says when
ENDED_AT: Final = {"completed": "completed_at", "failed": "failed_at",
                   "cancelled": "cancelled_at", "expired": "expired_at"}

_encode: Final = msgspec.json.Encoder().encode


class BatchError(msgspec.Struct, frozen=True, omit_defaults=False):
    """One reason a batch's input cannot run, as OpenAI lists it in ``errors.data``."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class StoredBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One batch as stored; ``metadata`` is its JSON object's bytes (or None)."""

    id: str
    owner: str
    tenant: str  # the admission flow its lines queue as
    endpoint: str
    input_file_id: str
    completion_window: str = WINDOW
    status: Status = "validating"
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[BatchError, ...] = ()
    metadata: bytes | None = None
    model: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def render(self) -> bytes:
        """The batch object the API answers."""
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {
                "object": "list", "data": [msgspec.structs.asdict(e) for e in self.errors]},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at,
            "failed_at": self.failed_at, "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": None if self.metadata is None else msgspec.Raw(self.metadata),
            "model": self.model,
        }
        return _encode(out)

    def moved(self, status: Status, at: int, **fields: Any) -> StoredBatch:
        """This batch in ``status`` from ``at`` (its step's ``*_at`` set), with ``fields``."""
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
                 "cancelling": "cancelling_at", **ENDED_AT}.get(status)
        if stamp is not None:
            fields[stamp] = at
        return msgspec.structs.replace(self, status=status, **fields)


_struct_encode: Final = msgspec.msgpack.Encoder().encode
_struct_decode: Final = msgspec.msgpack.Decoder(StoredBatch)


def encode_batch(batch: StoredBatch) -> bytes:
    return _struct_encode(batch)


def decode_batch(data: bytes) -> StoredBatch:
    return _struct_decode.decode(data)


class BatchCreate(msgspec.Struct, frozen=True):
    """``POST /v1/batches``, checked."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: bytes | None


def parse_create(raw: dict[str, Any]) -> BatchCreate:
    """The create body, checked as OpenAI checks it (a 400 naming the field at fault)."""
    values = {}
    for name in ("input_file_id", "endpoint", "completion_window"):
        value = raw.get(name)
        if value is None:
            raise invalid_request(f"Missing required parameter: '{name}'.", name)
        if not isinstance(value, str) or not value:
            raise invalid_request(f"Invalid type for '{name}': expected a string.", name)
        values[name] = value
    if values["endpoint"] not in ENDPOINTS:
        raise invalid_request(
            f"Invalid 'endpoint': {values['endpoint'][:60]!r}. Supported: "
            f"{', '.join(ENDPOINTS)}.", "endpoint")
    if values["completion_window"] != WINDOW:
        raise invalid_request(f"Invalid 'completion_window': "
                              f"{values['completion_window'][:20]!r}. Supported: '{WINDOW}'.",
                              "completion_window")
    return BatchCreate(values["input_file_id"], values["endpoint"],
                       values["completion_window"], metadata_of(raw))


def new_batch_id() -> str:
    return f"{PREFIX}{secrets.token_hex(24)}"


def batch_not_found(batch_id: str) -> OpenAIHTTPError:
    """404 for a batch nobody holds for the caller."""
    return OpenAIHTTPError(404, f"No such Batch object: {batch_id}", "invalid_request_error",
                           "batch_id")


def not_cancellable(batch: StoredBatch) -> OpenAIHTTPError:
    """A cancel of a batch that has ended."""
    return OpenAIHTTPError(409, f"Cannot cancel a batch with status '{batch.status}'.",
                           "invalid_request_error", "batch_id")


def input_not_batch(file_id: str) -> OpenAIHTTPError:
    return invalid_request(f"File '{file_id}' was not uploaded with purpose 'batch': a batch "
                           "reads its requests from a batch input file.", "input_file_id")


def page(batches: list[StoredBatch], has_more: bool) -> bytes:
    """An OpenAI list of ``batches``."""
    return list_page([(b.id, b.render()) for b in batches], has_more)

"""The Files API's objects and upload checks (sans-IO).

A file is what a batch reads its requests from (``purpose: "batch"``, a
JSONL file) or writes its results to (``purpose: "batch_output"``). Its
object is OpenAI's (``id`` ``file-…``, ``object: "file"``, ``bytes``,
``created_at``, ``expires_at``, ``filename``, ``purpose``, and the
deprecated ``status`` the SDK still reads), and a list of them is OpenAI's
cursor page. Every file has an owner (http/identity.py): for anyone else it
does not exist. Ids carry 192 bits from the OS's CSPRNG.
"""

from __future__ import annotations

import secrets
from typing import Final

import msgspec

from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.lists import list_page

PREFIX: Final = "file-"
#: what a batch's input file is uploaded as, and what its output and error files are
BATCH: Final = "batch"
BATCH_OUTPUT: Final = "batch_output"
#: ``expires_after.seconds``: OpenAI's bounds
MIN_EXPIRY_S: Final = 3600
MAX_EXPIRY_S: Final = 30 * 86400

_encode: Final = msgspec.json.Encoder().encode


class StoredFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file as stored (its bytes are kept beside it, in parts)."""

    id: str
    owner: str
    created_at: int
    filename: str
    purpose: str
    size: int  # the object's ``bytes``
    expires_at: int | None = None

    def render(self) -> bytes:
        """The file object the API answers."""
        return _encode({
            "id": self.id, "object": "file", "bytes": self.size,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "filename": self.filename, "purpose": self.purpose, "status": "processed",
            "status_details": None,
        })

    def deleted(self) -> bytes:
        return b'{"id":%b,"object":"file","deleted":true}' % _encode(self.id)


def new_file_id() -> str:
    return f"{PREFIX}{secrets.token_hex(24)}"


def file_not_found(file_id: str, param: str = "id") -> OpenAIHTTPError:
    """404 for a file nobody holds for the caller; OpenAI's wording."""
    return OpenAIHTTPError(404, f"No such File object: {file_id}", "invalid_request_error",
                           param)


def check_upload(filename: str, purpose: str, data: bytes, max_lines: int) -> int:
    """An upload checked as a batch input file: its purpose, its name, and that it is JSONL
    (each line that is not blank one JSON object); how many requests it holds.

    What a line asks for is checked when a batch is made of the file (against
    the batch's endpoint), and reported in the batch's ``errors`` as OpenAI
    reports it; here only what no batch could use is refused, with a 400
    naming the first line at fault.
    """
    if purpose != BATCH:
        raise invalid_request(f"Invalid 'purpose': {purpose[:40]!r}. This server keeps files "
                              f"for the Batch API only: purpose must be '{BATCH}'.", "purpose")
    if not filename.endswith(".jsonl"):
        raise invalid_request("Invalid file format for Batch API. Must be .jsonl", "file")
    count = 0
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            value = msgspec.json.decode(line)
        except msgspec.DecodeError:
            raise invalid_request(f"Invalid file format for Batch API: line {number} is not "
                                  "valid JSON (UTF-8, one request object a line).",
                                  "file") from None
        if not isinstance(value, dict):
            raise invalid_request(f"Invalid file format for Batch API: line {number} is not a "
                                  "JSON object.", "file")
        count += 1
        if count > max_lines:
            raise invalid_request(f"Invalid file for Batch API: more than {max_lines} requests "
                                  "([frontend.batches] max_lines).", "file")
    if not count:
        raise invalid_request("Invalid file for Batch API: the file holds no request.", "file")
    return count


def expiry_of(anchor: str | None, seconds: str | None) -> int | None:
    """``expires_after[anchor]`` and ``expires_after[seconds]`` of an upload form, checked:
    the seconds after creation the file is kept for (None: not asked)."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise invalid_request("Invalid 'expires_after.anchor': expected 'created_at'.",
                              "expires_after.anchor")
    text = seconds or ""
    if not (text.isascii() and text.isdigit() and len(text) <= 8) or not (
            MIN_EXPIRY_S <= int(text) <= MAX_EXPIRY_S):
        raise invalid_request(f"Invalid 'expires_after.seconds': an integer from {MIN_EXPIRY_S} "
                              f"to {MAX_EXPIRY_S}.", "expires_after.seconds")
    return int(text)


def page(files: list[StoredFile], has_more: bool) -> bytes:
    """An OpenAI list of ``files``."""
    return list_page([(f.id, f.render()) for f in files], has_more)

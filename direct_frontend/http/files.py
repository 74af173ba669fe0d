"""``/v1/files``: upload, list, retrieve, delete and download the Batch API's files.

Files live in the durable store (state/batch_store.py), record and bytes
both, so every process on one database serves every file. Every call
names its owner (http/identity.py): another owner's file is OpenAI's 404,
as an id nobody made. An upload is committed before its id is answered.
Each handler gets one :class:`ApiCall` and answers it; :func:`serve` turns
a refusal into its OpenAI error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import parse_qs

import trio

from direct_frontend.fleet.schema import BatchesConfig, FrontendConfig
from direct_frontend.http.asgi import (
    JSON,
    ClientGone,
    Headers,
    Receive,
    Scope,
    Send,
    header,
    log,
    send_body,
    send_error,
)
from direct_frontend.http.identity import Caller
from direct_frontend.http.multipart import FormReader
from direct_frontend.http.query import list_page
from direct_frontend.http.stored_responses import unavailable
from direct_frontend.openai.errors import OpenAIHTTPError, body_timeout, invalid_request
from direct_frontend.openai.files import (
    StoredFile,
    check_upload,
    expiry_of,
    file_not_found,
    new_file_id,
    page,
)
from direct_frontend.state.batch_sql import OwnerFull
from direct_frontend.state.batch_store import BatchStore
from direct_frontend.state.sql import StoreError

PATH: Final = "/v1/files"
CONTENT: Final = "content"
#: ``GET /v1/files``: OpenAI's default and largest page
LIST_LIMIT: Final = 10_000
#: the room around a file in its form (boundaries, headers, the purpose)
FORM_OVERHEAD: Final = 64 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class ApiCall:
    """One Files or Batch API request: who sent it, the ids in its path, its exchange."""

    store: BatchStore
    frontend: FrontendConfig
    caller: Caller
    ids: list[str]
    scope: Scope
    receive: Receive
    send: Send
    headers: Headers

    @property
    def config(self) -> BatchesConfig:
        return self.frontend.batches

    @property
    def query(self) -> bytes:
        return bytes(self.scope.get("query_string", b""))

    async def answer(self, body: bytes) -> int:
        await send_body(self.send, 200, body, JSON, self.headers)
        return 200


Call = Callable[[ApiCall], Awaitable[int]]


def route(path: str) -> tuple[dict[str, Call], str, list[str]] | None:
    """The methods of a ``/v1/files`` path, its metrics label and the id it names; None:
    no such path."""
    if path == PATH:
        return {"GET": list_files, "POST": upload}, PATH, []
    parts = path[len(PATH) + 1:].split("/") if path.startswith(PATH + "/") else []
    if not parts or not all(parts):
        return None
    if len(parts) == 1:
        return {"GET": retrieve, "DELETE": delete}, PATH + "/{id}", parts
    if len(parts) == 2 and parts[1] == CONTENT:
        return {"GET": content}, PATH + "/{id}/content", parts[:1]
    return None


async def serve(call: Call, api: ApiCall) -> int:
    """``call`` answered; a refusal is its OpenAI error, a database that fails a 503."""
    try:
        return await call(api)
    except OpenAIHTTPError as err:
        await send_error(api.send, err, api.headers)
        return err.status
    except StoreError as exc:
        refusal = unavailable(exc)
        await send_error(api.send, refusal, api.headers)
        return refusal.status


async def upload(api: ApiCall) -> int:
    """``POST /v1/files``: a batch input file, checked, kept, and its object answered."""
    reader = FormReader(header(api.scope, b"content-type"), api.config.max_file_bytes)
    received, done = 0, False
    limit = api.config.max_file_bytes + FORM_OVERHEAD
    with trio.move_on_after(api.frontend.body_timeout_s):
        while not done:
            message = await api.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                raise OpenAIHTTPError(413, f"The file is larger than this server takes "
                                      f"({api.config.max_file_bytes} bytes, [frontend.batches] "
                                      "max_file_bytes).", "invalid_request_error", "file")
            reader.feed(chunk)
            done = not message.get("more_body", False)
    if not done:
        raise body_timeout(api.frontend.body_timeout_s)
    form = reader.close()
    purpose = form.fields.get("purpose")
    if purpose is None:
        raise invalid_request("Missing required parameter: 'purpose'.", "purpose")
    if form.file is None or form.filename is None:
        raise invalid_request("Missing required parameter: 'file'.", "file")
    data = bytes(form.file)
    expiry = expiry_of(form.fields.get("expires_after[anchor]"),
                       form.fields.get("expires_after[seconds]"))
    await trio.to_thread.run_sync(check_upload, form.filename, purpose, data,
                                  api.config.max_lines, limiter=api.store.checking)
    now = int(time.time())
    file = StoredFile(id=new_file_id(), owner=api.caller.owner, created_at=now,
                      filename=form.filename[:255], purpose=purpose, size=len(data),
                      expires_at=now + int(expiry or api.config.file_ttl_s))
    try:
        await api.store.put_file(file, data, api.config.max_bytes_per_owner)
    except OwnerFull:
        raise OpenAIHTTPError(
            413, f"This API key's files would hold more than {api.config.max_bytes_per_owner} "
            "bytes ([frontend.batches] max_bytes_per_owner): delete some first.",
            "invalid_request_error", "file") from None
    return await api.answer(file.render())


async def list_files(api: ApiCall) -> int:
    """``GET /v1/files``: the owner's files, newest first unless ``order=asc``."""
    limit, order, after = list_page(api.query, default=LIST_LIMIT, most=LIST_LIMIT)
    purpose = parse_qs(api.query.decode("latin-1")).get("purpose", [None])[-1]
    try:
        found = await api.store.list_files(api.caller.owner, after, limit, order, purpose)
    except KeyError:
        raise invalid_request(f"No file with id '{after}'.", "after") from None
    return await api.answer(page(*found))


async def retrieve(api: ApiCall) -> int:
    file = await api.store.get_file(api.ids[0], api.caller.owner)
    if file is None:
        raise file_not_found(api.ids[0])
    return await api.answer(file.render())


async def delete(api: ApiCall) -> int:
    file = await api.store.get_file(api.ids[0], api.caller.owner)
    if file is None or not await api.store.delete_file(api.ids[0], api.caller.owner):
        raise file_not_found(api.ids[0])
    return await api.answer(file.deleted())


async def content(api: ApiCall) -> int:
    """``GET /v1/files/{id}/content``: the file's bytes, read from the store a part at a
    time as they are sent (a file deleted meanwhile ends short)."""
    file = await api.store.get_file(api.ids[0], api.caller.owner)
    if file is None:
        raise file_not_found(api.ids[0])
    await api.send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(file.size).encode()), *api.headers]})
    sent, seq = 0, 0
    while sent < file.size:
        part = await api.store.read_part(file.id, api.caller.owner, seq)
        if part is None:
            log.warning("file %s went away while it was being sent", file.id)
            break
        sent += len(part)
        seq += 1
        await api.send({"type": "http.response.body", "body": part,
                        "more_body": sent < file.size})
    if sent < file.size or not file.size:
        await api.send({"type": "http.response.body", "body": b"", "more_body": False})
    return 200

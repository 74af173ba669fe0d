"""``/v1/batches``: create, retrieve, list and cancel batches.

A batch is committed to the durable store (``validating``) before its id is
answered; the batch runner (http/batch_runner.py) of whichever process takes
it up reads its input, runs its lines and writes its files. Every call names
its owner (http/identity.py): another owner's batch is OpenAI's 404, as an
id nobody made, and a batch's input file must be the owner's too. A batch's
lines queue as the tenant that created it.
"""

from __future__ import annotations

import time
from typing import Final

from direct_frontend.http.asgi import read_body
from direct_frontend.http.batch_runner import BatchRunner
from direct_frontend.http.files import ApiCall, Call
from direct_frontend.http.query import list_page
from direct_frontend.openai.batches import (
    WINDOW_S,
    StoredBatch,
    batch_not_found,
    input_not_batch,
    new_batch_id,
    not_cancellable,
    page,
    parse_create,
)
from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.errors import invalid_request, rate_limited
from direct_frontend.openai.files import BATCH, file_not_found
from direct_frontend.state.batch_sql import OwnerFull

PATH: Final = "/v1/batches"
CANCEL: Final = "cancel"


class Batches:
    """The Batch API's calls, and the runner they tell of new and cancelled batches."""

    def __init__(self, runner: BatchRunner | None) -> None:
        self.runner = runner

    def route(self, path: str) -> tuple[dict[str, Call], str, list[str]] | None:
        """The methods of a ``/v1/batches`` path, its metrics label and the id it names;
        None: no such path."""
        if path == PATH:
            return {"GET": self.list, "POST": self.create}, PATH, []
        parts = path[len(PATH) + 1:].split("/") if path.startswith(PATH + "/") else []
        if not parts or not all(parts):
            return None
        if len(parts) == 1:
            return {"GET": self.retrieve}, PATH + "/{id}", parts
        if len(parts) == 2 and parts[1] == CANCEL:
            return {"POST": self.cancel}, PATH + "/{id}/cancel", parts[:1]
        return None

    async def create(self, api: ApiCall) -> int:
        body = await read_body(api.receive, api.frontend.max_body_bytes,
                               api.frontend.body_timeout_s)
        asked = parse_create(read_json_object(body))
        file = await api.store.get_file(asked.input_file_id, api.caller.owner)
        if file is None:
            raise file_not_found(asked.input_file_id, "input_file_id")
        if file.purpose != BATCH:
            raise input_not_batch(asked.input_file_id)
        now = int(time.time())
        batch = StoredBatch(id=new_batch_id(), owner=api.caller.owner,
                            tenant=api.caller.tenant, endpoint=asked.endpoint,
                            input_file_id=asked.input_file_id,
                            completion_window=asked.completion_window, created_at=now,
                            expires_at=now + WINDOW_S, metadata=asked.metadata)
        try:
            await api.store.create_batch(batch, api.config.max_active_per_owner)
        except OwnerFull:
            raise rate_limited(
                f"At most {api.config.max_active_per_owner} batches may be running at once per "
                "API key ([frontend.batches] max_active_per_owner): wait for one to end.",
                retry_after=60) from None
        if self.runner is not None:
            self.runner.wake()
        return await api.answer(batch.render())

    async def retrieve(self, api: ApiCall) -> int:
        batch = await api.store.get_batch(api.ids[0], api.caller.owner)
        if batch is None:
            raise batch_not_found(api.ids[0])
        return await api.answer(batch.render())

    async def list(self, api: ApiCall) -> int:
        """``GET /v1/batches``: the owner's batches, newest first, after ``after``."""
        limit, _, after = list_page(api.query)
        try:
            found = await api.store.list_batches(api.caller.owner, after, limit)
        except KeyError:
            raise invalid_request(f"No batch with id '{after}'.", "after") from None
        return await api.answer(page(*found))

    async def cancel(self, api: ApiCall) -> int:
        """``cancelling`` until its runner has stopped it (no new line starts, the running
        ones are aborted) and written its files; a batch that has ended is a 409."""
        batch = await api.store.request_cancel(api.ids[0], api.caller.owner)
        if batch is None:
            raise batch_not_found(api.ids[0])
        if batch.status not in ("cancelling", "cancelled"):
            raise not_cancellable(batch)
        if batch.status == "cancelling" and self.runner is not None:
            self.runner.cancel(batch.id)
        return await api.answer(batch.render())

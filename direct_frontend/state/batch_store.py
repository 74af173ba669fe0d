"""The Files and Batch APIs' Trio shell: their SQL (:mod:`.batch_sql`) on worker threads.

Every call runs on a worker thread under the durable store's capacity
limiter (state/shell.py), so files and batches share its connections and
the event loop never waits on the database. A call is not abandoned when its
caller is cancelled: a write that started commits, or fails, before the
caller hears of it. StoreError: the database refused or cannot be reached.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from direct_frontend.openai.batch_lines import Line
from direct_frontend.openai.batches import BatchError, Status, StoredBatch
from direct_frontend.openai.files import StoredFile
from direct_frontend.state.batch_sql import BatchSql
from direct_frontend.state.shell import Durable
from direct_frontend.state.sql import Order

_T = TypeVar("_T")


class BatchStore:
    """Files and batches in the durable store's database."""

    def __init__(self, durable: Durable) -> None:
        self.sql = BatchSql(durable.sql)
        self.limiter = durable.limiter
        #: checking a batch file's lines is CPU work: one such check at a time per process
        self.checking = trio.CapacityLimiter(1)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self.limiter)

    # -- files ----------------------------------------------------------------------------
    async def put_file(self, file: StoredFile, data: bytes,
                       owner_bytes: int | None = None) -> None:
        await self._call(self.sql.put_file, file, data, owner_bytes)

    async def get_file(self, file_id: str, owner: str) -> StoredFile | None:
        return await self._call(self.sql.get_file, file_id, owner)

    async def read_part(self, file_id: str, owner: str, seq: int) -> bytes | None:
        return await self._call(self.sql.read_part, file_id, owner, seq)

    async def read_file(self, file_id: str, owner: str) -> tuple[StoredFile, bytes] | None:
        return await self._call(self.sql.read_file, file_id, owner)

    async def delete_file(self, file_id: str, owner: str) -> bool:
        return await self._call(self.sql.delete_file, file_id, owner)

    async def list_files(self, owner: str, after: str | None, limit: int, order: Order,
                         purpose: str | None) -> tuple[list[StoredFile], bool]:
        return await self._call(self.sql.list_files, owner, after, limit, order, purpose)

    # -- batches --------------------------------------------------------------------------
    async def create_batch(self, batch: StoredBatch, owner_active: int | None = None) -> None:
        await self._call(self.sql.create_batch, batch, owner_active)

    async def get_batch(self, batch_id: str, owner: str) -> StoredBatch | None:
        return await self._call(self.sql.get_batch, batch_id, owner)

    async def list_batches(self, owner: str, after: str | None,
                           limit: int) -> tuple[list[StoredBatch], bool]:
        return await self._call(self.sql.list_batches, owner, after, limit)

    async def request_cancel(self, batch_id: str, owner: str) -> StoredBatch | None:
        return await self._call(self.sql.request_cancel, batch_id, owner)

    async def claim(self, holder: str, lease_s: float, limit: int,
                    busy: Collection[str] = ()) -> list[StoredBatch]:
        return await self._call(self.sql.claim, holder, lease_s, limit, busy)

    async def renew(self, batch_id: str, holder: str, lease_s: float) -> tuple[bool, bool]:
        return await self._call(self.sql.renew, batch_id, holder, lease_s)

    async def release(self, batch_id: str, holder: str) -> None:
        await self._call(self.sql.release, batch_id, holder)

    async def start(self, batch_id: str, holder: str, lines: Sequence[Line],
                    model: str | None) -> StoredBatch:
        return await self._call(self.sql.start, batch_id, holder, lines, model)

    async def pending(self, batch_id: str) -> list[Line]:
        return await self._call(self.sql.pending, batch_id)

    async def put_results(self, batch_id: str,
                          results: Sequence[tuple[int, bool, bytes]]) -> None:
        await self._call(self.sql.put_results, batch_id, results)

    async def move(self, batch_id: str, holder: str, status: Status) -> StoredBatch:
        return await self._call(self.sql.move, batch_id, holder, status)

    async def finish(self, batch_id: str, holder: str, status: Status,
                     file_ttl_s: float) -> StoredBatch:
        return await self._call(self.sql.finish, batch_id, holder, status, file_ttl_s)

    async def fail(self, batch_id: str, holder: str, errors: Sequence[BatchError],
                   file_ttl_s: float) -> StoredBatch:
        return await self._call(self.sql.fail, batch_id, holder, errors, file_ttl_s)

    async def sweep(self) -> int:
        return await self._call(self.sql.sweep)

"""The batch runner: runs the Batch API's batches beside the HTTP server, in its nursery.

Every :data:`POLL_S` (and at once when a batch is created or cancelled
here) the runner takes up the batches with work left that no process holds
(state/batch_sql.py ``claim``: the oldest of the owner with the fewest
running here next), at most ``[frontend.batches] max_running`` at once, each
under a lease it renews while it runs it. For each:

- ``validating``: its input file is read and checked (openai/batch_lines.py,
  on a worker thread); the batch fails with OpenAI's errors, or its lines
  are kept in run order (lines sharing a prompt prefix side by side) and it
  is ``in_progress``.
- ``in_progress``: its lines without a result run, at most ``concurrency``
  at once, each through its endpoint's own handler in this process
  (:data:`Dispatch`: http/endpoints.py ``Generation.serve_line``) at the ``flex`` service tier,
  as the tenant that created the batch (its rate limits count each line). A
  line the server had no room for then (a 429 or a 503 with ``retry-after``)
  is asked again after that long (at least a backoff), until the batch's
  completion window ends. Each finished line's result is committed as it
  completes (those finishing together, in one transaction), so a process
  that takes the batch up after this one stopped runs only the lines still
  without a result.
- then ``finalizing``, and its output and error files are written in one
  transaction with its end (``completed``). A cancel (``cancelling``, from
  this process's API or read with the lease from another's) stops new lines
  and aborts the running ones (the Abort reaches the engine, as a client's
  disconnect does); a batch past its window stops the same way and ends
  ``expired``. Their unfinished lines are in the error file
  (``batch_cancelled``, ``batch_expired``).

A process that stops (a restart, a crash) leaves its batches' leases to
run out (``lease_s``); at a graceful shutdown it gives them up at once. A
database that fails stops a batch's run here; the batch is taken up again
once its lease has run out. Ended batches and expired files are swept
every ``sweep_interval_s``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from direct_frontend.fleet.schema import BatchesConfig
from direct_frontend.http.identity import Caller
from direct_frontend.http.internal import Answer
from direct_frontend.observability.logging import new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.batch_lines import (
    BatchInput,
    Line,
    outcome,
    read_input,
    refusal,
    result_line,
)
from direct_frontend.openai.batches import BatchError, Status, StoredBatch
from direct_frontend.openai.errors import error_body
from direct_frontend.state.batch_store import BatchStore
from direct_frontend.state.sql import StoreError

log = logging.getLogger("direct_frontend.batches")

#: a line through its endpoint: (endpoint, body, the batch's caller) -> its answer
Dispatch = Callable[[str, bytes, Caller], Awaitable[Answer]]
#: how often the database is asked for batches to take up (sooner when one is created here)
POLL_S: Final = 1.0
#: how often a running batch's lease is renewed at most (how soon a cancel asked of another
#: process is seen)
CANCEL_POLL_S: Final = 1.0
#: a line the server had no room for is asked again after this, doubling to the most
RETRY_FIRST_S: Final = 0.5
RETRY_MOST_S: Final = 5.0
#: the most results one transaction commits
WRITE_GROUP: Final = 256
#: how long giving up a lease may take at shutdown
RELEASE_S: Final = 5.0
_Result = tuple[int, bool, bytes]


class _Run:
    """One batch this process runs: what stops it."""

    def __init__(self, batch: StoredBatch) -> None:
        self.batch = batch
        self.cancelled = batch.status == "cancelling"
        self.lines: trio.CancelScope | None = None  # the scope its lines run in

    def cancel(self) -> None:
        """No new line starts, and the running ones are aborted."""
        self.cancelled = True
        if self.lines is not None:
            self.lines.cancel()


class BatchRunner:
    """The batches this process runs; see the module's text. ``config`` is read at each
    batch's turn (a reload applies to the next)."""

    def __init__(self, store: BatchStore, config: Callable[[], BatchesConfig],
                 dispatch: Dispatch, metrics: Metrics | None = None,
                 sweep_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.dispatch = dispatch
        self.metrics = metrics
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        #: this process's name in a batch's row while it runs it (not a secret: ids only)
        self.holder = secrets.token_hex(8)
        self._runs: dict[str, _Run] = {}
        self._wake = trio.Event()
        if metrics is not None:
            metrics.watch_batches(lambda: len(self._runs))

    def __len__(self) -> int:
        return len(self._runs)

    def wake(self) -> None:
        """A batch was created: look for work now, not at the next poll."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """A cancel was asked of a batch (its row says so): stop it now if it runs here."""
        run = self._runs.get(batch_id)
        if run is not None:
            run.cancel()
        else:
            self.wake()  # not taken up yet: it may be taken now, to end it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take up batches and run them until this task is cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sweep)
            task_status.started()
            while True:
                self._wake = trio.Event()
                room = self.config().max_running - len(self._runs)
                if room > 0:
                    try:
                        taken = await self.store.claim(
                            self.holder, self.config().lease_s, room,
                            [run.batch.owner for run in self._runs.values()])
                    except StoreError as exc:
                        log.warning("batches not looked for (next try in %.0f s): %s",
                                    POLL_S, exc)
                        taken = []
                    for batch in taken:
                        self._runs[batch.id] = _Run(batch)
                        nursery.start_soon(self._serve, self._runs[batch.id])
                with trio.move_on_after(POLL_S):
                    await self._wake.wait()

    async def _sweep(self) -> None:
        while True:
            await trio.sleep(self.sweep_interval_s)
            try:
                dropped = await self.store.sweep()
            except StoreError as exc:
                log.warning("files and batches not swept (next pass tries again): %s", exc)
                continue
            if dropped:
                log.info("retention: %d files and batches left", dropped)

    async def _serve(self, run: _Run) -> None:
        """Run one batch under its lease to its end (or until this process lets it go)."""
        batch_id = run.batch.id
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_lease, run, nursery.cancel_scope)
                ended = await self._drive(run)
                nursery.cancel_scope.cancel()
            if ended is not None:
                log.info("batch %s %s: %d of %d lines completed, %d failed", batch_id,
                         ended.status, ended.completed, ended.total, ended.failed)
        except StoreError as exc:
            log.warning("batch %s stopped here (taken up again once its lease runs out): %s",
                        batch_id, exc)
        except Exception:  # a bug: this batch stops here, the others go on
            log.exception("batch %s failed in its runner", batch_id)
        finally:
            del self._runs[batch_id]
            with trio.move_on_after(RELEASE_S) as scope:
                scope.shield = True
                with contextlib.suppress(StoreError):  # else its lease runs out instead
                    await self.store.release(batch_id, self.holder)
            self.wake()  # room for another

    async def _keep_lease(self, run: _Run, scope: trio.CancelScope) -> None:
        """Renew the batch's lease while it runs; a cancel asked through the database stops
        its lines, and a lease lost (this process stalled past it) stops the batch here."""
        while True:
            lease_s = self.config().lease_s
            await trio.sleep(min(lease_s / 3, CANCEL_POLL_S))
            try:
                held, cancelled = await self.store.renew(run.batch.id, self.holder, lease_s)
            except StoreError as exc:
                log.warning("batch %s: lease not renewed (next try soon): %s", run.batch.id,
                            exc)
                continue
            if not held:
                log.warning("batch %s: another process holds it now; stopping here",
                            run.batch.id)
                scope.cancel()
                return
            if cancelled and not run.cancelled:
                run.cancel()

    async def _drive(self, run: _Run) -> StoredBatch | None:
        """Take the batch from where its row says it is to its end; the ended batch."""
        batch, config = run.batch, self.config()
        if batch.status == "validating" and not self._expired(batch):
            started = await self._validate(batch, config)
            if started is None or started.status == "failed":
                return started
            batch = started
        why: Status = "completed"
        if run.cancelled or batch.status == "cancelling":
            why = "cancelled"
        elif self._expired(batch):
            why = "expired"
        elif batch.status == "in_progress":
            why = await self._lines(run, batch, config)
        if why == "completed" and batch.status != "finalizing":
            await self.store.move(batch.id, self.holder, "finalizing")
        return await self.store.finish(batch.id, self.holder, why, config.file_ttl_s)

    def _expired(self, batch: StoredBatch) -> bool:
        return self.clock() >= batch.expires_at

    async def _validate(self, batch: StoredBatch, config: BatchesConfig) -> StoredBatch | None:
        """Read and check the batch's input: it is ``in_progress`` with its lines kept, or
        ``failed`` with OpenAI's errors."""
        found = await self.store.read_file(batch.input_file_id, batch.owner)
        if found is None:
            errors: list[BatchError] = [BatchError(
                "invalid_request", f"The input file {batch.input_file_id} was not found (it "
                "was deleted, or has expired).", "input_file_id")]
            return await self.store.fail(batch.id, self.holder, errors, config.file_ttl_s)
        checked = await trio.to_thread.run_sync(read_input, found[1], batch.endpoint,
                                                config.max_lines,
                                                limiter=self.store.checking)
        if not isinstance(checked, BatchInput):
            return await self.store.fail(batch.id, self.holder, checked, config.file_ttl_s)
        return await self.store.start(batch.id, self.holder, checked.lines, checked.model)

    async def _lines(self, run: _Run, batch: StoredBatch, config: BatchesConfig) -> Status:
        """Run the batch's unfinished lines; why they stopped (``completed``: all ran)."""
        pending = await self.store.pending(batch.id)
        caller = Caller(batch.owner, batch.tenant)
        room = trio.Semaphore(config.concurrency)
        send, receive = trio.open_memory_channel[_Result](float("inf"))
        deadline = trio.current_time() + max(0.0, batch.expires_at - self.clock())
        async with trio.open_nursery() as writing:
            writing.start_soon(self._write, batch.id, receive)
            with send, trio.CancelScope(deadline=deadline) as scope:
                run.lines = scope
                if run.cancelled:
                    scope.cancel()
                async with trio.open_nursery() as lines:
                    for line in pending:
                        await room.acquire()
                        lines.start_soon(self._line, batch.endpoint, line, caller, send, room)
        if run.cancelled:
            return "cancelled"
        return "expired" if scope.cancelled_caught else "completed"

    async def _line(self, endpoint: str, line: Line, caller: Caller,
                    results: trio.MemorySendChannel[_Result], room: trio.Semaphore) -> None:
        """One line to its answer (asked again while the server has no room for it)."""
        try:
            refused = refusal(line.body)
            if refused is not None:
                answer = Answer(refused.status, error_body(refused), new_request_id())
            else:
                delay = RETRY_FIRST_S
                while True:
                    answer = await self.dispatch(endpoint, line.body, caller)
                    if outcome(answer.status, answer.retry_after_s) != "retry":
                        break
                    self._count("retried")
                    await trio.sleep(max(answer.retry_after_s or 0.0,
                                         delay * random.uniform(0.5, 1.0)))
                    delay = min(delay * 2, RETRY_MOST_S)
            ok = outcome(answer.status) == "completed"
            self._count("completed" if ok else "failed")
            results.send_nowait((line.ord, ok, result_line(
                line.custom_id, answer.status, answer.request_id, answer.body)))
        finally:
            room.release()

    async def _write(self, batch_id: str, results: trio.MemoryReceiveChannel[_Result]) -> None:
        """Commit results as they come: those that came while the last commit ran, together."""
        async for first in results:
            group = [first]
            while len(group) < WRITE_GROUP:
                try:
                    group.append(results.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            await self.store.put_results(batch_id, group)

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.batch_line(what)

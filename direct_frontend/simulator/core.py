"""The kind-neutral engine core: admission, pacing, abort and bookkeeping.

The three servicers only translate their contract to and from this core, so
batching limits, cancellation and statistics behave the same on every kind.
Everything here runs on whatever asyncio loop is current (plain asyncio in
the standalone simulator, trio-asyncio inside the daemon) and never creates
a loop of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.kvcache import KvAllocation, SimPrefixCache
from direct_frontend.simulator.logprobs import RequestLogprobs
from direct_frontend.simulator.lora import LoraSlots
from direct_frontend.simulator.model import Finish, Generation, SimModel, StopCriteria
from direct_frontend.simulator.scripted import ScriptBook
from direct_frontend.simulator.settings import EngineConfig
from direct_frontend.simulator.steps import StepLoop

# Instant engines yield to the loop this often so other streams and
# cancellations still get a turn during a long generation.
_YIELD_EVERY = 32

Emit = Callable[[Sequence[int], Finish | None], Awaitable[None]]
"""Called with each new delta (one token, or none for a zero-token finish) and
the finish once the sequence has ended."""


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Observable counters, so tests can prove what reached the engine.

    ``aborts_received`` counts request ids named by Abort RPCs (known or not);
    ``aborted`` counts sequences an abort actually stopped; ``cancellations``
    counts Generate calls the client cancelled (not those ended by shutdown).
    """

    running: int = 0
    waiting: int = 0
    requests: int = 0
    completed: int = 0
    aborts_received: int = 0
    aborted: int = 0
    cancellations: int = 0
    health_checks: int = 0
    embeds: int = 0  # Embed calls whose vector was sent
    images: int = 0  # images received in Generate calls' multimodal inputs (shapes checked)
    request_ids: list[str] = dataclasses.field(default_factory=list)
    abort_request_ids: list[str] = dataclasses.field(default_factory=list)
    cancelled_request_ids: list[str] = dataclasses.field(default_factory=list)
    #: the W3C ``traceparent`` metadata of Generate calls that carried one, by request id
    traceparents: dict[str, str] = dataclasses.field(default_factory=dict)
    #: P/D legs, by request id: the rendezvous or kv_transfer_params_json received, and the
    #: handoff a vLLM prefill leg returned (see simulator/disagg.py)
    kv_params_received: dict[str, str] = dataclasses.field(default_factory=dict)
    kv_params_returned: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the last :data:`KEPT_REQUESTS` Generate requests as received (the contract's message),
    #: by request id, so tests can assert what reached the engine
    received: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the data-parallel rank each of the last :data:`KEPT_REQUESTS` admitted requests ran on
    #: (its pin, or the engine's own choice), by request id
    rank_of: dict[str, int] = dataclasses.field(default_factory=dict)

    def receive(self, request_id: str, request: Any) -> None:
        _keep(self.received, request_id, request)


def _keep(kept: dict[str, Any], request_id: str, value: Any) -> None:
    """Remember ``value`` under ``request_id``, forgetting the oldest past :data:`KEPT_REQUESTS`."""
    kept[request_id] = value
    if len(kept) > KEPT_REQUESTS:
        del kept[next(iter(kept))]


#: how many Generate requests :class:`EngineStats` keeps (a soak run sends millions)
KEPT_REQUESTS = 256


@dataclasses.dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's own queue and KV use: what GetLoads reports for it."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0  # KV tokens held by its running sequences (prompt plus output)
    waiting_tokens: int = 0  # prompt tokens queued on it, not yet prefilled


class JobState(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class Job:
    """One sequence inside the engine, findable by request id for Abort."""

    def __init__(self, request_id: str, generation: Generation, *, internal: bool) -> None:
        self.request_id = request_id
        self.generation = generation
        self.internal = internal  # health probes: use a slot, stay out of the stats
        self.state = JobState.WAITING
        self.aborted = False
        self._signal: asyncio.Future[None] | None = None
        self.prompt_ids: Sequence[int] = ()
        #: the prompt's images: (hash, placeholder offset, length), keying their KV blocks
        self.media: tuple[tuple[str, int, int], ...] = ()
        self.cached_tokens = 0  # prompt tokens already held (prefix cache, or a P/D handoff)
        self.kv: KvAllocation | None = None
        #: the prefix cache it runs against: a LoRA adapter's own, else (set on admission)
        #: its rank's; None: the engine has none
        self.cache: SimPrefixCache | None = None
        #: the data-parallel rank: the request's pin (None: unpinned), then the one it runs on
        self.rank: int | None = None

    @property
    def signal(self) -> asyncio.Future[None]:
        """Resolved on abort, so a sleeping or queued sequence wakes at once."""
        if self._signal is None:
            self._signal = asyncio.get_running_loop().create_future()
        return self._signal

    def abort(self) -> None:
        """Stop the sequence at its next step (or while it waits for a slot)."""
        self.aborted = True
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)


class _Slots:
    """A FIFO batch limit whose waiters can be woken by an abort."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, abort_signal: asyncio.Future[None]) -> bool:
        """Take a slot; False if ``abort_signal`` fired first."""
        if self.used < self.limit and not self._queue:
            self.used += 1
            return True
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            await asyncio.wait((turn, abort_signal), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._give_back(turn)
            raise
        if turn.done():
            return True  # the caller sees the abort itself and releases
        self._give_back(turn)
        return False

    def _give_back(self, turn: asyncio.Future[None]) -> None:
        if turn.done() and not turn.cancelled():
            self.release()  # the slot was handed over just as we left
            return
        turn.cancel()
        with contextlib.suppress(ValueError):
            self._queue.remove(turn)

    def release(self) -> None:
        """Hand the slot to the oldest waiter, or free it."""
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.used -= 1


def _produce(job: Job, generation: Generation) -> tuple[int, ...]:
    """One decode step of ``job``: its delta (``generation.finish`` says whether it ended).

    A sequence already finished (a zero-token budget: prefill only) adds an
    empty delta; a token that fills a block gets that block cached.
    """
    if generation.finish is not None:
        return ()
    token_id = generation.step()
    if job.kv is not None and job.cache is not None:
        job.cache.extend(job.kv, token_id)
    return (token_id,)


class SimCore:
    """Runs sequences for one engine: FIFO admission, paced steps, abort, stats."""

    def __init__(self, config: EngineConfig, model: SimModel) -> None:
        timing = config.timing
        self.config = config
        self.model = model
        self.timing = timing
        self.stats = EngineStats()
        self.healthy = True
        self.closing = False
        self.start_time = time.time()
        self.start_monotonic = time.monotonic()
        self.last_receive_time = 0.0
        self._slots = [_Slots(timing.max_running) for _ in range(config.dp_size)]
        #: each rank's scheduler steps, when the timing batches them (simulator/steps.py)
        self.steps = [StepLoop(timing) for _ in range(config.dp_size)] if timing.stepped else []
        self._next_rank = 0  # where an unpinned request's tie between ranks starts
        self._jobs: dict[str, list[Job]] = {}
        self.faults = FaultPlan()  # the live plan; SimEngine.faults replaces it
        #: one prefix cache per data-parallel rank, in rank order (SimEngine sets them,
        #: see kvcache.py; empty: no cache)
        self.kv_caches: list[SimPrefixCache] = []
        self.loras: LoraSlots | None = None  # SimEngine sets it when it serves adapters
        self.scripts: ScriptBook | None = None  # canned completions by prompt marker (scripted.py)

    # -- bookkeeping -------------------------------------------------------

    def mark_started(self) -> None:
        """Restart the clock that start_time and uptime report (engine restart fencing)."""
        self.start_time = time.time()
        self.start_monotonic = time.monotonic()

    @property
    def uptime(self) -> float:
        """Seconds since the engine started serving."""
        return time.monotonic() - self.start_monotonic

    def note_request(self, request_id: str, traceparent: str | None = None) -> None:
        """Record a Generate call as soon as it arrives, valid or not."""
        self.stats.request_ids.append(request_id)
        if traceparent is not None:
            self.stats.traceparents[request_id] = traceparent
        self.last_receive_time = time.time()

    def note_abort_rpc(self, request_ids: Sequence[str]) -> bool:
        """Record an Abort RPC and abort every named request; True if any was known."""
        found = False
        for request_id in request_ids:
            self.stats.aborts_received += 1
            self.stats.abort_request_ids.append(request_id)
            for job in self._jobs.get(request_id, ()):
                job.abort()
                found = True
        return found

    def jobs(self, state: JobState) -> list[Job]:
        """The user sequences currently in ``state``."""
        return [job for jobs in self._jobs.values() for job in jobs if job.state is state]

    def loads(self) -> list[RankLoad]:
        """Each data-parallel rank's own load, in rank order."""
        running = [0] * self.config.dp_size
        waiting = running.copy()
        used, queued = running.copy(), running.copy()
        for jobs in self._jobs.values():
            for job in jobs:
                generation, rank = job.generation, job.rank or 0
                if job.state is JobState.RUNNING:
                    running[rank] += 1
                    used[rank] += generation.prompt_len + len(generation.output_ids)
                elif job.state is JobState.WAITING:
                    waiting[rank] += 1
                    queued[rank] += generation.prompt_len
        return [RankLoad(*load) for load in zip(running, waiting, used, queued, strict=True)]

    def _place(self, job: Job) -> int:
        """The rank ``job`` runs on: its pin, else the least busy one.

        Least busy: the fewest waiting plus running requests, ties in turn from
        the rank after the last one picked, as vLLM's internal balancer reads
        queue lengths and goes round robin among equals (a real DP=2 engine
        sent six requests one after another runs them on ranks 0, 1, 0, 1, 0, 1).
        """
        if job.rank is not None:
            return job.rank
        size = self.config.dp_size
        if size == 1:
            return 0
        loads = self.loads()
        start = self._next_rank
        rank = min(range(size), key=lambda r: (
            loads[r].running + loads[r].waiting, (r - start) % size))
        self._next_rank = (rank + 1) % size
        return rank

    # -- running sequences -------------------------------------------------

    def new_job(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        criteria: StopCriteria,
        *,
        internal: bool = False,
        sample_seed: int | None = None,
        forced: Sequence[int] | None = None,
    ) -> Job:
        """Prepare a sequence; :meth:`run` admits it.

        ``sample_seed`` seeds its sampling; ``forced`` is a constrained request's
        output (simulator/constraints.py), which wins over any script.
        """
        scripts = None if internal or forced is not None else self.scripts
        script = forced if scripts is None else scripts.completion_for(prompt_ids)
        generation = Generation(self.model, prompt_ids, criteria, sample_seed, script)
        job = Job(request_id, generation, internal=internal)
        job.prompt_ids = prompt_ids
        return job

    def logprobs(self, job: Job, top: int | None, prompt_top: int | None) -> RequestLogprobs:
        """What ``job`` reports as logprobs (``top``/``prompt_top`` None: not asked for)."""
        generation = job.generation
        return RequestLogprobs(
            self.model, self.config.vocab_size, job.prompt_ids, generation.states,
            generation.output_ids, top, prompt_top,
        )

    async def run(self, job: Job, emit: Emit | None) -> Finish | None:
        """Wait for a slot, generate, and return the finish (None if aborted).

        Client cancellation propagates as ``CancelledError`` after the slot
        and the registration are given back.
        """
        job.rank = rank = self._place(job)
        if job.cache is None and self.kv_caches:
            job.cache = self.kv_caches[rank]
        if not job.internal:
            _keep(self.stats.rank_of, job.request_id, rank)
        self._register(job)
        try:
            finish = await self._run_in_slot(job, emit, self._slots[rank])
            if not job.internal:
                if finish is None:
                    self.stats.aborted += 1
                else:
                    self.stats.completed += 1
            return finish
        except asyncio.CancelledError:
            if not job.internal and not self.closing:
                self.stats.cancellations += 1
                self.stats.cancelled_request_ids.append(job.request_id)
            raise
        finally:
            self._set_state(job, JobState.DONE)
            self._unregister(job)

    async def _run_in_slot(self, job: Job, emit: Emit | None, slots: _Slots) -> Finish | None:
        """Hold one of the rank's slots while the sequence runs (None: aborted first)."""
        if not await slots.acquire(job.signal):
            return None
        cache = job.cache
        try:
            self._set_state(job, JobState.RUNNING)
            if cache is not None and not job.internal:
                job.kv = cache.admit(job.prompt_ids, job.media)
                # a decode leg's KV may have arrived from a prefill engine already
                job.cached_tokens = max(job.cached_tokens, job.kv.cached_tokens)
            if job.aborted:
                return None
            if self.steps:
                return await self._generate_in_steps(job, emit)
            return await self._generate(job, emit)
        finally:
            if job.kv is not None and cache is not None:
                cache.release(job.kv)
            slots.release()

    async def _generate(self, job: Job, emit: Emit | None) -> Finish | None:
        """Generate on the timing model's clock: the prefill, then one decode interval a token."""
        generation = job.generation
        timing = self.timing
        instant = timing.instant
        decode = timing.decode_seconds
        # Only the tokens the prefix cache did not serve are prefilled.
        uncached = generation.prompt_len - job.cached_tokens
        deadline = time.monotonic() + timing.prefill_seconds(uncached)
        since_yield = 0
        while True:
            extra = self.faults.token_delay_s  # read every step: tests flip it mid-stream
            if extra > 0:
                await asyncio.wait((job.signal,), timeout=extra)
                deadline += extra
            delay = 0.0 if instant else deadline - time.monotonic()
            if delay > 0:
                await asyncio.wait((job.signal,), timeout=delay)
                since_yield = 0
            else:
                since_yield += 1
                if since_yield >= _YIELD_EVERY:
                    since_yield = 0
                    await asyncio.sleep(0)
            if job.aborted:
                return None
            delta = _produce(job, generation)
            finish = generation.finish
            if emit is not None:
                await emit(delta, finish)
            if finish is not None:
                return finish
            deadline += decode

    async def _generate_in_steps(self, job: Job, emit: Emit | None) -> Finish | None:
        """:meth:`_generate` with the rank's batched steps pacing every token."""
        steps = self.steps[job.rank or 0]
        generation = job.generation
        seat = steps.join(generation.prompt_len - job.cached_tokens,
                          generation.criteria.max_tokens - len(generation.output_ids))
        try:
            while True:
                extra = self.faults.token_delay_s
                if extra > 0:
                    await asyncio.wait((job.signal,), timeout=extra)
                if not await seat.take(job.signal) or job.aborted:
                    return None
                delta = _produce(job, generation)
                finish = generation.finish
                if emit is not None:
                    await emit(delta, finish)
                if finish is not None:
                    return finish
        finally:
            steps.leave(seat)

    async def probe(self) -> bool:
        """A one-token generation through the normal queue, as SGLang's HealthCheck does.

        A cancelled probe raises ``CancelledError`` whenever the cancellation comes: the
        generation runs in the caller's task under ``asyncio.timeout``. (Python 3.11's
        ``asyncio.wait_for`` runs it in a task of its own and returns its result when
        both end in one loop pass, dropping the cancellation; grpclib then logs the
        handler's reply on the reset stream as "Failed to handle cancellation".)
        """
        self.stats.health_checks += 1
        job = self.new_job("HEALTH_CHECK", (0,), StopCriteria(max_tokens=1), internal=True)
        try:
            async with asyncio.timeout(self.config.health_timeout):
                finish = await self.run(job, None)
        except TimeoutError:
            return False
        return finish is not None

    def _register(self, job: Job) -> None:
        if job.internal:
            return  # health probes are not abortable by id, as on SGLang
        self._jobs.setdefault(job.request_id, []).append(job)
        self.stats.requests += 1
        self.stats.waiting += 1

    def _unregister(self, job: Job) -> None:
        if job.internal:
            return
        jobs = self._jobs.get(job.request_id)
        if jobs is not None:
            jobs.remove(job)
            if not jobs:
                del self._jobs[job.request_id]

    def _set_state(self, job: Job, state: JobState) -> None:
        old = job.state
        if old is state:
            return
        job.state = state
        if job.internal:
            return
        if old is JobState.WAITING:
            self.stats.waiting -= 1
        elif old is JobState.RUNNING:
            self.stats.running -= 1
        if state is JobState.RUNNING:
            self.stats.running += 1
        elif state is JobState.WAITING:
            self.stats.waiting += 1

    def abort_all(self) -> None:
        """Stop every sequence (engine shutdown)."""
        for jobs in self._jobs.values():
            for job in jobs:
                job.abort()

"""The simulated engines' KV-event publisher: a ZMQ PUB plus a replay ROUTER.

It puts on the wire what the stock engines do (docs/kv-events.md §3–§8,
docs/real-vllm.md §7): 3-frame messages ``[topic, seq u64 BE, msgpack batch]``, the
seq counting batches from 0 per process, and a ROUTER answering
``[identity, "", start_seq]`` with every buffered batch from ``start_seq`` on,
then the ``ff``×8 end marker, in the 4-frame form (vLLM 0.32, SGLang 0.5.23) or
the older 3-frame one.

The msgspec structs below mirror the engines' own declarations, so the bytes
match theirs (the doc's §12 vectors are encoded by them in the tests):

- vLLM 0.32.0: tagged-map events with ``omit_defaults``, the batch an array
  ``[ts, events, data_parallel_rank]``; a store carries ``extra_keys`` (one nil
  per block), ``group_idx`` 0 and ``kv_cache_spec_kind`` as a real engine does;
- SGLang 0.5.23: one ``BlockStored`` per page, the rank always present (nil
  unless DP attention is on);
- ``legacy``: the older tag-first arrays.

It runs on whatever asyncio loop is current (plain asyncio, or trio-asyncio in
the daemon). Publishing never blocks (a PUB drops past its high-water mark);
the ROUTER is read with the same edge-triggered-FD discipline as the router's
subscriber (docs/stack.md §6), through ``loop.add_reader``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Literal, TypeVar

import msgspec
import trio
import zmq

from direct_frontend.simulator.kvcache import (
    CacheCleared,
    CacheEvent,
    RemovedBlocks,
    SimPrefixCache,
    StoredRun,
)

__all__ = [
    "KvEventPublisher",
    "PublisherKind",
    "SimKvEvents",
    "legacy_batch",
    "sglang_batch",
    "vllm_batch",
]

PublisherKind = Literal["vllm", "sglang", "legacy"]
_END_SEQ = b"\xff" * 8
_Hash = int | bytes


# -- vLLM: 0.32.0 (vllm/distributed/kv_events.py) and the legacy layout -----------
# The legacy layout is the older releases' tag-first arrays. Its events carry the
# fields vLLM's still begin with, declared as they were rather than with defaults
# (msgspec writes trailing defaults of array_like structs); this reproduces
# docs/kv-events.md §12.2. vLLM 0.32.0 writes tagged maps with ``omit_defaults``.


class _StoredFields(msgspec.Struct, gc=False):
    """The fields every vLLM layout's ``BlockStored`` begins with."""

    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _RemovedFields(msgspec.Struct, gc=False):
    """The fields every vLLM layout's ``BlockRemoved`` begins with."""

    block_hashes: list[_Hash]
    medium: str | None


class VllmBlockStored(_StoredFields, tag="BlockStored", omit_defaults=True):
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(_RemovedFields, tag="BlockRemoved", omit_defaults=True):
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    """A tagged map with no fields: SGLang 0.5.23 writes the same bytes."""


class LegacyBlockStored(_StoredFields, tag="BlockStored", array_like=True):
    pass


class LegacyBlockRemoved(_RemovedFields, tag="BlockRemoved", array_like=True):
    pass


class LegacyAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_Event = TypeVar("_Event")


class _EventBatch(msgspec.Struct, Generic[_Event], array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch, either layout: ``[ts, events, data_parallel_rank]`` (a nil rank left off)."""

    ts: float
    events: list[_Event]
    data_parallel_rank: int | None = None


VllmEventBatch = _EventBatch[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
LegacyEventBatch = _EventBatch[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


# -- SGLang 0.5.23 (sglang/srt/disaggregation/kv_events.py) --------------------


class SglangBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


SglangAllBlocksCleared = VllmAllBlocksCleared


class SglangEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | VllmAllBlocksCleared]
    attn_dp_rank: int | None = None  # always on the wire, nil when unset


_encode = msgspec.msgpack.encode


def vllm_batch(events: Sequence[CacheEvent], ts: float, rank: int | None = 0) -> bytes:
    """A vLLM 0.32.0 payload: removals one event per hash, stores as one event per run."""
    out = _translate(events, _vllm_stored, _vllm_removed, VllmAllBlocksCleared)
    return _encode(_EventBatch(ts, out, rank))


def sglang_batch(events: Sequence[CacheEvent], ts: float, rank: int | None = None) -> bytes:
    """An SGLang 0.5.23 payload: one store per page, each chained to the previous page."""
    out: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared] = _translate(
        events, _sglang_stored, _sglang_removed, SglangAllBlocksCleared
    )
    return _encode(SglangEventBatch(ts, out, rank))


def legacy_batch(events: Sequence[CacheEvent], ts: float, rank: int | None = 0) -> bytes:
    """The older tag-first array layout, vLLM's field order."""
    out = _translate(events, _legacy_stored, _legacy_removed, LegacyAllBlocksCleared)
    return _encode(_EventBatch(ts, out, rank))


def _translate(
    events: Sequence[CacheEvent],
    stored: Callable[[StoredRun], Iterable[_Event]],
    removed: Callable[[RemovedBlocks], Iterable[_Event]],
    cleared: Callable[[], _Event],
) -> list[_Event]:
    """A step's cache events in one layout's events, in order."""
    out: list[_Event] = []
    for event in events:
        if isinstance(event, StoredRun):
            out.extend(stored(event))
        elif isinstance(event, RemovedBlocks):
            out.extend(removed(event))
        elif isinstance(event, CacheCleared):
            out.append(cleared())
    return out


def _vllm_stored(run: StoredRun) -> tuple[VllmBlockStored]:
    """One store per run, with one nil extra key per block where no image keys it."""
    return (
        VllmBlockStored(
            block_hashes=run.block_hashes,
            parent_block_hash=run.parent_block_hash,
            token_ids=run.token_ids,
            block_size=run.block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=(run.extra_keys if any(run.extra_keys)
                        else [None] * len(run.block_hashes)),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    )


def _vllm_removed(blocks: RemovedBlocks) -> Iterator[VllmBlockRemoved]:
    return (VllmBlockRemoved([h], "GPU", group_idx=0) for h in blocks.block_hashes)


def _sglang_stored(run: StoredRun) -> Iterator[SglangBlockStored]:
    parent = run.parent_block_hash
    size = run.block_size
    for i, h in enumerate(run.block_hashes):
        assert isinstance(h, int) and (parent is None or isinstance(parent, int))
        page = run.token_ids[i * size : (i + 1) * size]
        yield SglangBlockStored([h], parent, page, size, None)
        parent = h


def _sglang_removed(blocks: RemovedBlocks) -> tuple[SglangBlockRemoved]:
    return (SglangBlockRemoved([h for h in blocks.block_hashes if isinstance(h, int)]),)


def _legacy_stored(run: StoredRun) -> tuple[LegacyBlockStored]:
    stored = LegacyBlockStored(
        run.block_hashes, run.parent_block_hash, run.token_ids, run.block_size, None, "GPU", None
    )
    return (stored,)


def _legacy_removed(blocks: RemovedBlocks) -> tuple[LegacyBlockRemoved]:
    return (LegacyBlockRemoved(list(blocks.block_hashes), "GPU"),)


_ENCODERS = {"vllm": vllm_batch, "sglang": sglang_batch, "legacy": legacy_batch}


@dataclasses.dataclass(eq=False)
class KvEventPublisher:
    """One engine rank's PUB socket and replay ROUTER.

    ``port`` / ``replay_port`` 0 pick free ports (see :attr:`port`,
    :attr:`replay_port`); ``replay_port`` None serves no replay. ``dp_rank`` is
    stamped on every batch (vLLM always names its rank; SGLang without DP
    attention sends nil: pass None). ``replay_frames`` selects the reply form
    (4: current engines, 3: older ones). ``buffer_steps`` batches are kept for
    replay. Test helpers: :meth:`drop_next` loses batches on the PUB only (a
    forced gap the replay can fill), :meth:`forget_history` empties the replay
    buffer (history loss).
    """

    kind: PublisherKind
    _: dataclasses.KW_ONLY
    host: str = "127.0.0.1"
    port: int = 0
    replay_port: int | None = None
    topic: bytes = b""
    buffer_steps: dataclasses.InitVar[int] = 10_000
    hwm: int = 100_000
    dp_rank: int | None = 0
    replay_frames: Literal[3, 4] = 4
    #: batches published (those :meth:`drop_next` held back included)
    published: int = dataclasses.field(default=0, init=False)
    #: replay requests answered
    replay_requests: int = dataclasses.field(default=0, init=False)

    def __post_init__(self, buffer_steps: int) -> None:
        if self.kind not in _ENCODERS:
            raise ValueError(f"unknown KV event publisher kind {self.kind!r}")
        self._encode = _ENCODERS[self.kind]
        self._seq = 0
        self._drop = 0
        self._history: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_steps
        )
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader_fd: int | None = None

    @property
    def endpoint(self) -> str:
        """Where a subscriber connects."""
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        """Where a replay DEALER connects, or None."""
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry."""
        return self._seq

    def start(self) -> None:
        """Bind both sockets; replay is served once the current asyncio loop runs.

        A fresh context per publisher, so :meth:`close` can release the ports at
        once and a restarted engine can bind them again.
        """
        if self._context is not None:
            raise RuntimeError("the publisher is already running")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            self.port = _bind(pub, self.host, self.port)
            if self.replay_port is not None:
                router = context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 0)  # never drop part of a replay
                self.replay_port = _bind(router, self.host, self.replay_port)
                self._router = router
                self._loop = asyncio.get_running_loop()
                self._task = self._loop.create_task(self._serve_replay(router))
        except BaseException:
            context.destroy(linger=0)
            self._router = None
            raise
        self._context, self._pub = context, pub

    def close(self) -> None:
        """Close both sockets and release the ports now (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._unwatch()
        if self._router is not None:
            _notify_closing(self._router.fileno())
        if self._context is not None:
            self._context.destroy(linger=0)
        self._context = self._pub = self._router = None

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Publish one batch (one engine step); returns its seq."""
        seq = self._seq
        self._seq += 1
        payload = self._encode(events, time.time(), self.dp_rank)
        self._history.append((seq, payload))
        self.published += 1
        if self._drop:
            self._drop -= 1
            return seq
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):  # past the high-water mark: dropped, as on PUB
                self._pub.send_multipart(
                    [self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK
                )
        return seq

    # -- test helpers ------------------------------------------------------------

    def drop_next(self, count: int = 1) -> None:
        """Do not send the next ``count`` batches live; keep them for replay (a gap)."""
        self._drop += count

    def forget_history(self) -> None:
        """Empty the replay buffer, as if it had wrapped (history loss)."""
        self._history.clear()

    def reset_sequence(self) -> None:
        """Start over at seq 0 with an empty replay buffer (a restarted process)."""
        self._seq = 0
        self._history.clear()
        self._drop = 0

    # -- replay ------------------------------------------------------------------

    async def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        n = 0
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if not int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    await self._wait_readable(router.fileno())
                continue
            self._answer(router, frames)
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            return  # "Invalid replay request": the engines log it and do not answer
        identity = frames[0]
        start = int.from_bytes(frames[2], "big")
        self.replay_requests += 1
        four = self.replay_frames == 4
        for seq, payload in list(self._history):
            if seq < start:
                continue
            seq_frame = seq.to_bytes(8, "big")
            if four:
                router.send_multipart([identity, b"", self.topic, seq_frame, payload])
            else:
                router.send_multipart([identity, b"", seq_frame, payload])
        if four:
            router.send_multipart([identity, b"", b"", _END_SEQ, b""])
        else:
            router.send_multipart([identity, b"", _END_SEQ, b""])

    async def _wait_readable(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        self._reader_fd = fd
        try:
            await ready
        finally:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._reader_fd is not None and self._loop is not None:
            with contextlib.suppress(Exception):  # the loop may already be closed
                self._loop.remove_reader(self._reader_fd)
        self._reader_fd = None


def _notify_closing(fd: int) -> None:
    """Under trio-asyncio a Trio task may still wait on the fd: wake it before it closes."""
    with contextlib.suppress(RuntimeError):  # plain asyncio: no Trio run, nothing to wake
        trio.lowlevel.notify_closing(fd)


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> int:
    if port == 0:
        return int(sock.bind_to_random_port(f"tcp://{host}"))
    sock.bind(f"tcp://{host}:{port}")
    return port


class SimKvEvents:
    """One engine rank's prefix cache and, optionally, its KV-event publisher, with their lifecycle.

    :meth:`start` is a process start: the cache is empty and the seq begins at
    0, on the same ports as before after the first start (a restarted engine).
    TRT-LLM's KV-event layout is unconfirmed (docs/kv-events.md §11.3), so only
    vLLM and SGLang engines publish; every kind gets the cache.

    Rank ``rank`` of ``dp_size`` publishes on ``events_port + rank`` and replays
    on ``replay_port + rank``, as vLLM and SGLang offset their endpoints by the
    rank (0 still picks a free port), and stamps its rank on its batches (SGLang
    only with more than one rank, as under DP attention; nil otherwise).
    """

    def __init__(
        self,
        kind: str,
        cache: SimPrefixCache,
        *,
        events_port: int | None = None,
        replay_port: int | None = None,
        rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if events_port is None and replay_port is not None:
            raise ValueError("kv_replay_port needs kv_events_port")
        if events_port is not None and kind not in ("vllm", "sglang"):
            raise ValueError(f"a simulated {kind} engine publishes no KV events")
        self.kind = kind
        self.cache = cache
        self.events_port = _offset(events_port, rank)
        self.replay_port = _offset(replay_port, rank)
        self.rank = rank
        self.stamp: int | None = None if kind == "sglang" and dp_size == 1 else rank
        self.publisher: KvEventPublisher | None = None

    def start(self, host: str) -> None:
        """Start empty; bind the publisher if one is configured (on the running loop)."""
        self.cache.reset()
        if self.events_port is None:
            return
        kind: PublisherKind = "sglang" if self.kind == "sglang" else "vllm"
        publisher = KvEventPublisher(
            kind, host=host, port=self.events_port, replay_port=self.replay_port,
            dp_rank=self.stamp,
        )
        publisher.start()
        self.events_port, self.replay_port = publisher.port, publisher.replay_port
        self.publisher = publisher
        self.cache.sink = publisher.publish

    def close(self) -> None:
        """Stop publishing and release the ports."""
        self.cache.sink = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


def _offset(port: int | None, rank: int) -> int | None:
    """A rank's port: the base plus the rank (None stays off, 0 stays "any free port")."""
    return port + rank if port else port

"""The Trio KV-event subscriber over real loopback sockets.

The publisher is the simulator's (a real PUB plus a replay ROUTER on the
trio-asyncio loop, as in the daemon), or a bare PUB for malformed input. Every
wait polls a condition with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import contextlib
import functools
import random
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import trio
import trio_asyncio
import zmq

from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.subscriber import KvSubscription, run_kv_subscriber
from direct_frontend.simulator.kv_publisher import KvEventPublisher, PublisherKind, vllm_batch
from direct_frontend.simulator.kvcache import CacheCleared, StoredRun
from tests.support.sim import run_trio as run
from tests.support.sim import until_trio as until

BS = 4


def tokens_of(i: int) -> list[int]:
    """One block of tokens unique to batch ``i``."""
    return [i * BS + k + 1 for k in range(BS)]


def block(i: int) -> StoredRun:
    return StoredRun([i + 1], None, tokens_of(i), BS)


@contextlib.asynccontextmanager
async def publishing(
    kind: PublisherKind = "vllm", **options: Any
) -> AsyncIterator[KvEventPublisher]:
    options.setdefault("replay_port", 0)
    pub = KvEventPublisher(kind, **options)

    async def start() -> None:
        pub.start()  # binds, and starts the replay task on the asyncio loop

    await trio_asyncio.aio_as_trio(start)()
    try:
        yield pub
    finally:
        pub.close()


class Subscribed:
    """A running subscriber and what it reported."""

    def __init__(
        self, sub: KvSubscription, malformed: list[str], clears: list[str], restarts: list[str],
        lags: list[float],
    ) -> None:
        self.sub = sub
        self.malformed = malformed
        self.clears = clears
        self.restarts = restarts  # engine ids, one per publisher restart
        self.lags = lags  # seconds, one per live batch applied


@contextlib.asynccontextmanager
async def subscribed(
    index: KvIndex,
    endpoint: str,
    replay_endpoint: str | None,
    **options: Any,
) -> AsyncIterator[Subscribed]:
    malformed: list[str] = []
    clears: list[str] = []
    restarts: list[str] = []
    lags: list[float] = []
    async with trio.open_nursery() as nursery:
        sub = await nursery.start(
            functools.partial(
                run_kv_subscriber,
                "e",
                endpoint,
                replay_endpoint,
                index,
                BS,
                on_malformed=malformed.append,
                on_clear=lambda engine, reason: clears.append(reason),
                on_restart=restarts.append,
                on_lag=lags.append,
                **options,
            )
        )
        yield Subscribed(sub, malformed, clears, restarts, lags)
        nursery.cancel_scope.cancel()


def indexed(index: KvIndex, *batches: int) -> bool:
    return all(index.lookup(tokens_of(i)) == {"e": 1} for i in batches)


async def warm_up(pub: KvEventPublisher, s: Subscribed) -> None:
    """Publish until one live message got through: the subscription is in place."""
    while s.sub.messages == 0:
        pub.publish([block(pub.next_seq)])
        await trio.sleep(0.005)
    await until(lambda: s.sub.tracker.next_seq == pub.next_seq, what="caught up")


@contextlib.asynccontextmanager
async def history_then_subscribed(
    index: KvIndex,
) -> AsyncIterator[tuple[KvEventPublisher, Subscribed]]:
    """An engine that cached five blocks (seqs 0–4) before we subscribed, then went quiet."""
    async with publishing() as pub:
        for i in range(5):
            pub.publish([block(i)])
        async with subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            yield pub, s


def test_startup_replay_indexes_an_idle_engines_history() -> None:
    """An engine that cached blocks before we subscribed, then went quiet."""

    async def body() -> None:
        index = KvIndex(BS)
        async with history_then_subscribed(index) as (_, s):
            await until(lambda: indexed(index, 0, 1, 2, 3, 4), what="history replayed")
            assert s.sub.replay_messages == 5 and s.sub.tracker.next_seq == 5
            assert s.clears == ["start"] and s.malformed == []

    run(body)


def test_live_batches_report_their_lag_and_replayed_ones_do_not() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with history_then_subscribed(index) as (pub, s):
            await until(lambda: s.sub.tracker.state == "live" and indexed(index, 0, 4),
                        what="history replayed")
            assert s.lags == []  # catching up is not lag
            await warm_up(pub, s)  # (what waited for the replay is not lag either)
            live = len(s.lags)
            before = time.time()
            last = pub.publish([block(pub.next_seq)])
            await until(functools.partial(indexed, index, last), what="a live batch")
            after = time.time()
            assert len(s.lags) == live + 1
            assert 0.0 <= s.lags[-1] <= after - before  # stamped at publish, after `before`

    run(body)


@contextlib.contextmanager
def bare_pub() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """A PUB socket on a free loopback port, no publisher logic (the test sends each frame)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    try:
        yield pub, pub.bind_to_random_port("tcp://127.0.0.1")
    finally:
        pub.close(linger=0)


def send_batch(pub: zmq.Socket[bytes], seq: int, stamp: float) -> None:
    """One vLLM batch of one block (``block(seq)``) stamped ``stamp``, under ``seq``."""
    pub.send_multipart([b"", seq.to_bytes(8, "big"), vllm_batch([block(seq)], stamp)])


def test_lag_is_from_the_batchs_stamp_and_never_negative() -> None:
    """A batch stamped in the past (a slow or skewed engine), and one stamped in the future."""

    async def body() -> None:
        index = KvIndex(BS)
        with bare_pub() as (pub, port):
            async with subscribed(index, f"tcp://127.0.0.1:{port}", None) as s:
                seq = 0
                while s.sub.messages == 0:  # until the SUB is connected; stamped now
                    send_batch(pub, seq, time.time())
                    seq += 1
                    await trio.sleep(0.005)
                await until(lambda: s.sub.tracker.next_seq == seq, what="caught up")
                seen = len(s.lags)
                assert seen >= 1 and all(lag >= 0.0 for lag in s.lags)
                stamped = time.time() - 30.0
                send_batch(pub, seq, stamped)
                send_batch(pub, seq + 1, time.time() + 3600.0)
                await until(functools.partial(indexed, index, seq, seq + 1), what="both")
                late, early = s.lags[seen:]
                assert 30.0 <= late <= time.time() - stamped
                assert early == 0.0

    run(body)


def test_flood_arrives_whole_without_gaps_or_starving_trio() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        lateness: list[float] = []

        async def heartbeat() -> None:
            while True:
                start = trio.current_time()
                await trio.sleep(0.005)
                lateness.append(trio.current_time() - start - 0.005)

        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            gaps = s.sub.tracker.stats.gaps
            first = pub.next_seq
            total = 30_000
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(heartbeat)
                for i in range(first, first + total):
                    pub.publish([block(i)])
                    if i % 2000 == 0:
                        await trio.lowlevel.checkpoint()
                await until(
                    lambda: s.sub.tracker.next_seq == pub.next_seq, within=60, what="flood"
                )
                nursery.cancel_scope.cancel()
            flood = trio.current_time() - started
            assert s.sub.tracker.stats.gaps == gaps  # nothing lost under the flood
            assert s.sub.tracker.stats.replays_requested <= 2  # start-up + a warm-up gap
            assert indexed(index, first, first + total // 2, first + total - 1)
            assert len(index) == pub.next_seq
            # a subscriber that held the loop for the flood would make one beat as late as the
            # flood is long; a loaded machine makes every beat later, and the flood longer
            assert len(lateness) >= 10 and max(lateness) < max(0.5, flood / 4), (
                max(lateness), flood)

    run(body, timeout=120)


def test_slow_trickle_delivers_every_batch_promptly() -> None:
    """The edge-triggered FD: a naive loop would hang on one of these."""

    async def body() -> None:
        index = KvIndex(BS)
        rng = random.Random(3)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            gaps = s.sub.tracker.stats.gaps
            for _ in range(150):
                i = pub.next_seq
                pub.publish([block(i)])
                await until(functools.partial(indexed, index, i), within=2.0, what=f"batch {i}")
                await trio.sleep(rng.uniform(0, 0.003))
            assert s.sub.tracker.stats.gaps == gaps

    run(body)


def test_a_gap_is_filled_by_replay_in_order() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            before = pub.next_seq
            gaps = s.sub.tracker.stats.gaps
            pub.drop_next(3)  # lost on the PUB, kept in the replay buffer
            for i in range(before, before + 6):
                pub.publish([block(i)])
            await until(lambda: s.sub.tracker.next_seq == pub.next_seq, what="gap filled")
            assert indexed(index, *range(before + 6))
            assert s.sub.tracker.stats.gaps == gaps + 1
            assert "history_lost" not in s.clears and "gap" not in s.clears

    run(body)


def test_the_older_three_frame_replay_form_works() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing(replay_frames=3) as pub:
            for i in range(3):
                pub.publish([block(i)])
            async with subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
                await until(lambda: indexed(index, 0, 1, 2), what="3-frame replay")
                pub.drop_next(1)
                pub.publish([block(3)])
                pub.publish([block(4)])
                await until(lambda: indexed(index, 3, 4), what="3-frame gap fill")
                assert s.malformed == []

    run(body)


def test_a_gap_without_replay_clears_and_carries_on() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing(replay_port=None) as pub, subscribed(index, pub.endpoint, None) as s:
            await warm_up(pub, s)
            before = pub.next_seq - 1
            assert indexed(index, before)
            pub.drop_next(1)
            pub.publish([block(pub.next_seq)])
            after = pub.next_seq
            pub.publish([block(after)])
            await until(lambda: indexed(index, after), what="after the gap")
            assert not indexed(index, before)  # the gap cleared what came before
            assert "gap" in s.clears

    run(body)


def test_history_loss_clears_then_applies_what_is_left() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            old = pub.next_seq - 1
            pub.drop_next(1)
            pub.publish([block(pub.next_seq)])
            pub.forget_history()  # the ring buffer wrapped past the missing batch
            last = pub.next_seq
            pub.publish([block(last)])
            await until(lambda: indexed(index, last), what="post-loss batch")
            assert "history_lost" in s.clears
            assert not indexed(index, old)
            assert s.sub.tracker.stats.history_lost == 1

    run(body)


def test_a_sequence_reset_is_a_restart() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            old = pub.next_seq - 1
            pub.reset_sequence()
            pub.publish([block(1000)])  # seq 0 again
            await until(lambda: indexed(index, 1000), what="new incarnation")
            assert not indexed(index, old)
            assert s.clears[-1] == "restart" and s.sub.tracker.stats.restarts == 1
            assert s.restarts == ["e"] and s.sub.publisher_restarts == 1

    run(body)


def test_a_publisher_back_on_its_port_after_a_drop_is_a_new_one() -> None:
    """A killed engine relaunched on the same ports: the drop and the return are one restart."""

    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            assert s.restarts == [] and s.sub.publisher_restarts == 0  # connecting is no restart
            old = pub.next_seq - 1
            pub.close()
            await until(lambda: not s.sub.connected, what="the drop")
            assert s.restarts == [] and not indexed(index, old)  # gone, not restarted (yet)
            async with publishing(port=pub.port, replay_port=pub.replay_port) as new:
                await until(lambda: s.sub.connected, what="the reconnection")
                await until(lambda: s.sub.tracker.state == "live", what="replayed from 0")
                new.publish([block(2000)])  # seq 0: in order after the resync, no second restart
                while not indexed(index, 2000):  # (a slow joiner may miss it: replay fills gaps)
                    new.publish([block(3000 + new.next_seq)])
                    await trio.sleep(0.005)
            assert s.restarts == ["e"] and s.sub.publisher_restarts == 1
            assert s.sub.tracker.stats.restarts == 0

    run(body)


def test_all_blocks_cleared_empties_the_engine() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            assert len(index) > 0
            pub.publish([CacheCleared()])
            pub.publish([block(500)])
            await until(lambda: indexed(index, 500), what="after the clear")
            assert len(index) == 1 and s.sub.tracker.stats.clears == 1  # only the start

    run(body)


def test_resync_rebuilds_from_the_replay_buffer() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        async with publishing() as pub, subscribed(index, pub.endpoint, pub.replay_endpoint) as s:
            await warm_up(pub, s)
            n = len(index)
            index.clear_engine("e")
            s.sub.resync()
            await until(lambda: len(index) == n, what="rebuilt")
            assert s.clears.count("start") == 2

    run(body)


def test_a_silent_replay_endpoint_times_out_and_live_events_still_flow() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        with socket.socket() as silent:  # accepts TCP, never speaks ZMTP: replies never come
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
            async with publishing(replay_port=None) as pub, subscribed(
                index, pub.endpoint, dead, replay_timeout=0.1
            ) as s:
                await until(
                    lambda: s.sub.tracker.stats.replay_failures == 1, what="gave up on replay"
                )
                assert s.sub.tracker.stats.replay_timeouts == 3
                await warm_up(pub, s)
                assert indexed(index, pub.next_seq - 1)

    run(body)


def test_malformed_messages_are_counted_and_skipped() -> None:
    async def body() -> None:
        index = KvIndex(BS)
        with bare_pub() as (pub, port):
            seq = 0

            def send_good() -> int:
                nonlocal seq
                send_batch(pub, seq, 0.0)
                seq += 1
                return seq - 1

            async with subscribed(index, f"tcp://127.0.0.1:{port}", None) as s:
                while s.sub.messages == 0:
                    send_good()
                    await trio.sleep(0.005)
                pub.send_multipart([b"", seq.to_bytes(8, "big")])  # two frames
                pub.send_multipart([b"", b"\x00", b"x"])  # short seq
                pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1"])  # bad payload
                seq += 1  # that one had a valid seq: the tracker steps past it
                last = send_good()
                await until(lambda: indexed(index, last), what="good message after bad ones")
                assert len(s.malformed) == 3 and set(s.malformed) == {"e"}
                assert s.sub.malformed == 3 and "gap" not in s.clears

    run(body)


def test_the_page_size_must_be_one_the_index_can_re_cut() -> None:
    async def body() -> None:
        try:
            await run_kv_subscriber(
                "e", "tcp://127.0.0.1:1", None, KvIndex(16), 24, on_malformed=lambda e: None
            )
        except ValueError as exc:
            assert "page size 24" in str(exc)
        else:
            raise AssertionError("a page size that cannot be re-cut accepted")

    run(body)

"""The engine transport's hot path: the batched message reader (engines/grpclib_reader.py),
its gate, and the pump's fallback to grpclib's own reads."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpclib.client
import grpclib.protocol
import pytest
import trio
import trio_asyncio
from grpclib.encoding.proto import ProtoCodec
from grpclib.protocol import Buffer
from grpclib.utils import Wrapper
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.settings import SettingCodes

from direct_frontend.engines import grpclib_reader, transport
from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.sglang import SglangDialect
from direct_frontend.engines.grpclib_reader import MessageReader
from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.engines.transport import BATCH_MAX, EngineChannel, EventReceiver
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.observability.shims import shims_active
from direct_frontend.protos import sglang_scheduler_pb2 as pb
from direct_frontend.simulator import EngineConfig, SimEngine
from direct_frontend.text.prompt_ids import PromptIds
from tests.support.daemon import Daemon, fleet_text, free_port, running_daemon, sim_engine
from tests.support.http import http
from tests.support.metrics import sample
from tests.support.sim import EOS, HOST, VOCAB, run_trio, started_from_trio

FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}


# -- MessageReader on a real grpclib receive buffer -----------------------------------------


def _messages(n: int) -> list[pb.GenerateResponse]:
    out = []
    for i in range(n):
        m = pb.GenerateResponse()
        m.chunk.token_ids.extend(range(i % 7 + 1))  # varying sizes
        m.chunk.completion_tokens = i
        out.append(m)
    return out


def _wire(messages: list[pb.GenerateResponse]) -> bytes:
    parts = []
    for m in messages:
        body = m.SerializeToString()
        parts.append(b"\0" + len(body).to_bytes(4, "big") + body)
    return b"".join(parts)


def _fake_call(buffer: Buffer) -> Any:
    return SimpleNamespace(
        _stream=SimpleNamespace(buffer=buffer), _wrapper=Wrapper(), _codec=ProtoCodec(),
        _recv_type=pb.GenerateResponse,
    )


@pytest.mark.parametrize("seed", range(8))
def test_reader_cuts_messages_at_any_chunk_boundary(seed: int) -> None:
    """DATA frames split and join messages arbitrarily; every message comes out once, in order,
    and every received byte is acked exactly once."""
    rng = random.Random(seed)
    messages = _messages(200)
    wire = _wire(messages)
    acked: list[int] = []
    sent: list[int] = []

    async def main() -> list[pb.GenerateResponse]:
        buffer = Buffer(acked.append)
        reader = MessageReader.attach(_fake_call(buffer))
        assert reader is not None
        got: list[pb.GenerateResponse] = []

        async def feed() -> None:
            pos = 0
            while pos < len(wire):
                size = rng.choice([1, 2, 5, 6, 17, 60, 400])
                chunk = wire[pos : pos + size]
                sent.append(len(chunk) + rng.choice([0, 0, 3]))  # padding counts too
                buffer.add(chunk, sent[-1])
                pos += size
                if rng.random() < 0.5:
                    await asyncio.sleep(0)
            buffer.eof()

        feeder = asyncio.ensure_future(feed())
        while (batch := await reader.batch(rng.choice([1, 3, 64]))) is not None:
            got.extend(batch)
        await feeder
        return got

    got = asyncio.run(main())
    assert got == messages
    assert sum(acked) == sum(sent)  # every chunk acked once, with its padding
    assert len(acked) < len(sent)  # ...and mostly several at once


def test_reader_reports_a_truncated_last_message_like_grpclib() -> None:
    wire = _wire(_messages(3))[:-2]

    async def main() -> None:
        buffer = Buffer(lambda size: None)
        reader = MessageReader.attach(_fake_call(buffer))
        assert reader is not None
        buffer.add(wire, len(wire))
        buffer.eof()
        assert len(await reader.batch(64) or []) == 2
        with pytest.raises(AssertionError, match="less data"):
            await reader.batch(64)

    asyncio.run(main())


def test_reader_wait_is_interrupted_by_the_wrapper_like_grpclib() -> None:
    """A lost connection cancels grpclib's wrapper: a reader waiting for data sees its error."""

    async def main() -> None:
        buffer = Buffer(lambda size: None)
        call = _fake_call(buffer)
        reader = MessageReader.attach(call)
        assert reader is not None
        waiting = asyncio.ensure_future(reader.batch(64))
        await asyncio.sleep(0)
        call._wrapper.cancel(ConnectionResetError("gone"))
        with pytest.raises(ConnectionResetError):
            await waiting

    asyncio.run(main())


def test_reader_decodes_with_any_grpclib_codec() -> None:
    """Our ProtoCodec short-cut aside, the reader decodes with the call's own codec."""
    decoded: list[bytes] = []

    class Recording(ProtoCodec):
        def decode(self, data: bytes, message_type: Any) -> Any:
            decoded.append(data)
            return super().decode(data, message_type)

    messages = _messages(5)
    wire = _wire(messages)

    async def main() -> list[Any]:
        buffer = Buffer(lambda size: None)
        call = _fake_call(buffer)
        call._codec = Recording()
        reader = MessageReader.attach(call)
        assert reader is not None
        buffer.add(wire, len(wire))
        buffer.eof()
        return await reader.batch(64) or []

    assert asyncio.run(main()) == messages
    assert len(decoded) == 5


def test_reader_refuses_a_grpclib_without_the_expected_internals(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A call unlike the gate promised: grpclib reads it, and the shim is off from then on."""
    monkeypatch.setattr(grpclib_reader, "STATUS", grpclib_reader.STATUS)  # restored after
    assert grpclib_reader.STATUS.active
    with caplog.at_level(logging.WARNING, logger="direct_frontend.shims"):
        assert MessageReader.attach(SimpleNamespace()) is None
        call = _fake_call(Buffer(lambda size: None))
        call._stream.buffer._unacked = []  # not an asyncio.Queue
        assert MessageReader.attach(call) is None
    assert not grpclib_reader.STATUS.active
    assert grpclib_reader.STATUS.reason.endswith("a stream's call differs from what it reads")
    assert len(caplog.records) == 1  # said once
    assert MessageReader.attach(_fake_call(Buffer(lambda size: None))) is None  # off for good
    [report] = [s for s in shims_active() if s.shim == "grpclib_reader"]
    assert report == grpclib_reader.STATUS


# -- the gate: a checked grpclib release and the internals' shape ------------------------------


def test_the_reader_is_on_for_the_installed_grpclib() -> None:
    version = importlib.metadata.version("grpclib")
    assert version in grpclib_reader.CHECKED
    assert grpclib_reader.check() == grpclib_reader.STATUS
    assert grpclib_reader.STATUS.active and grpclib_reader.STATUS.reason == f"grpclib {version}"


def test_a_grpclib_release_outside_the_allow_list_turns_the_reader_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grpclib_reader, "CHECKED", ("0.4.0",))
    status = grpclib_reader.check()
    assert not status.active and "not a release it was checked against (0.4.0)" in status.reason
    monkeypatch.setattr(grpclib_reader, "STATUS", status)
    assert MessageReader.attach(_fake_call(Buffer(lambda size: None))) is None
    assert [s for s in shims_active() if s.shim == "grpclib_reader"] == [status]


def test_a_receive_buffer_of_another_shape_turns_the_reader_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class NoEndMarker(Buffer):
        def eof(self) -> None:  # a grpclib that flags the end without queueing a marker
            self._eof = True

    monkeypatch.setattr(grpclib.protocol, "Buffer", NoEndMarker)
    status = grpclib_reader.check()
    assert not status.active and status.reason.endswith("queues received data differently")


def test_a_client_stream_of_another_shape_turns_the_reader_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Renamed:  # a grpclib whose client stream keeps its parts under other names
        def __init__(self) -> None:
            self._codec = self._recv_type = self._h2_stream = None

    monkeypatch.setattr(grpclib.client, "Stream", Renamed)
    status = grpclib_reader.check()
    assert not status.active
    assert status.reason.endswith("grpclib's streams no longer use _stream, _wrapper")


# -- send_framed: a large request's DATA frames -------------------------------------------


def _h2_stream(frame_size: int) -> Any:
    """A client HTTP/2 stream as grpclib holds one (its connection after the server's
    settings, HEADERS sent), writing to a list."""
    client = H2Connection(H2Configuration(client_side=True))
    server = H2Connection(H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({SettingCodes.MAX_FRAME_SIZE: frame_size,
                            SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    server.increment_flow_control_window(1 << 20)
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    client.send_headers(1, [(":method", "POST"), (":path", "/p"), (":scheme", "http"),
                            (":authority", "a")])
    written: list[bytes] = [client.data_to_send()]
    event = asyncio.Event()
    event.set()
    connection = SimpleNamespace(write_ready=event, data_sent=0,
                                 data_send_process=lambda: None)
    return SimpleNamespace(id=1, _h2_connection=client, connection=connection, data_sent=0,
                           window_updated=asyncio.Event(),
                           _transport=SimpleNamespace(write=written.append), written=written,
                           server=server)


@pytest.mark.parametrize("size", [100, 16_384, 2 * 16_384, 2 * 16_384 + 1, 5 * 16_384,
                                  5 * 16_384 + 7, 300_000])
@pytest.mark.parametrize("frame_size", [16_384, 20_000])
def test_framed_data_is_what_h2_would_send_frame_by_frame(size: int, frame_size: int) -> None:
    """The same bytes on the wire as grpclib's own loop, and the same flow-control windows
    after it, for messages of one frame to many."""
    data = random.Random(size).randbytes(size)
    ours, theirs = _h2_stream(frame_size), _h2_stream(frame_size)
    asyncio.run(grpclib_reader.send_framed(ours, data, end_stream=True))
    asyncio.run(grpclib.protocol.Stream.send_data(theirs, data, end_stream=True))
    assert b"".join(ours.written) == b"".join(theirs.written)
    for stream in (ours, theirs):
        conn = stream._h2_connection
        assert (conn.outbound_flow_control_window, conn.streams[1].outbound_flow_control_window,
                stream.data_sent) == (
            theirs._h2_connection.outbound_flow_control_window,
            theirs._h2_connection.streams[1].outbound_flow_control_window, size)
    assert ours._h2_connection.streams[1].state_machine.state == \
        theirs._h2_connection.streams[1].state_machine.state


def test_a_message_beyond_the_window_waits_for_it_as_grpclib_does() -> None:
    """More than the flow-control window allows: grpclib's own loop, which sends what the
    window allows and waits for it to open."""
    stream = _h2_stream(16_384)
    conn = stream._h2_connection
    window = conn.local_flow_control_window(1)
    data = bytes(window + 40_000)

    async def main() -> None:
        sending = asyncio.ensure_future(grpclib_reader.send_framed(stream, data, True))
        await asyncio.sleep(0.01)
        assert not sending.done() and stream.data_sent == window  # the window, then waits
        server = stream.server  # the peer reads it all and opens both windows
        server.receive_data(b"".join(stream.written))
        server.increment_flow_control_window(1 << 20)
        server.increment_flow_control_window(1 << 20, stream_id=1)
        conn.receive_data(server.data_to_send())
        stream.window_updated.set()  # (what grpclib does on the WINDOW_UPDATE)
        await asyncio.wait_for(sending, 5)

    asyncio.run(main())
    assert stream.data_sent == len(data)


# -- one_write: a call's HEADERS and DATA in one socket write ---------------------------------


def _one_write_play(body: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[bytes], bytes]:
    """Run ``body(channel, transport, writes)`` on a real asyncio socket transport; the
    transport's own writes (as grpclib would make them) and the bytes the peer read."""
    writes: list[bytes] = []

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        ours, peer = socket.socketpair()
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
        real = type(transport).write

        def counting(self: Any, data: bytes) -> None:
            writes.append(bytes(data))
            real(self, data)

        monkeypatch.setattr(type(transport), "write", counting)
        channel = SimpleNamespace(_protocol=SimpleNamespace(
            connection=SimpleNamespace(_transport=transport)))
        await body(channel, transport, writes)
        await asyncio.sleep(0)
        transport.close()
        peer.setblocking(False)
        received = b""
        while True:
            try:
                chunk = peer.recv(65536)
            except BlockingIOError:
                await asyncio.sleep(0.001)
                continue
            if not chunk:
                break
            received += chunk
        peer.close()
        return received

    received = asyncio.run(main())
    return writes, received


def test_writes_of_a_send_go_out_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(channel: Any, transport: Any, writes: list[bytes]) -> None:
        async def send() -> int:
            transport.write(b"HEADERS")
            transport.write(b"DATA")
            return 7

        assert await grpclib_reader.one_write(channel, send()) == 7
        assert "write" not in vars(transport)  # the transport's own write again
        transport.write(b"after")

    writes, received = _one_write_play(body, monkeypatch)
    assert writes == [b"HEADERSDATA", b"after"]
    assert received == b"HEADERSDATAafter"


def test_a_send_that_suspends_lets_its_writes_out_first(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(channel: Any, transport: Any, writes: list[bytes]) -> None:
        async def send() -> str:
            transport.write(b"one")
            transport.write(b"two")
            await asyncio.sleep(0)  # e.g. waiting for flow control: nothing stays held
            assert writes == [b"onetwo"]
            transport.write(b"three")
            await asyncio.sleep(0)
            return "sent"

        assert await grpclib_reader.one_write(channel, send()) == "sent"

    writes, received = _one_write_play(body, monkeypatch)
    assert writes == [b"onetwo", b"three"] and received == b"onetwothree"


def test_a_cancelled_send_is_cancelled_inside_and_leaves_nothing_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []

    async def body(channel: Any, transport: Any, writes: list[bytes]) -> None:
        async def send() -> None:
            transport.write(b"held")
            try:
                await asyncio.get_running_loop().create_future()  # never done
            except asyncio.CancelledError:
                seen.append("cancelled inside")
                raise

        task = asyncio.ensure_future(grpclib_reader.one_write(channel, send()))
        await asyncio.sleep(0)
        assert writes == [b"held"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "write" not in vars(transport)

    _, received = _one_write_play(body, monkeypatch)
    assert seen == ["cancelled inside"] and received == b"held"


def test_nothing_is_held_with_the_shim_off_or_no_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body(channel: Any, transport: Any, writes: list[bytes]) -> None:
        async def send() -> None:
            transport.write(b"b")
            transport.write(b"c")

        await grpclib_reader.one_write(SimpleNamespace(_protocol=None), send())
        monkeypatch.setattr(grpclib_reader, "STATUS", grpclib_reader.ShimStatus(
            grpclib_reader.SHIM, False, "off"))
        await grpclib_reader.one_write(channel, send())

    writes, received = _one_write_play(body, monkeypatch)
    assert writes == [b"b", b"c", b"b", b"c"] and received == b"bcbc"


# -- EventReceiver: batches in, events out ----------------------------------------------------


def test_receiver_hands_out_batched_events_in_order_then_the_error() -> None:
    async def main() -> None:
        tx, rx = trio.open_memory_channel[transport.StreamItem](10)
        receiver = EventReceiver(rx)
        error = EngineError(ErrorKind.INTERNAL, "boom")
        tx.send_nowait([1, 2, 3])  # type: ignore[list-item]
        tx.send_nowait([4])  # type: ignore[list-item]
        tx.send_nowait(error)
        assert await receiver.receive() == 1
        assert receiver.receive_nowait() == 2
        assert await receiver.receive() == 3
        assert receiver.receive_nowait() == 4
        with pytest.raises(EngineError):
            receiver.receive_nowait()
        assert receiver.error is error
        tx.close()
        assert await receiver.receive() is None
        assert receiver.receive_nowait() is None

    trio.run(main)


# -- end to end, with and without the fast paths ----------------------------------------------


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", **FAST, context_length=4096)])
    with running_daemon(tmp_path_factory.mktemp("transport"), text) as d:
        d.wait_serving(1)
        yield d


def _completion(daemon: Daemon, max_tokens: int, stream: bool) -> tuple[str, int]:
    body = {"model": "demo", "prompt": "The sea", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if not stream:
        r = http.post(daemon.url + "/v1/completions", json=body, timeout=30)
        r.raise_for_status()
        data = r.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    text, usage = [], 0
    with http.stream("POST", daemon.url + "/v1/completions", json=body, timeout=30) as r:
        r.raise_for_status()
        import json

        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text.append(choice["text"])
    return "".join(text), usage


def test_long_streams_match_the_non_streaming_answer(daemon: Daemon) -> None:
    """Hundreds of messages per stream go through the batched reader (many per batch)."""
    for tokens in (1, 64, 700):
        streamed, usage = _completion(daemon, tokens, stream=True)
        whole, whole_usage = _completion(daemon, tokens, stream=False)
        assert usage == whole_usage == tokens
        assert streamed == whole


def test_the_public_grpclib_path_gives_the_same_answers(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With grpclib internals the reader does not know, the pump iterates grpclib's stream."""
    expected = _completion(daemon, 200, stream=True)
    used: list[bool] = []
    fallback = transport._pump_public

    async def counting(*args: Any) -> None:
        used.append(True)
        await fallback(*args)

    monkeypatch.setattr(MessageReader, "attach", classmethod(lambda cls, call: None))
    monkeypatch.setattr(transport, "_pump_public", counting)
    assert _completion(daemon, 200, stream=True) == expected
    assert used


def _shim_gauge(daemon: Daemon) -> float:
    text = http.get(daemon.url + "/metrics", timeout=10).text
    return sample(text, "direct_frontend_shim_active", shim="grpclib_reader")


def test_an_unchecked_grpclib_is_read_by_grpclib_itself_and_says_so(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate off (a grpclib release nobody checked): the same answers, the gauge at 0."""
    expected = _completion(daemon, 200, stream=True)
    assert _shim_gauge(daemon) == 1
    used: list[bool] = []
    fallback = transport._pump_public

    async def counting(*args: Any) -> None:
        used.append(True)
        await fallback(*args)

    monkeypatch.setattr(grpclib_reader, "CHECKED", ("0.4.0",))
    monkeypatch.setattr(grpclib_reader, "STATUS", grpclib_reader.check())
    monkeypatch.setattr(transport, "_pump_public", counting)
    assert _completion(daemon, 200, stream=True) == expected
    assert used
    assert _shim_gauge(daemon) == 0


@pytest.fixture(scope="module")
def flood_engine(model_dir: Path) -> Iterator[int]:
    """A zero-time simulated SGLang engine in its own process: it floods as fast as it can."""
    port = free_port()
    argv = [sys.executable, "-c", "from direct_frontend.cli import main; main()",
            "simulate-engine", "--kind", "sglang",
            "--port", str(port), "--model-dir", str(model_dir), "--context-length", "20000",
            "--prefill-us-per-token", "0", "--decode-us-per-token", "0",
            "--eos-probability", "0"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the engine listens
        assert b"listening" in line, line
        yield port
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_a_flooding_engine_does_not_starve_trio(flood_engine: int) -> None:
    """Trio gets a turn at least every few batches while thousands of buffered messages are pumped.

    The whole thread is blocked for a moment after each stream starts, so the engine fills
    the socket and grpclib's buffers hold thousands of messages at once; a pump that did
    not yield after a full batch would then decode them all before Trio ran again (docs/stack.md
    §3.1 rule 3). Counted in messages decoded between two turns of a Trio task, not in
    milliseconds, so a busy machine cannot fail it: with the yield the gap is bounded by
    one batch per stream (seen: 128); without it, it was about 3,000 here.
    """
    tokens = 10_000
    streams = 3

    async def main() -> tuple[int, int]:
        async with trio_asyncio.open_loop():
            channel = EngineChannel("127.0.0.1", flood_engine, SglangDialect())
            received = decoded = widest_gap = 0
            try:
                async def turns(done: trio.Event) -> None:
                    nonlocal widest_gap
                    last = decoded
                    while not done.is_set():
                        await trio.lowlevel.checkpoint()
                        widest_gap = max(widest_gap, decoded - last)
                        last = decoded

                async def consume(i: int) -> None:
                    nonlocal received, decoded
                    call = GenerateCall(f"flood-{i}", tuple(range(100, 116)),
                                        SamplingOptions(max_tokens=tokens, temperature=0.0))
                    dialect = channel.dialect
                    decoder = dialect.stream_decoder(call)
                    feed = decoder.feed

                    def counted(message: Any) -> Any:
                        nonlocal decoded
                        decoded += 1
                        return feed(message)

                    decoder.feed = counted  # type: ignore[method-assign]
                    async with channel.stream(dialect.generate(call), decoder) as events:
                        if await events.receive() is not None:
                            received += 1
                        time.sleep(0.5)  # noqa: ASYNC251 - on purpose: the engine fills the socket
                        while await events.receive() is not None:
                            received += 1
                            while events.receive_nowait() is not None:
                                received += 1

                done = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(turns, done)
                    async with trio.open_nursery() as consumers:
                        for i in range(streams):
                            consumers.start_soon(consume, i)
                    done.set()
            finally:
                channel.close()
            return received, widest_gap

    received, widest_gap = trio.run(main)
    assert received == streams * (tokens + 1)  # every delta and the three terminal events
    assert widest_gap <= streams * BATCH_MAX, f"{widest_gap} messages decoded between Trio turns"


def test_an_http2_connection_remembers_a_bounded_number_of_closed_streams() -> None:
    """h2 keeps 65,536 closed streams per connection by default (≈ 10 MiB per engine)."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection

    from direct_frontend.engines import transport

    conn = H2Connection(H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "e"), (":path", "/x")]
    for _ in range(transport.H2_CLOSED_STREAMS_KEPT + 100):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, headers)
        conn.reset_stream(stream_id)  # an aborted call
        conn.data_to_send()
    assert transport.H2_CLOSED_STREAMS_KEPT <= 4096
    assert len(conn._closed_streams) == transport.H2_CLOSED_STREAMS_KEPT


@pytest.mark.parametrize(("kind", "first", "text"), [
    ("sglang", 1064, "t"), ("vllm", 1064, "t"),
    ("sglang", 30_000, "t" * 70_000),  # (requests of many HTTP/2 frames: send_framed's)
])
def test_a_next_turn_reaches_the_engine_with_exactly_its_ids(kind: str, first: int,
                                                             text: str) -> None:
    """A conversation's next turns go out with the last turn's encoding of the ids they share
    (dialects/ids.py ``encode_request``); the engine's prompt logprobs name every prompt
    token it read: the ids, in order."""
    dialect = dialect_for(kind)
    rng = random.Random(7)

    async def echoed(channel: EngineChannel, call: GenerateCall) -> list[int]:
        rpc = dialect.generate(call)
        assert rpc.runs is not None  # (PromptIds: held encoded, not in the request's list)
        positions: list[int] = []
        async with channel.stream(rpc, dialect.stream_decoder(call)) as events:
            while (event := await events.receive()) is not None:
                if event.prompt_logprobs is not None:
                    positions = [p.token_id for p in event.prompt_logprobs if p is not None]
        return positions

    async def body() -> None:
        engine = SimEngine(EngineConfig(kind, "m", VOCAB, EOS, eos_probability=0.0,
                                        context_length=max(4096, 2 * first)))
        async with started_from_trio(engine):
            channel = EngineChannel(HOST, engine.port, dialect)
            try:
                ids = PromptIds([rng.randrange(4, VOCAB) for _ in range(first)],
                                keep_encoded=True)
                for turn in range(3):
                    if turn:
                        new = [rng.randrange(4, VOCAB) for _ in range(30)]
                        ids = PromptIds((*ids, *new), ids.chains, len(ids),
                                        encoded_source=ids.encoded, keep_encoded=True)
                    call = GenerateCall(f"{kind}-{turn}", ids, SamplingOptions(
                        max_tokens=1, logprobs=0, prompt_logprobs=0), original_text=text)
                    assert await echoed(channel, call) == list(ids)[1:]
            finally:
                channel.close()

    run_trio(body)

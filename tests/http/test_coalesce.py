"""The hypercorn shim that writes a response head with the first body bytes (http/coalesce.py)."""

from __future__ import annotations

import importlib.metadata
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import hypercorn.protocol
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.worker_context import WorkerContext

from direct_frontend.http import coalesce
from direct_frontend.http.disconnect import disconnect_of
from direct_frontend.observability.shims import ShimStatus, shims_active
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine
from tests.support.http import http
from tests.support.metrics import sample

FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}
pytestmark = pytest.mark.skipif(
    importlib.metadata.version("hypercorn") not in coalesce.CHECKED,
    reason="the shim is off on this hypercorn release",
)


def _protocol(cls: type[H11Protocol], writes: list[Any]) -> H11Protocol:
    """An HTTP/1.1 protocol that has just read a GET, writing into ``writes``."""

    async def send(event: Any) -> None:
        writes.append(event)

    config = Config()
    config.include_date_header = False  # two plays a second apart would differ in it
    protocol = cls(None, config, WorkerContext(None), None, None, False, None, None, send)  # type: ignore[arg-type]
    protocol.connection.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(protocol.connection.next_event(), h11.Request)
    assert isinstance(protocol.connection.next_event(), h11.EndOfMessage)
    return protocol


class _Stream:
    """What the protocol reads of its HTTP stream: whether the body being sent is the last."""

    final_body = False

    async def handle(self, event: Any) -> None:
        """hypercorn tells a closing stream so; nothing to do here."""


#: in a play, marks the app's last body message (what FinalBodyHTTPStream notes)
FINAL = object()


def _play(cls: type[H11Protocol], events: list[Any]) -> list[Any]:
    writes: list[Any] = []

    async def main() -> None:
        protocol = _protocol(cls, writes)
        protocol.stream = _Stream()  # type: ignore[assignment]
        for event in events:
            if event is FINAL:
                protocol.stream.final_body = True  # type: ignore[union-attr]
            else:
                await protocol.stream_send(event)

    trio.run(main)
    return writes


def _bytes(writes: list[Any]) -> bytes:
    return b"".join(w.data for w in writes if isinstance(w, RawData))


HEAD = Response(stream_id=1, status_code=200, headers=[(b"content-type", b"text/plain")])


def test_the_head_goes_out_with_the_first_body_bytes() -> None:
    events = [HEAD, Body(stream_id=1, data=b"one"), Body(stream_id=1, data=b"two"),
              EndBody(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    stock = _play(H11Protocol, events)
    assert _bytes(ours) == _bytes(stock)  # the same bytes on the wire...
    assert len(stock) == 4 and len(ours) == 3  # ...in one write fewer
    assert ours[0].data.startswith(b"HTTP/1.1 200") and ours[0].data.endswith(b"one\r\n")


def test_a_last_body_goes_out_with_the_end_of_the_body() -> None:
    events = [HEAD, Body(stream_id=1, data=b"one"), FINAL, Body(stream_id=1, data=b"two"),
              EndBody(stream_id=1), StreamClosed(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    stock = _play(H11Protocol, events)
    assert _bytes(ours) == _bytes(stock)
    assert [type(w) for w in stock] == [RawData] * 4 + [Updated]
    assert [type(w) for w in ours] == [RawData] * 2 + [Updated]
    assert ours[1].data.endswith(b"two\r\n0\r\n\r\n")


def test_a_response_of_one_body_is_one_write() -> None:
    events = [HEAD, FINAL, Body(stream_id=1, data=b"all"), EndBody(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    assert _bytes(ours) == _bytes(_play(H11Protocol, events))
    assert len(ours) == 1


async def test_the_stream_notes_only_a_last_body_without_trailers() -> None:
    sent: list[Any] = []

    async def send(event: Any) -> None:
        sent.append(event)

    def stream() -> coalesce.FinalBodyHTTPStream:
        made = coalesce.FinalBodyHTTPStream(
            None, Config(), WorkerContext(None), None, False, None, None, send, 1  # type: ignore[arg-type]
        )
        made.scope = {"method": "GET", "http_version": "1.1"}  # type: ignore[typeddict-item]
        made.start_time = 0.0  # set when hypercorn hands it the request
        return made

    plain = stream()
    await plain.app_send({"type": "http.response.start", "status": 200, "headers": []})
    await plain.app_send({"type": "http.response.body", "body": b"a", "more_body": True})
    assert not plain.final_body
    await plain.app_send({"type": "http.response.body", "body": b"b"})
    assert plain.final_body
    assert [type(e) for e in sent] == [Response, Body, Body, EndBody, StreamClosed]
    trailing = stream()
    await trailing.app_send(
        {"type": "http.response.start", "status": 200, "headers": [], "trailers": True}
    )
    await trailing.app_send({"type": "http.response.body", "body": b"b"})
    assert not trailing.final_body  # its end comes with the trailers, not now


class Spawner:
    """hypercorn's task group, as a stream uses it: the app's scope and its messages kept."""

    def __init__(self) -> None:
        self.scopes: list[Any] = []
        self.put: list[Any] = []

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Any) -> Any:
        self.scopes.append(scope)

        async def app_put(message: Any) -> None:
            self.put.append(message)

        return app_put


async def test_the_stream_fires_its_disconnect_when_it_closes_before_its_last_body() -> None:
    async def send(event: Any) -> None:
        pass

    def served(spawner: Spawner) -> coalesce.FinalBodyHTTPStream:
        return coalesce.FinalBodyHTTPStream(
            None, Config(), WorkerContext(None), spawner, False, None, None, send, 1  # type: ignore[arg-type]
        )

    request = Request(stream_id=1, headers=[], http_version="1.1", method="POST",
                      raw_path=b"/v1/completions", state={})
    left = Spawner()
    stream = served(left)
    await stream.handle(request)
    disconnect = disconnect_of(left.scopes[0])
    assert disconnect is not None and not disconnect.gone
    await stream.handle(StreamClosed(stream_id=1))
    assert disconnect.gone and left.put == [{"type": "http.disconnect"}]  # told both ways
    answered = Spawner()
    stream = served(answered)
    await stream.handle(request)
    await stream.app_send({"type": "http.response.start", "status": 200, "headers": []})
    await stream.app_send({"type": "http.response.body", "body": b"done"})
    await stream.handle(StreamClosed(stream_id=1))  # the connection recycled after it
    disconnect = disconnect_of(answered.scopes[0])
    assert disconnect is not None and not disconnect.gone


def test_an_empty_body_goes_out_with_the_head() -> None:
    events = [HEAD, EndBody(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    assert _bytes(ours) == _bytes(_play(H11Protocol, events))
    assert len(ours) == 1


def test_a_stream_closed_after_the_head_writes_the_head_first() -> None:
    """The app left after the head: the head is written alone, then hypercorn closes as ever."""
    events = [HEAD, StreamClosed(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    stock = _play(H11Protocol, events)
    assert [type(w) for w in ours] == [type(w) for w in stock] == [RawData, Closed]
    assert _bytes(ours) == _bytes(stock)


def test_a_finished_response_recycles_the_connection_as_before() -> None:
    events = [HEAD, Body(stream_id=1, data=b"x"), EndBody(stream_id=1), StreamClosed(stream_id=1)]
    ours = _play(coalesce.CoalescingH11Protocol, events)
    stock = _play(H11Protocol, events)
    assert _bytes(ours) == _bytes(stock)
    assert isinstance(ours[-1], Updated) and isinstance(stock[-1], Updated)


def _reported() -> ShimStatus:
    [status] = [s for s in shims_active() if s.shim == "hypercorn_coalesce"]
    return status


@pytest.fixture
def stock_hypercorn(monkeypatch: pytest.MonkeyPatch) -> None:
    """hypercorn as it comes, the shim not installed; put back as it was afterwards."""
    monkeypatch.setattr(hypercorn.protocol, "H11Protocol", H11Protocol)
    monkeypatch.setattr(hypercorn.protocol.h11, "HTTPStream", HTTPStream)
    monkeypatch.setattr(coalesce, "_judged", None)


@pytest.mark.usefixtures("stock_hypercorn")
def test_install_switches_hypercorn_and_is_idempotent() -> None:
    assert _reported() == ShimStatus("hypercorn_coalesce", False, "not installed")
    assert coalesce.install() and coalesce.install()
    assert hypercorn.protocol.H11Protocol is coalesce.CoalescingH11Protocol
    assert hypercorn.protocol.h11.HTTPStream is coalesce.FinalBodyHTTPStream
    version = importlib.metadata.version("hypercorn")
    assert _reported() == ShimStatus("hypercorn_coalesce", True, f"hypercorn {version}")


@pytest.mark.usefixtures("stock_hypercorn")
def test_install_leaves_another_hypercorn_release_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalesce, "CHECKED", ("0.0.0",))
    assert not coalesce.install()
    assert hypercorn.protocol.H11Protocol is H11Protocol
    status = _reported()
    assert not status.active
    assert "not a release it was checked against (0.0.0)" in status.reason


@pytest.mark.usefixtures("stock_hypercorn")
def test_install_leaves_a_hypercorn_of_another_shape_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stream_send(self: H11Protocol, event: Any) -> None:  # no longer a coroutine
        pass

    monkeypatch.setattr(H11Protocol, "stream_send", stream_send)
    assert not coalesce.install()
    assert hypercorn.protocol.H11Protocol is H11Protocol
    assert _reported().reason.endswith("H11Protocol.stream_send is not a coroutine function")


@pytest.mark.usefixtures("stock_hypercorn")
def test_a_hypercorn_that_builds_its_protocol_elsewhere_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Wrapper:  # a ProtocolWrapper that no longer reads hypercorn.protocol.H11Protocol
        def __init__(self) -> None:
            self.protocol = None

    monkeypatch.setattr(hypercorn.protocol, "ProtocolWrapper", Wrapper)
    assert not coalesce.install()
    assert _reported().reason.endswith("no longer builds hypercorn.protocol.H11Protocol")


@pytest.mark.usefixtures("stock_hypercorn")
def test_the_report_says_when_the_shim_was_replaced_since() -> None:
    assert coalesce.install()
    hypercorn.protocol.H11Protocol = H11Protocol  # type: ignore[attr-defined]
    status = _reported()
    assert not status.active and status.reason.endswith("replaced since it was installed")


# -- on the wire ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", **FAST)])
    with running_daemon(tmp_path_factory.mktemp("coalesce"), text) as d:
        d.wait_serving(1)
        yield d


def test_a_streamed_response_starts_with_head_and_first_event_together(daemon: Daemon) -> None:
    host, port = daemon.url.removeprefix("http://").split(":")
    body = b'{"model":"demo","prompt":"The sea","max_tokens":8,"stream":true}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        first = sock.recv(65536)  # one write of the server's: it holds both
    assert first.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in first and b"\r\n\r\n" in first
    assert b"data: {" in first.split(b"\r\n\r\n", 1)[1]


def test_the_daemon_reports_both_shims_in_use(daemon: Daemon) -> None:
    text = http.get(daemon.url + "/metrics", timeout=10).text
    assert sample(text, "direct_frontend_shim_active", shim="hypercorn_coalesce") == 1
    assert sample(text, "direct_frontend_shim_active", shim="grpclib_reader") == 1


def test_the_daemon_logs_the_shims_once_at_start(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = fleet_text(model_dir, [sim_engine("a", **FAST)])
    with caplog.at_level(logging.INFO, logger="direct_frontend"), running_daemon(tmp_path, text):
        pass
    lines = [r for r in caplog.records if r.getMessage().startswith("hot-path shims:")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "grpclib_reader on (grpclib " in lines[0].getMessage()
    assert "hypercorn_coalesce on (hypercorn " in lines[0].getMessage()

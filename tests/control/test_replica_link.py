"""The replica link on its own: its pacing under a mock clock, and who it shares with
over a real nats-server (credentials, open servers, fleets apart)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trio_asyncio

from direct_frontend.control.bus import NatsRefused
from direct_frontend.control.replica_wire import LoadReport, ResponseQuery
from direct_frontend.control.replicas import LinkNews, ReplicaLink
from direct_frontend.control.supervisor import Supervisor
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FleetConfig, FrontendConfig, ReplicasConfig
from direct_frontend.openai.response_store import ResponseStore
from direct_frontend.routing.peers import PlacementShare
from tests.support.fleet import engine
from tests.support.nats import NatsServer, running_nats
from tests.support.sim import until_trio

INTERVAL_S = 0.02


def _link(config: ReplicasConfig | None = None, replica: str = "r", *,
          store: bool = False) -> ReplicaLink:
    """A link with a real supervisor of no engines (nothing to follow, nothing to route)."""
    fleet = FleetConfig(frontend=FrontendConfig(served_model_name="m", tokenizer=Path("/m")),
                        source=Path("/fleet.toml"))
    if config is None:
        config = ReplicasConfig(nats="nats://127.0.0.1:1", publish_interval_s=INTERVAL_S)
    news = LinkNews()
    return ReplicaLink(config, Supervisor(fleet, on_load_change=news.load_changed),
                       PlacementShare(notify=news.urgent), news, replica_id=replica,
                       responses=ResponseStore(1 << 20, 60.0) if store else None)


def test_news_that_arrives_as_the_tick_passes_never_waits_a_negative_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of load woke the link just as its tick passed, while the last change
    went out less than an interval ago: the tick is then already behind us, and the
    wait until it must end at once (Trio refuses a negative wait with ``ValueError``,
    which would end the link's task and the daemon with it).
    """
    clock = trio.testing.MockClock()

    async def main() -> None:
        # one fake time for the whole link, whichever clock it reads
        monkeypatch.setattr(time, "monotonic", trio.current_time)
        link = _link()
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def news() -> None:
                await link._news()
                done.set()

            nursery.start_soon(news)
            await trio.testing.wait_all_tasks_blocked()  # it waits for news or its tick
            clock.jump(INTERVAL_S * 2)  # the tick passes …
            link._last_change_sent_at = trio.current_time()  # … a change just went out …
            link.news.load_changed()  # … and another wakes the link before it runs again
            with trio.fail_after(1):
                await done.wait()

    trio.run(main, clock=clock)


def test_what_was_placed_offline_goes_again_to_each_sibling_heard_anew_within_a_peer_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NATS keeps nothing for a sibling that is not back yet: the placements made while the
    link was down go out when it is back, and again for each sibling heard anew within a
    peer timeout, once each; one heard later has been away longer than its word is kept."""
    clock = trio.testing.MockClock()
    offline = [("e0", (1, 2, 3)), ("e1", (4, 5))]

    async def main() -> None:
        monkeypatch.setattr(time, "monotonic", trio.current_time)
        link = _link()
        share = link.placements
        share.put_back(list(offline))  # placed while the link was down
        link._keep_backlog()  # the link is back
        assert share.take() == offline  # sent at once, to the siblings already back
        link._on_load(LoadReport.of("late", 1, {}))
        assert share.take() == offline  # again, for the sibling back after that
        link._on_load(LoadReport.of("late", 2, {}))
        assert share.take() == []  # once per sibling
        clock.jump(link.config.peer_timeout_s + 0.1)
        link._on_load(LoadReport.of("later", 1, {}))
        assert share.take() == []

    trio.run(main, clock=clock)


# -- over a real nats-server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    """One nats-server requiring a user and password, shared by the module's tests."""
    with running_nats() as nats:
        yield nats


@pytest.fixture(scope="module")
def open_server() -> Iterator[NatsServer]:
    """One nats-server that lets any client in."""
    with running_nats(auth=False) as nats:
        yield nats


def _config(server: NatsServer, **settings: Any) -> ReplicasConfig:
    """Credentials by default: the user, and the password from ``$NATS_TEST_PASSWORD``."""
    if server.password is not None and "user" not in settings:
        settings = {"user": server.USER, "password_env": "NATS_TEST_PASSWORD", **settings}
    return ReplicasConfig(nats=server.bare_url, peer_timeout_s=30.0, **settings)


def _on_loop(body: Callable[[], Awaitable[None]]) -> None:
    """``body`` on a trio-asyncio loop; a link that never returns fails the test, not hangs it."""

    async def main() -> None:
        with trio.fail_after(30):
            async with trio_asyncio.open_loop():
                await body()

    trio.run(main)


async def _anonymous(port: int, cluster: str) -> bytes:
    """What the server answers a client with no credentials that subscribes to the fleet's
    load news and publishes some (raw protocol, the way any client could)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"CONNECT {{\"verbose\":false}}\r\nSUB {cluster}.> 1\r\n"
                              f"PUB {cluster}.load 2\r\nhi\r\nPING\r\n".encode())
        said = b""
        with trio.fail_after(5):
            while data := await stream.receive_some(4096):  # until the server hangs up
                said += data
    return said


@pytest.fixture()
def password(server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> str:
    assert server.password is not None
    monkeypatch.setenv("NATS_TEST_PASSWORD", server.password)
    return server.password


def test_with_credentials_a_replica_shares_and_an_anonymous_client_is_turned_away(
        server: NatsServer, password: str) -> None:
    async def body() -> None:
        link = _link(_config(server))
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected and link.refusal is None
            status = json.dumps(link.status())
            assert password not in status and "user fleet" in status
            said = await _anonymous(server.port, link.config.cluster)
            assert b"-ERR 'Authorization Violation'" in said
            assert b"MSG" not in said and b"PONG" not in said
            nursery.cancel_scope.cancel()

    _on_loop(body)


def test_a_replica_refuses_an_open_server_unless_insecure_and_then_warns(
        open_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        with pytest.raises(NatsRefused, match=r"lets any client in.*insecure = true"):
            await _link(_config(open_server)).run()
        link = _link(_config(open_server, insecure=True))
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, "direct_frontend.replicas"):
        _on_loop(body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("lets any client in (insecure = true)" in w for w in warnings), warnings


def test_a_replica_whose_credentials_are_refused_says_so_without_the_secret(
        server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_TEST_PASSWORD", "not-the-password-42")

    async def body() -> None:
        with pytest.raises(NatsRefused) as refused:
            await _link(_config(server)).run()
        message = str(refused.value)
        assert "refuses this replica's credentials (user fleet)" in message
        assert "Authorization Violation" in message
        assert "not-the-password-42" not in message

    _on_loop(body)


def test_a_missing_secret_stops_the_start_naming_the_variable(server: NatsServer) -> None:
    async def body() -> None:
        config = _config(server, user="fleet", password_env="NATS_TEST_NOT_SET")
        with pytest.raises(NatsRefused, match=r"password_env: .*NATS_TEST_NOT_SET is not set"):
            await _link(config).run()

    _on_loop(body)


def test_a_password_in_the_url_is_never_shown(server: NatsServer,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert server.password is not None

    async def body() -> None:
        link = _link(ReplicasConfig(nats=server.url))  # nats://fleet:<password>@host:port
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected
            assert link.status()["nats"] == f"nats://<redacted>@127.0.0.1:{server.port}"
            assert server.password not in json.dumps(link.status())
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.DEBUG):
        _on_loop(body)
    assert any("sharing over nats://<redacted>@" in r.getMessage() for r in caplog.records)
    assert not any(server.password in r.getMessage() for r in caplog.records)


def test_two_fleets_on_one_server_never_hear_each_other(server: NatsServer,
                                                        password: str) -> None:
    """Fleet ``a`` has two replicas, fleet ``b`` one: ``a``'s replicas hear each other's
    load and faults; ``b`` hears nothing of them, and cannot reach ``a``'s stored responses."""

    async def body() -> None:
        a1 = _link(_config(server, cluster="a"), "a1", store=True)
        a2 = _link(_config(server, cluster="a"), "a2", store=True)
        b1 = _link(_config(server, cluster="b"), "b1", store=True)
        async with trio.open_nursery() as nursery:
            for link in (a1, a2, b1):
                await nursery.start(link.run)
            a2.supervisor.fault_listeners[0](engine("e0"), EngineError(ErrorKind.UNAVAILABLE,
                                                                        "gone"))
            await until_trio(lambda: "a2" in a1.peers and "a1" in a2.peers,
                             what="a's replicas to hear each other")
            # whatever the server sent b1 is ahead of the answer to this ping
            await trio_asyncio.aio_as_trio(b1._nc.flush)(2)
            await trio.testing.wait_all_tasks_blocked()
            assert b1.counts["received"] == 0 and len(b1.peers) == 0
            assert a2.counts["faults_shared"] == 1  # out on a's subjects, before b1's ping
            assert a1.stored is not None and a2.stored is not None and b1.stored is not None
            holder = a2.stored.store.holder
            assert await b1.stored._ask(holder, ResponseQuery("b1", "delete", "resp_x")) is None
            assert await a1.stored._ask(holder, ResponseQuery("a1", "delete", "resp_x")) == b"0"
            nursery.cancel_scope.cancel()

    _on_loop(body)


def test_a_server_that_opens_up_later_leaves_the_link_degraded_until_it_closes_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The same URL, a server restarted without authentication: the link reconnects to it
    (nats-py does) but shares nothing there, says so once, and is back once it is closed."""
    guarded = NatsServer().start()
    assert guarded.password is not None
    monkeypatch.setenv("NATS_TEST_PASSWORD", guarded.password)
    opened = NatsServer(guarded.port, auth=False)

    async def body() -> None:
        link = _link(_config(guarded))
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected
            guarded.kill()
            opened.start()
            await until_trio(lambda: link.refusal is not None, what="the open server refused")
            assert link.degraded and "lets any client in" in str(link.status()["refused"])
            opened.kill()
            guarded.start()
            await until_trio(lambda: link.connected, what="the link back")
            assert link.refusal is None
            nursery.cancel_scope.cancel()

    try:
        with caplog.at_level(logging.ERROR, "direct_frontend.replicas"):
            _on_loop(body)
    finally:
        opened.kill()
        guarded.kill()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "not sharing over NATS at" in errors[0], errors


def test_a_replica_that_requires_tls_refuses_a_server_without_it(server: NatsServer,
                                                                 password: str) -> None:
    async def body() -> None:
        with pytest.raises(NatsRefused, match=r"it does not require TLS, and this replica does"):
            await _link(_config(server, tls=True)).run()

    _on_loop(body)


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 with its key (openssl)."""
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, request = directory / "server.pem", directory / "server.key", directory / "req"
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName = IP:127.0.0.1\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "1", "-subj", "/CN=test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", extensions],
    ):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    return ca, cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_a_replica_shares_over_tls_with_the_ca_it_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, cert, key = _certificates(tmp_path)
    guarded = NatsServer(tls=(cert, key)).start()
    assert guarded.password is not None
    monkeypatch.setenv("NATS_TEST_PASSWORD", guarded.password)

    async def body() -> None:
        config = dataclasses.replace(_config(guarded), nats=f"tls://127.0.0.1:{guarded.port}",
                                     tls_ca=str(ca))
        link = _link(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected
            assert "TLS required" in str(link.status()["auth"])
            nursery.cancel_scope.cancel()
        with trio.fail_after(10), pytest.raises(NatsRefused, match=r"TLS certificate is not "
                                                 r"trusted .*CERTIFICATE_VERIFY_FAILED"):
            # the system's CAs do not know this one: a setting to mend, not an outage
            await _link(dataclasses.replace(config, tls_ca=None)).run()

    try:
        _on_loop(body)
    finally:
        guarded.kill()


# nats-py's reconnect loop drops the socket of an attempt the server refused without closing
# it (nats/aio/client.py ``_attempt_reconnect``); the garbage collector closes it, here below
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_credentials_refused_at_a_reconnect_are_said_once_without_the_secret(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The server comes back with another password: the link stays degraded and says why."""
    guarded = NatsServer().start()
    assert guarded.password is not None
    monkeypatch.setenv("NATS_TEST_PASSWORD", guarded.password)
    rotated = NatsServer(guarded.port)

    async def body() -> None:
        link = _link(_config(guarded))
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert link.connected
            guarded.kill()
            rotated.start()
            await until_trio(lambda: link.refusal is not None, what="the reconnect refused")
            assert link.degraded and "refuses this replica's credentials (user fleet)" in str(
                link.status()["refused"])
            rotated.kill()
            guarded.start()
            await until_trio(lambda: link.connected, what="the link back")
            assert link.refusal is None
            nursery.cancel_scope.cancel()

    try:
        with caplog.at_level(logging.ERROR, "direct_frontend.replicas"):
            _on_loop(body)
    finally:
        rotated.kill()
        guarded.kill()
        gc.collect()  # nats-py's dropped sockets: closed while this test ignores their warning
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Authorization Violation" in errors[0], errors
    assert guarded.password not in errors[0]

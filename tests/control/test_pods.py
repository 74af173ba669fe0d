"""One pool's watch against the API server double: pages, bookmarks, backoff, the config."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest
import trio

from direct_frontend.control import pods
from direct_frontend.control.pods import PoolWatch, kube_client
from direct_frontend.fleet.schema import KubernetesConfig, PoolConfig
from direct_frontend.observability.metrics import Metrics
from tests.support.kube import ApiServer, pod, service_account
from tests.support.sim import until_trio

POOL = PoolConfig(name="web", selector="app=engine", kind="sglang", port=50051)
SETTINGS = KubernetesConfig(watch_timeout_s=1, max_backoff_s=0.1)


async def run_watch(api: ApiServer, tmp_path: Path, watch: PoolWatch,
                    nursery: trio.Nursery) -> None:
    settings = KubernetesConfig(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
                                watch_timeout_s=1, max_backoff_s=0.1)
    client = kube_client(settings, tmp_path / "fleet.toml")

    async def client_of() -> httpx2.AsyncClient:
        return client

    async def owned() -> None:  # the client is closed with the watch, as the daemon's is
        try:
            await watch.run(client_of)
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    nursery.start_soon(owned)


def test_a_list_in_pages_then_bookmarks_carry_the_version(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pods, "LIST_PAGE", 100)
    for i in range(250):
        api.put(pod(f"p{i}", f"10.0.{i // 200}.{i % 200 + 1}", None, ready=i % 2 == 0))
    changes: list[int] = []
    watch = PoolWatch(POOL, SETTINGS, Metrics(), lambda: changes.append(1))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await run_watch(api, tmp_path, watch, nursery)
            await until_trio(lambda: watch.listed, what="listed")
            assert len(watch.engines) == 125 and len(watch.membership.waiting) == 125
            assert api.requests[:3] == ["list", "list", "list"]  # 250 pods in pages of 100
            api.put(pod("elsewhere", "10.9.9.9", None, namespace="other"))
            await until_trio(lambda: watch.membership.resource_version == str(api.version),
                             what="a bookmark carrying the version")
            # the server ends each watch after timeoutSeconds (1 s): resumed, not relisted
            await until_trio(lambda: watch.watches >= 2, what="a second watch")
            assert watch.relists == 1 and api.requests.count("list") == 3
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert changes  # the membership was handed on


def test_an_unreachable_server_marks_the_pool_stale_and_backs_off(
    api: ApiServer, tmp_path: Path
) -> None:
    api.put(pod("a", "10.0.0.1", None))
    watch = PoolWatch(POOL, SETTINGS, Metrics(), lambda: None)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await run_watch(api, tmp_path, watch, nursery)
            await until_trio(lambda: watch.listed, what="listed")
            api.stop()
            await until_trio(lambda: watch.stale, what="stale")
            assert [e.name for e in watch.engines] == ["web/a"]  # kept
            assert watch.status()["stale_since"] is not None
            api.start()
            await until_trio(lambda: not watch.stale, what="fresh again")
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_closed_under_the_watch_is_replaced_not_fatal(
    api: ApiServer, tmp_path: Path
) -> None:
    """A reload closes the client; a watch that still had it in hand takes the next one."""
    api.put(pod("a", "10.0.0.1", None))
    watch = PoolWatch(POOL, SETTINGS, Metrics(), lambda: None)
    settings = KubernetesConfig(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
                                watch_timeout_s=1, max_backoff_s=0.1)
    clients: list[httpx2.AsyncClient] = []

    async def client_of() -> httpx2.AsyncClient:
        clients.append(kube_client(settings, tmp_path / "fleet.toml"))
        if len(clients) == 1:
            await clients[0].aclose()  # closed before the watch's first request
        return clients[-1]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run, client_of)
            await until_trio(lambda: watch.listed, what="listed on the next client")
            assert len(clients) == 2 and [e.name for e in watch.engines] == ["web/a"]
            nursery.cancel_scope.cancel()
        await clients[-1].aclose()

    trio.run(main)


def test_a_kubeconfig_context_that_does_not_exist_is_an_error(
    api: ApiServer, tmp_path: Path
) -> None:
    settings = KubernetesConfig(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
                                context="nope")
    with pytest.raises(Exception, match="nope"):
        kube_client(settings, tmp_path / "fleet.toml")


def test_a_relative_kubeconfig_is_found_beside_the_fleet_file(
    api: ApiServer, tmp_path: Path
) -> None:
    api.kubeconfig(tmp_path / "kubeconfig")
    client = kube_client(KubernetesConfig(kubeconfig="kubeconfig"), tmp_path / "fleet.toml")
    assert str(client.base_url).rstrip("/") == api.url


def test_in_the_cluster_the_service_account_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kubeconfig: the token, CA and address a kubelet gives a pod reach the server (HTTPS)."""
    account = tmp_path / "serviceaccount"
    api = ApiServer().start(tls=service_account(account))
    try:
        api.put(pod("a", "10.0.0.1", None))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        client = kube_client(KubernetesConfig(), tmp_path / "fleet.toml", account)
        assert str(client.base_url).startswith(f"https://127.0.0.1:{api.port}")
        watch = PoolWatch(POOL, SETTINGS, Metrics(), lambda: None)

        async def client_of() -> httpx2.AsyncClient:
            return client

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.run, client_of)
                await until_trio(lambda: watch.listed, what="listed over HTTPS")
                nursery.cancel_scope.cancel()
            await client.aclose()  # else its connection is closed by the garbage collector

        trio.run(main)
        assert [e.name for e in watch.engines] == ["web/a"]
    finally:
        api.stop()


def test_watches_cut_by_tcp_resets_relist_at_a_backed_off_rate(
    api: ApiServer, tmp_path: Path
) -> None:
    """Every watch reset at once after its list: the relists slow down, 0.05 s doubling at least.

    Five delays in a row after the first list are at least half of 0.1, 0.2, 0.4, 0.8 and
    1.0 s (the ceiling): 1.25 s; relisting after a fixed 0.1 s would take about 0.5 s.
    """
    api.put(pod("a", "10.0.0.1", None))
    api.set_watch_fault("reset")
    settings = KubernetesConfig(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
                                watch_timeout_s=1, max_backoff_s=1.0)
    client = kube_client(settings, tmp_path / "fleet.toml")
    watch = PoolWatch(POOL, settings, Metrics(), lambda: None)

    async def client_of() -> httpx2.AsyncClient:
        return client

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run, client_of)
            await until_trio(lambda: watch.listed, what="listed")
            first = trio.current_time()
            await until_trio(lambda: api.requests.count("list") >= 6, what="five relists")
            assert trio.current_time() - first >= 1.25
            assert [e.name for e in watch.engines] == ["web/a"]  # kept throughout
            assert api.requests.count("watch") >= 5  # each list's watch was reset
            nursery.cancel_scope.cancel()
        await client.aclose()

    trio.run(main)


def test_a_silent_watch_is_a_dead_connection_after_watch_silence_s(
    api: ApiServer, tmp_path: Path
) -> None:
    """A watch that answered its headers and then nothing: found out in seconds, not minutes."""
    api.put(pod("a", "10.0.0.1", None))
    settings = KubernetesConfig(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
                                watch_timeout_s=60, watch_silence_s=1, max_backoff_s=0.1)
    client = kube_client(settings, tmp_path / "fleet.toml")
    watch = PoolWatch(POOL, settings, Metrics(), lambda: None)

    async def client_of() -> httpx2.AsyncClient:
        return client

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run, client_of)
            await until_trio(lambda: watch.listed and watch.watches >= 1, what="watching")
            api.set_watch_fault("silent")  # the next watch falls silent
            # (a watch ending at a busy moment may fail otherwise first: the silence is what
            # must be noticed, in seconds)
            await until_trio(lambda: watch.last_error == (
                "ApiFailure: the watch brought nothing for 1 s (a dead connection)"),
                within=5, what="the silence noticed")
            assert watch.stale
            assert [e.name for e in watch.engines] == ["web/a"]  # kept
            api.set_watch_fault(None)
            await until_trio(lambda: not watch.stale, what="fresh again")
            nursery.cancel_scope.cancel()
        await client.aclose()

    trio.run(main)

"""Kubeconfig ``exec`` credential plugins: a real plugin process, the API server double.

The plugin is a small script the test writes: it prints an ExecCredential
with the token in its directory's ``token`` file (``fail`` makes it exit 1
with that text on stderr, ``expires`` adds an expiry that many seconds
ahead), and notes each run with what it was told in ``runs``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from lightkube.config.models import NameValue, UserExec

from direct_frontend.control.kube_exec import (
    EXPIRY_MARGIN_S,
    ExecAuth,
    ExecCredential,
    ExecPluginError,
    parse_credential,
)
from direct_frontend.control.pods import PoolWatch, kube_client
from direct_frontend.fleet.schema import KubernetesConfig, PoolConfig
from direct_frontend.observability.metrics import Metrics
from tests.support.kube import ApiServer, pod
from tests.support.sim import until_trio

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"
POOL = PoolConfig(name="web", selector="app=engine", kind="sglang", port=50051)

PLUGIN = """\
import json, os, sys, time
from pathlib import Path
here = Path(sys.argv[1])
with open(here / "runs", "a") as runs:
    runs.write(json.dumps({"info": os.environ.get("KUBERNETES_EXEC_INFO"),
                           "region": os.environ.get("REGION")}) + "\\n")
fail = here / "fail"
if fail.exists():
    sys.stderr.write(fail.read_text())
    sys.exit(1)
status = {"token": (here / "token").read_text()}
expires = here / "expires"
if expires.exists():
    status["expirationTimestamp"] = time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + float(expires.read_text())))
print(json.dumps({"apiVersion": sys.argv[2], "kind": "ExecCredential", "status": status}))
"""


def plugin_dir(tmp_path: Path, token: str = "test-token") -> Path:
    here = tmp_path / "plugin"
    here.mkdir()
    (here / "plugin.py").write_text(PLUGIN)
    (here / "token").write_text(token)
    (here / "runs").write_text("")
    return here


def runs(here: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (here / "runs").read_text().splitlines()]


def exec_user(here: Path, api_version: str = V1BETA1) -> dict[str, Any]:
    return {"exec": {"apiVersion": api_version, "command": sys.executable,
                     "args": [str(here / "plugin.py"), str(here), api_version],
                     "env": [{"name": "REGION", "value": "eu-test-1"}],
                     "installHint": "install the test plugin"}}


def plugin(here: Path, api_version: str = V1) -> UserExec:
    return UserExec(apiVersion=api_version, command=sys.executable,
                    args=[str(here / "plugin.py"), str(here), api_version],
                    env=[NameValue(name="REGION", value="eu-test-1")])


# -- the credential, sans IO ---------------------------------------------------------------


def credential(status: dict[str, Any], api_version: str = V1) -> bytes:
    return json.dumps({"apiVersion": api_version, "kind": "ExecCredential",
                       "status": status}).encode()


def test_a_credential_is_its_token_and_its_expiry() -> None:
    assert parse_credential(credential({"token": "t"}), V1, "p") == ExecCredential("t")
    got = parse_credential(credential({"token": "t", "expirationTimestamp":
                                       "2026-12-01T20:00:00Z"}), V1, "p")
    assert got.expires_at == 1796155200.0
    fractional = parse_credential(credential({"token": "t", "expirationTimestamp":
                                              "2026-12-01T21:00:00.5+01:00"}), V1, "p")
    assert fractional.expires_at == 1796155200.5
    assert got.fresh(got.expires_at - EXPIRY_MARGIN_S - 1)
    assert not got.fresh(got.expires_at - EXPIRY_MARGIN_S + 1)
    assert ExecCredential("t").fresh(1e12)  # no expiry: until the server says 401


@pytest.mark.parametrize(("output", "why"), [
    (b"Unable to locate credentials", "no JSON"),
    (b'{"kind": "Status"}', "not an ExecCredential"),
    (credential({"token": "t"}, V1BETA1), "answered in"),
    (credential({}), "no status.token"),
    (credential({"clientCertificateData": "PEM", "clientKeyData": "PEM"}), "client certificate"),
    (credential({"token": "t", "expirationTimestamp": "tomorrow"}), "not RFC 3339"),
    (credential({"token": "t", "expirationTimestamp": "2026-12-01T20:00:00"}), "no time zone"),
])
def test_what_is_not_a_usable_credential_says_why(output: bytes, why: str) -> None:
    with pytest.raises(ExecPluginError, match=why) as caught:
        parse_credential(output, V1, "aws")
    assert "'aws'" in str(caught.value)


def test_an_exec_api_it_does_not_know_is_refused_with_the_ones_it_does() -> None:
    with pytest.raises(ExecPluginError, match="v1beta1"):
        ExecAuth(UserExec(apiVersion="client.authentication.k8s.io/v2", command="x"))


# -- the plugin process ----------------------------------------------------------------------


def test_the_token_is_kept_until_shortly_before_it_expires(tmp_path: Path) -> None:
    here = plugin_dir(tmp_path, token="first")
    (here / "expires").write_text("3600")
    now = [time.time()]
    auth = ExecAuth(plugin(here), clock=lambda: now[0])

    async def main() -> None:
        async with trio.open_nursery() as nursery:  # three watches waiting together: one run
            for _ in range(3):
                nursery.start_soon(auth.credential)
        assert auth.runs == 1
        first = await auth.credential()
        assert first.token == "first" and auth.runs == 1
        (here / "token").write_text("second")
        assert first.expires_at is not None
        now[0] = first.expires_at - EXPIRY_MARGIN_S + 1  # about to expire: fetched again
        assert (await auth.credential()).token == "second"
        assert auth.runs == 2

    trio.run(main)
    told = runs(here)
    assert len(told) == 2 and told[0]["region"] == "eu-test-1"  # the kubeconfig's env
    assert json.loads(told[0]["info"]) == {"apiVersion": V1, "kind": "ExecCredential",
                                           "spec": {"interactive": False}}


def test_a_plugin_that_fails_or_is_missing_is_an_error_that_says_why(tmp_path: Path) -> None:
    here = plugin_dir(tmp_path)
    (here / "fail").write_text("Unable to locate credentials. Run aws configure.")
    missing = UserExec(apiVersion=V1, command=str(tmp_path / "no-such-cli"),
                       installHint="brew install no-such-cli\n")

    async def main() -> None:
        with pytest.raises(ExecPluginError, match="exited with 1: Unable to locate credentials"):
            await ExecAuth(plugin(here)).credential()
        with pytest.raises(ExecPluginError, match=r"not installed \(brew install no-such-cli\)"):
            await ExecAuth(missing).credential()

    trio.run(main)


# -- through the pod watch --------------------------------------------------------------------


def watch_with(api: ApiServer, tmp_path: Path, here: Path) -> tuple[PoolWatch, Any]:
    config = api.kubeconfig(tmp_path / "kubeconfig", exec_user(here))
    settings = KubernetesConfig(kubeconfig=str(config), watch_timeout_s=1, max_backoff_s=0.1)
    client = kube_client(settings, tmp_path / "fleet.toml")
    watch = PoolWatch(POOL, settings, Metrics(), lambda: None)

    async def run() -> None:
        async def client_of() -> httpx2.AsyncClient:
            return client

        try:
            await watch.run(client_of)
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    return watch, run


def test_a_kubeconfig_exec_plugin_lists_and_watches_and_a_rotated_token_is_fetched_again(
    api: ApiServer, tmp_path: Path
) -> None:
    api.put(pod("a", "10.0.0.1", None))
    here = plugin_dir(tmp_path)
    watch, run = watch_with(api, tmp_path, here)

    async def end_the_watch() -> None:
        """The open watch ends, as at its timeout."""
        await until_trio(lambda: api.watching > 0, what="a watch the server holds open")
        api.end_watches()

    async def watch_again() -> None:
        """The open watch ends and the next one starts."""
        started = watch.watches
        await end_the_watch()
        await until_trio(lambda: watch.watches > started, what="the next watch")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await until_trio(lambda: watch.listed, what="listed with the plugin's token")
            await until_trio(lambda: watch.watches >= 1, what="the first watch")
            # watches end and resume: the token is reused, not fetched again
            for _ in range(2):
                await watch_again()
            assert len(runs(here)) == 1 and api.refused == 0
            # the cloud rotates the token: the next watch is refused once, then fetched again
            (here / "token").write_text("rotated")
            api.token = "rotated"
            await end_the_watch()
            await until_trio(lambda: len(runs(here)) == 2, what="the plugin run after a 401")
            await watch_again()
            assert api.refused == 1 and len(runs(here)) == 2
            api.put(pod("b", "10.0.0.2", None))
            await until_trio(lambda: len(watch.engines) == 2, what="the pod seen after a 401")
            assert not watch.stale and watch.last_error == ""
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_failing_plugin_makes_the_pool_stale_until_it_works(
    api: ApiServer, tmp_path: Path
) -> None:
    api.put(pod("a", "10.0.0.1", None))
    here = plugin_dir(tmp_path)
    (here / "fail").write_text("the SSO session has expired")
    watch, run = watch_with(api, tmp_path, here)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await until_trio(lambda: watch.stale, what="stale")
            assert "the SSO session has expired" in str(watch.status()["last_error"])
            assert not watch.listed and api.requests == []  # nothing sent without a token
            (here / "fail").unlink()
            await until_trio(lambda: watch.listed and not watch.stale, what="listed")
            assert [e.name for e in watch.engines] == ["web/a"]
            nursery.cancel_scope.cancel()

    trio.run(main)

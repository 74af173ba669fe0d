"""Kubeconfig ``exec`` credential plugins (``aws eks get-token``, GKE's auth plugin), on Trio.

A kubeconfig made by a cloud CLI names a command that prints a short-lived
token as an ``ExecCredential`` (client.authentication.k8s.io). lightkube runs
such a command with asyncio's subprocess API, which needs an asyncio loop the
pod watch does not run on; it also asks again only after a 401 and does not
take the ``v1`` API. :class:`ExecAuth` runs the command with
:func:`trio.run_process`, keeps the token until shortly before its
``expirationTimestamp`` (or the next 401), runs the plugin once for every
watch that waits on it, and passes ``KUBERNETES_EXEC_INFO`` as the protocol
says. Any failure (not installed, a non-zero exit, a credential it cannot
read) is a :class:`ExecPluginError`, which the pod watch treats as an API
server that cannot be reached: the pool keeps its engines and tries again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import time
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any

import httpx2 as httpx
import trio
from lightkube.config.models import UserExec
from lightkube.core.exceptions import ConfigError

#: the ExecCredential APIs this reads (the three Kubernetes has had)
API_VERSIONS = (
    "client.authentication.k8s.io/v1",
    "client.authentication.k8s.io/v1beta1",
    "client.authentication.k8s.io/v1alpha1",
)
#: a plugin that has not answered after this long is given up on (cloud CLIs take ~1–3 s)
EXEC_TIMEOUT_S = 60.0
#: a token this close to its expiry is fetched again (requests in flight must not carry a dead one)
EXPIRY_MARGIN_S = 60.0
#: the end of the plugin's standard error quoted in an error
STDERR_QUOTED = 400


class ExecPluginError(ConfigError):
    """The kubeconfig's exec plugin gave no usable credential (the message says why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExecCredential:
    """A bearer token from a plugin, and when it stops being valid (None: until a 401)."""

    token: str
    expires_at: float | None = None

    def fresh(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at - EXPIRY_MARGIN_S


def exec_info(api_version: str) -> str:
    """``KUBERNETES_EXEC_INFO``: what the plugin is told (a daemon: never interactive)."""
    return json.dumps({"apiVersion": api_version, "kind": "ExecCredential",
                       "spec": {"interactive": False}})


def parse_credential(output: bytes, api_version: str, command: str) -> ExecCredential:
    """The plugin's standard output as a credential, or an :class:`ExecPluginError` saying why."""
    try:
        status = _status_of(output, api_version)
        credential = ExecCredential(_token_of(status),
                                    _expiry_of(status.get("expirationTimestamp")))
    except _Unreadable as exc:
        raise ExecPluginError(f"exec plugin {command!r}: {exc}") from None
    return credential


class _Unreadable(Exception):
    """What is wrong with a plugin's answer (the message completes "exec plugin X: ")."""


def _status_of(output: bytes, api_version: str) -> dict[str, Any]:
    try:
        document: Any = json.loads(output)
    except ValueError as exc:
        raise _Unreadable(f"printed no JSON ExecCredential ({exc})") from None
    if not isinstance(document, dict) or document.get("kind") != "ExecCredential":
        raise _Unreadable("printed JSON that is not an ExecCredential")
    if document.get("apiVersion") != api_version:
        raise _Unreadable(
            f"answered in {document.get('apiVersion')!r}, asked for {api_version!r}")
    status = document.get("status")
    if not isinstance(status, dict):
        raise _Unreadable("its ExecCredential has no status")
    return status


def _token_of(status: dict[str, Any]) -> str:
    token = status.get("token")
    if isinstance(token, str) and token:
        return token
    if status.get("clientCertificateData"):
        raise _Unreadable("gave a client certificate; only token credentials are supported")
    raise _Unreadable("its ExecCredential has no status.token")


def _expiry_of(stamp: object) -> float | None:
    """``status.expirationTimestamp`` as a Unix time (None: it has none)."""
    if stamp is None:
        return None
    if not isinstance(stamp, str):
        raise _Unreadable(f"status.expirationTimestamp {stamp!r} is not a timestamp")
    try:
        when = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        raise _Unreadable(f"status.expirationTimestamp {stamp!r} is not RFC 3339") from None
    if when.tzinfo is None:
        raise _Unreadable(f"status.expirationTimestamp {stamp!r} has no time zone")
    return when.timestamp()


class ExecAuth(httpx.Auth):
    """Bearer tokens from a kubeconfig ``exec`` plugin, for the pod watch's async client."""

    def __init__(self, plugin: UserExec, *, clock: Callable[[], float] = time.time) -> None:
        if plugin.apiVersion not in API_VERSIONS:
            raise ExecPluginError(
                f"exec plugin {plugin.command!r}: apiVersion {plugin.apiVersion!r} is not one of "
                f"{', '.join(API_VERSIONS)}")
        self.plugin = plugin
        self.clock = clock
        self.runs = 0  # how many times the plugin ran
        self._credential: ExecCredential | None = None
        self._lock = trio.Lock()

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        raise RuntimeError("ExecAuth serves the async client only")

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        credential = await self.credential()
        request.headers["Authorization"] = f"Bearer {credential.token}"
        response = yield request
        if response.status_code == 401:  # revoked or rotated early: ask once more
            credential = await self.credential(stale=credential)
            request.headers["Authorization"] = f"Bearer {credential.token}"
            yield request

    async def credential(self, stale: ExecCredential | None = None) -> ExecCredential:
        """A fresh token; ``stale``, the server refused it: run the plugin unless it already ran."""
        async with self._lock:  # watches waiting together run the plugin once
            held = self._credential
            if held is not None and held is not stale and held.fresh(self.clock()):
                return held
            self._credential = await self._run()
            return self._credential

    async def _run(self) -> ExecCredential:
        plugin = self.plugin
        command = [plugin.command, *(plugin.args or [])]
        env = dict(os.environ)
        env.update((var.name, var.value) for var in plugin.env or ())
        env["KUBERNETES_EXEC_INFO"] = exec_info(plugin.apiVersion)
        self.runs += 1
        try:
            with trio.fail_after(EXEC_TIMEOUT_S):
                done = await trio.run_process(
                    command, env=env, stdin=subprocess.DEVNULL, capture_stdout=True,
                    capture_stderr=True, check=False)
        except FileNotFoundError:
            hint = f" ({plugin.installHint.strip()})" if plugin.installHint else ""
            raise ExecPluginError(
                f"exec plugin {plugin.command!r} is not installed{hint}") from None
        except PermissionError:
            raise ExecPluginError(f"exec plugin {plugin.command!r} is not executable") from None
        except trio.TooSlowError:
            raise ExecPluginError(
                f"exec plugin {plugin.command!r} did not answer in {EXEC_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip()[-STDERR_QUOTED:]
            raise ExecPluginError(
                f"exec plugin {plugin.command!r} exited with {done.returncode}"
                + (f": {said}" if said else ""))
        return parse_credential(done.stdout, plugin.apiVersion, plugin.command)

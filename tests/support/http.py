"""One HTTP client for the whole run, and one TLS context for the official SDKs' clients.

A new ``httpx.Client`` (``httpx.get`` makes one per call) builds a TLS
context and loads the machine's CA bundle into it: about 20 ms of CPU, more
than the daemon spends answering most requests, and the suite polled with
thousands of them. :data:`http` makes no connection last beyond its
response, so every request reaches whichever ``--workers`` process the
kernel picks, and no idle connection holds up a daemon's stop.
"""

from __future__ import annotations

import atexit
import contextlib
import ssl

import httpx
import httpx2

#: the context every SDK client of the tests verifies with (loaded once)
TLS = ssl.create_default_context()

#: ``http.get(url)`` where ``httpx.get(url)`` would build a client
http = httpx.Client(timeout=30, verify=TLS, limits=httpx.Limits(max_keepalive_connections=0))
atexit.register(http.close)



class _SdkClient(httpx.Client):
    """Closed when collected, as the OpenAI SDK's own default client is (a test may drop
    its SDK client unclosed)."""

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _Sdk2Client(httpx2.Client):
    """:class:`_SdkClient` for the Anthropic SDK, which speaks through ``httpx2``."""

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def sdk_http() -> httpx.Client:
    """The ``http_client`` of an OpenAI SDK client: its own default, on the shared TLS
    context; the SDK's client closes it with itself."""
    return _SdkClient(verify=TLS, follow_redirects=True)


def sdk2_http() -> httpx2.Client:
    """:func:`sdk_http` for an Anthropic SDK client."""
    return _Sdk2Client(verify=TLS, follow_redirects=True)

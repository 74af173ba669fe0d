"""The access log: one line per request, with the fields the fleet file names (sans-IO).

A line is written once the answer is sent (its status and duration known),
at INFO on the ``direct_frontend.access`` logger, so ``--log-json`` makes it
one JSON object and the text format ``key=value`` pairs. The message itself
is the request line (``POST /v1/chat/completions 200``); what else it
carries is ``[frontend.access_log] fields``.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from direct_frontend.fleet.schema import AccessLogConfig
from direct_frontend.http.asgi import Scope, header

log: Final = logging.getLogger("direct_frontend.access")

#: paths a load balancer or Prometheus asks all the time: left out unless asked for
PROBES: Final = frozenset({"/health", "/ready", "/metrics"})


#: the scope key a generation's walk names its model under, once resolved
MODEL_KEY: Final = "direct_frontend.model"


def fields_of(config: AccessLogConfig, scope: Scope, status: int, duration_s: float,
              request_id: str) -> dict[str, Any]:
    """The line's fields, in ``config.fields`` order."""
    every: dict[str, Any] = {}
    for name in config.fields:
        if name == "method":
            every[name] = scope["method"]
        elif name == "path":
            every[name] = scope["path"]
        elif name == "status":
            every[name] = status
        elif name == "duration_ms":
            every[name] = round(duration_s * 1000, 3)
        elif name == "request_id":
            every[name] = request_id
        elif name == "model":
            every[name] = scope.get(MODEL_KEY)
        elif name == "client":
            client = scope.get("client")
            every[name] = f"{client[0]}:{client[1]}" if client else None
        elif name == "user_agent":
            every[name] = header(scope, b"user-agent").decode("latin-1") or None
    return every


def wanted(config: AccessLogConfig, path: str) -> bool:
    """Whether a request to ``path`` gets a line."""
    return config.enabled and (config.include_probes or path not in PROBES)


def write(config: AccessLogConfig, scope: Scope, status: int, duration_s: float,
          request_id: str) -> None:
    """Log the request's line (the caller checked :func:`wanted`)."""
    if log.isEnabledFor(logging.INFO):
        extra = fields_of(config, scope, status, duration_s, request_id)
        log.info("%s %s %d", scope["method"], scope["path"], status, extra=extra)

"""Logging setup: one JSON object per line for machines, or one readable line for people.

Both formats carry the same fields: the ``extra`` a call passed, and the
request id from :data:`current_request_id` (a context variable, so each Trio
task sees its own request's id without passing it around).
"""

from __future__ import annotations

import contextvars
import json as _json
import logging
import secrets
import sys
import time
from collections.abc import Mapping
from typing import Any, Final, TextIO

import msgspec

current_request_id: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar(
    "current_request_id", default=None
)

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "request_id",
}

_encode: Final = msgspec.json.Encoder(enc_hook=str).encode


def _timestamp(record: logging.LogRecord) -> str:
    """UTC ISO 8601 with milliseconds, e.g. ``2025-01-31T12:00:00.123Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + (
        f".{int(record.msecs):03d}Z"
    )


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """``request_id`` first (explicit ``extra`` wins over the context), then the extras."""
    fields: dict[str, Any] = {}
    rid = getattr(record, "request_id", None) or current_request_id.get()
    if rid:
        fields["request_id"] = rid
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRS:
            fields[key] = value
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            entry.setdefault(key, value)  # an extra never hides a core field
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        try:
            return _encode(entry).decode()
        except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
            # Lone surrogates or exotic values: the slow stdlib path never fails.
            return _json.dumps(entry, default=str)


def _kv(value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return _json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``; a traceback follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={_kv(v)}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class _OurHandler(logging.StreamHandler[TextIO]):
    """Marks the handler :func:`configure_logging` installed, so a second call replaces it."""


#: libraries whose DEBUG lines say nothing an operator acts on, in dozens per request
QUIET_BELOW_INFO: Final = ("hpack", "h2")


class _Stamp(logging.Filter):
    """Puts one field on every record a handler writes (a worker's index: ``worker=1``)."""

    def __init__(self, name: str, value: object) -> None:
        super().__init__()
        self.field, self.value = name, value

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, self.field, self.value)
        return True


def configure_logging(json: bool, level: str = "INFO", *, stream: TextIO | None = None,
                      worker: int | None = None) -> None:
    """Install our handler on the root logger (stderr unless ``stream`` is given).

    Handlers others installed (pytest's capture, for one) are left alone.
    ``worker``: this process is that worker of ``run --workers``; every line
    says so (``worker=N``), since N processes write to one stream.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _OurHandler)]:
        root.removeHandler(old)
    handler = _OurHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    if worker is not None:
        handler.addFilter(_Stamp("worker", worker))
    root.addHandler(handler)
    root.setLevel(numeric)
    for chatty in QUIET_BELOW_INFO:  # a line per header of every gRPC frame, even at DEBUG
        logging.getLogger(chatty).setLevel(max(numeric, logging.INFO))
    logging.captureWarnings(True)  # a library's warning is a log line too, in the same format


def new_request_id() -> str:
    """16 hex characters from the OS's CSPRNG: short enough for logs, unique enough for a
    fleet, and no window on a generator (every client sees its request's id)."""
    return secrets.token_hex(8)


def redact(value: str) -> str:
    """Hide a secret but keep a 4-character hint (to tell keys apart) if it is long."""
    if not value:
        return ""
    if len(value) < 12:
        return "***"
    return value[:4] + "***"


_logged_once: set[str] = set()


def log_once(
    logger: logging.Logger,
    key: str,
    msg: str,
    *args: object,
    level: int = logging.WARNING,
    extra: Mapping[str, object] | None = None,
) -> bool:
    """Log ``msg`` only the first time ``key`` is seen in this process; True if it logged.

    For faults that would otherwise repeat per message (malformed engine
    messages); the metrics still count every occurrence. Keys must come from a
    bounded set (e.g. engine and field), as they are kept for the process' life.
    """
    if key in _logged_once:
        return False
    _logged_once.add(key)
    logger.log(level, msg, *args, extra=extra)
    return True

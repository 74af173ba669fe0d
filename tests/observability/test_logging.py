"""Response rendering (checked with the official openai types), metrics and logging."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from direct_frontend.observability.logging import (
    configure_logging,
    current_request_id,
    log_once,
    new_request_id,
    redact,
)

MODEL = 'org/model "v2"'  # quotes prove the model name is JSON-escaped


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """Our handler on a buffer, removed afterwards so other tests see a clean root logger."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    stream = io.StringIO()
    yield stream
    for h in root.handlers:
        if h not in before:
            root.removeHandler(h)
    root.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logging_lines_with_request_id(log_stream: io.StringIO) -> None:
    configure_logging(json=True, level="debug", stream=log_stream)
    log = logging.getLogger("direct_frontend.test")
    log.debug("no request yet", extra={"engine": "e1", "count": 3, "odd": object()})
    token = current_request_id.set("req-1")
    try:
        log.info("in request %s", "x")
        log.info("explicit", extra={"request_id": "req-2"})
        try:
            raise RuntimeError("kaput")
        except RuntimeError:
            log.exception("failed")
    finally:
        current_request_id.reset(token)
    first, second, third, fourth = json_lines(log_stream)
    assert first["level"] == "DEBUG"
    assert first["logger"] == "direct_frontend.test"
    assert first["msg"] == "no request yet"
    assert (first["engine"], first["count"]) == ("e1", 3)
    assert first["odd"].startswith("<object")
    assert "request_id" not in first
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["msg"] == "in request x"
    assert second["request_id"] == "req-1"
    assert third["request_id"] == "req-2"
    assert fourth["level"] == "ERROR"
    assert fourth["request_id"] == "req-1"
    assert "RuntimeError: kaput" in fourth["exc"]


def test_json_logging_survives_surrogates(log_stream: io.StringIO) -> None:
    configure_logging(json=True, stream=log_stream)
    logging.getLogger("t").warning("bad \udcff text")
    assert json_lines(log_stream)[0]["msg"] == "bad \udcff text"


def test_text_logging_is_one_readable_line(log_stream: io.StringIO) -> None:
    configure_logging(json=False, level="INFO", stream=log_stream)
    log = logging.getLogger("t")
    log.debug("hidden")
    token = current_request_id.set("abcd")
    try:
        log.warning("hello", extra={"engine": "e 1", "n": 2})
    finally:
        current_request_id.reset(token)
    (line,) = log_stream.getvalue().splitlines()
    assert re.fullmatch(r"\S+Z WARNING t: hello request_id=abcd engine=\"e 1\" n=2", line), line


def test_configure_logging_replaces_its_own_handler(log_stream: io.StringIO) -> None:
    root = logging.getLogger()
    configure_logging(json=True, stream=io.StringIO())
    configure_logging(json=True, stream=log_stream)
    logging.getLogger("t").warning("once")
    assert len(json_lines(log_stream)) == 1
    assert sum(1 for h in root.handlers if isinstance(h.formatter, logging.Formatter)) >= 1
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging(json=True, level="chatty")


def test_log_once(log_stream: io.StringIO) -> None:
    configure_logging(json=True, stream=log_stream)
    log = logging.getLogger("t")
    key = "malformed:" + new_request_id()
    assert log_once(log, key, "bad message from %s", "e1", extra={"engine": "e1"}) is True
    assert log_once(log, key, "bad message from %s", "e1") is False
    (line,) = json_lines(log_stream)
    assert line["msg"] == "bad message from e1"
    assert line["level"] == "WARNING"
    assert line["engine"] == "e1"


def test_request_ids_and_redaction() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    assert redact("") == ""
    assert redact("short") == "***"
    secret = "sk-abcdefghijklmnop"
    assert redact(secret) == "sk-a***"
    assert "efgh" not in redact(secret)


def test_a_forked_child_draws_other_request_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(new_request_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = set(os.read(read, 4096).decode().split())
    os.close(read)
    parent = {new_request_id() for _ in range(8)}
    assert len(child) == 8 and not child & parent
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in child)


def test_debug_leaves_out_the_per_header_lines_of_http2(log_stream: io.StringIO) -> None:
    configure_logging(json=True, level="DEBUG", stream=log_stream)
    assert logging.getLogger("direct_frontend.x").isEnabledFor(logging.DEBUG)
    for chatty in ("hpack", "hpack.hpack", "h2.connection"):
        assert not logging.getLogger(chatty).isEnabledFor(logging.DEBUG)


def test_a_librarys_warning_is_a_log_line_in_the_same_format(log_stream: io.StringIO) -> None:
    logging.captureWarnings(False)  # an earlier test's hook went with its warnings context
    configure_logging(json=True, stream=log_stream, worker=1)
    try:
        warnings.warn("a library speaks", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    (line,) = json_lines(log_stream)
    assert "a library speaks" in line["msg"] and line["logger"] == "py.warnings"
    assert line["worker"] == 1

"""The demo fleet as a first run shows it: readable words, and a quiet log at a stop string."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.simulator.vocab import WORDS
from direct_frontend.text.demo_model import BUNDLED_DIR
from tests.support.daemon import fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http


def chat(url: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = http.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def test_the_demo_says_words_and_a_stop_string_leaves_no_info_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="grpclib.server")  # to see the line was not lost
    engine = sim_engine("a", eos_probability=0.0, decode_us_per_token=0)
    with running_daemon(tmp_path, fleet_text(BUNDLED_DIR, [engine]), watch_interval_s=None) as d:
        d.wait_serving(1)
        text = chat(d.url, max_tokens=200)["message"]["content"]
        assert text.isprintable() and text.isascii()
        words = text.split()
        assert len(words) > 100 and set(words) <= WORDS

        stop = words[3]
        stopped = chat(d.url, max_tokens=200, stop=[stop])
        assert stopped["finish_reason"] == "stop"
        assert stop not in stopped["message"]["content"]

        def cancelled() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("Request was cancel")]

        wait_for(lambda: bool(cancelled()), 10, "the engine to see the cancel")
        assert {r.levelno for r in cancelled()} == {logging.DEBUG}


def test_the_demo_cut_at_max_tokens_is_whole_words_and_json_mode_says_something(
    tmp_path: Path,
) -> None:
    engine = sim_engine("a", eos_probability=0.0, decode_us_per_token=0)
    with running_daemon(tmp_path, fleet_text(BUNDLED_DIR, [engine]), watch_interval_s=None) as d:
        d.wait_serving(1)
        for max_tokens in range(1, 61):  # a cut after every token of one answer
            cut = chat(d.url, max_tokens=max_tokens)
            assert cut["finish_reason"] == "length"
            assert cut["message"]["content"].isascii(), cut  # no piece of a character, no U+FFFD
        asked = "Describe a cat named Tom as JSON"
        answer = chat(d.url, messages=[{"role": "user", "content": asked}],
                      response_format={"type": "json_object"})
        written = json.loads(answer["message"]["content"])
        assert isinstance(written, dict) and len(written) >= 2
        assert set(written) <= {word.lower() for word in asked.split()}

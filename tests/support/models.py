"""Helpers for fleets of several models: [[engine]] tables, simulator counters, clients."""

from __future__ import annotations

import contextlib
import json
import textwrap
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import openai
from tokenizers import Tokenizer

from direct_frontend.simulator.scripted import ScriptBook
from tests.support.daemon import Daemon, free_port, running_daemon
from tests.support.http import sdk_http

#: simulator settings for tests that count tokens, not time
FAST = "decode_us_per_token = 0\nprefill_us_per_token = 0\neos_probability = 0.0"


def frontend_table(model_dir: object, extra: str = "") -> str:
    """``[frontend]`` on a free port with fast probes; ``extra``: more tables after it."""
    return textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:0"
        tokenizer = "{model_dir}"

        [frontend.probe]
        interval_s = 0.2
        timeout_s = 1.0
        """) + extra


def engine_table(name: str, kind: str, model: str | None, simulator: str = FAST) -> str:
    """A simulated [[engine]] of ``model`` (None: no model key) on a free port."""
    model_line = "" if model is None else f'model = "{model}"\n'
    return textwrap.dedent(f"""\
        [[engine]]
        name = "{name}"
        url = "grpc://127.0.0.1:{free_port()}"
        kind = "{kind}"
        {model_line}simulate = true
        [engine.simulator]
        """).replace("\n\n", "\n") + simulator


@contextlib.contextmanager
def openai_client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    """The official client on the daemon; closed after use (idle keep-alives hold up a stop)."""
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       http_client=sdk_http()) as client:
        yield client


def simulators(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.run_sync(lambda: dict(daemon.supervisor.simulators)))


def engine_requests(daemon: Daemon) -> dict[str, int]:
    """Generate calls each simulated engine has seen (its own counter)."""
    return {name: sim.stats.requests for name, sim in simulators(daemon).items()}


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def scripted_daemon(model_dir: Path, directory: Path, models: str, engine: str,
                    scripts: Mapping[str, str]) -> Iterator[Daemon]:
    """A daemon of ``models`` (``[[model]]`` tables, ``[frontend]`` keys before them) and the
    simulated ``engine`` tables, all serving, whose engines answer by ``scripts`` (ScriptBook)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with running_daemon(directory, frontend_table(model_dir, models) + "\n" + engine) as daemon:
        daemon.wait_serving(engine.count("[[engine]]"))  # every one: each gets the scripts
        for sim in simulators(daemon).values():
            sim.core.scripts = ScriptBook(tokenizer, scripts)
        yield daemon

"""Session affinity across router replicas that share nothing (no NATS, no store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_replicas import FAST, replicas
from tests.support.daemon import Daemon, sim_engine
from tests.support.http import http

SESSIONS = [f"conversation-{i}" for i in range(7)]


def served_by(daemon: Daemon) -> dict[str, int]:
    """Requests this replica has sent to each engine name so far."""
    return {e.name: e.load.requests_total for e in daemon.supervisor.catalog.engines}


def send(daemon: Daemon, session: str, turn: int, *, via: str) -> str:
    """One request of ``session`` (as a header, or as the OpenAI ``user`` or
    ``prompt_cache_key``); the engine it took."""
    before = served_by(daemon)
    body = {"model": "demo", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"{session} turn {turn} " * (turn + 1)}]}
    headers = {}
    if via == "header":
        headers["X-Session-Id"] = session
    else:
        body[via] = session
    response = http.post(daemon.url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    after = served_by(daemon)
    (engine,) = [name for name, count in after.items() if count != before.get(name, 0)]
    return engine


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_two_replicas_send_each_session_to_the_same_engine(
    model_dir: Path, tmp_path: Path, policy: str
) -> None:
    engines = [sim_engine(f"e{i}", "sglang", **FAST) for i in range(3)]
    extra = 'session_key = ["header:x-session-id", "user", "prompt_cache_key"]'
    with replicas(tmp_path, model_dir, engines, None, 2, policy=policy,
                  routing_extra=extra) as (first, second):
        homes: dict[str, set[str]] = {}
        for turn in range(3):
            for index, session in enumerate(SESSIONS):
                replica = (first, second)[(index + turn) % 2]
                engine = send(replica, session, turn,
                              via=("header", "user", "prompt_cache_key")[(index + turn) % 3])
                homes.setdefault(session, set()).add(engine)
        assert all(len(engines) == 1 for engines in homes.values()), homes
        assert len({next(iter(e)) for e in homes.values()}) > 1  # sessions spread out

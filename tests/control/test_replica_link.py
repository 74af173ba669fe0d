"""The replica link's own pacing, under a mock clock (no NATS needed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing

from direct_frontend.control.replicas import ReplicaLink
from direct_frontend.control.supervisor import Supervisor
from direct_frontend.fleet.schema import FleetConfig, FrontendConfig, ReplicasConfig
from direct_frontend.routing.peers import PlacementShare

INTERVAL_S = 0.02


def _link() -> ReplicaLink:
    fleet = FleetConfig(frontend=FrontendConfig(served_model_name="m", tokenizer=Path("/m")),
                        source=Path("/fleet.toml"))
    config = ReplicasConfig(nats="nats://127.0.0.1:1",
                            publish_interval_s=INTERVAL_S)
    return ReplicaLink(config, Supervisor(fleet), PlacementShare(), replica_id="r")


def test_news_that_arrives_as_the_tick_passes_never_waits_a_negative_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of load woke the link just as its tick passed, while the last change
    went out less than an interval ago: the tick is then already behind us, and the
    wait until it must end at once (Trio refuses a negative wait with ``ValueError``,
    which would end the link's task and the daemon with it).
    """
    clock = trio.testing.MockClock()

    async def main() -> None:
        # one fake time for the whole link, whichever clock it reads
        monkeypatch.setattr(time, "monotonic", trio.current_time)
        link = _link()
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def news() -> None:
                await link._news()
                done.set()

            nursery.start_soon(news)
            await trio.testing.wait_all_tasks_blocked()  # it waits for news or its tick
            clock.jump(INTERVAL_S * 2)  # the tick passes …
            link._last_change_sent_at = trio.current_time()  # … a change just went out …
            link._on_load_change()  # … and another wakes the link before it runs again
            with trio.fail_after(1):
                await done.wait()

    trio.run(main, clock=clock)

"""The simulator's LoRA slots: a cap, a load time, one prefix cache per adapter."""

from __future__ import annotations

from direct_frontend.simulator.kvcache import SimPrefixCache
from direct_frontend.simulator.lora import LoraSlots
from tests.support.sim import run


def slots(capacity: int) -> LoraSlots:
    return LoraSlots(capacity, 0.0, lambda: SimPrefixCache(64, 16, "sglang"))


def test_loads_are_capped_and_unloads_free_a_slot() -> None:
    async def body() -> None:
        loras = slots(1)
        assert await loras.load("a", "a", "/a") == ""
        assert await loras.load("a", "a", "/a") == ""  # already loaded: fine
        assert "slots are in use" in await loras.load("b", "b", "/b")
        assert loras.unload("", "a") == ""  # by name
        assert await loras.load("b", "b", "/b") == ""
        assert loras.ids == ["b"] and loras.stats.refused == 1
        assert "not loaded" in loras.unload("a", "a")

    run(body())


def test_each_adapter_has_its_own_prefix_cache() -> None:
    async def body() -> None:
        loras = slots(2)
        await loras.load("a", "a", "/a")
        await loras.load("b", "b", "/b")
        assert loras.cache_of("a") is not loras.cache_of("b")
        assert loras.cache_of("c") is None

    run(body())

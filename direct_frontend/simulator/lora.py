"""LoRA adapters on a simulated engine: loaded by id, a cap per engine, a load time.

What an SGLang engine does with ``LoadLoRAAdapter``: the adapter's weights
take a while to load, an engine holds a bounded number at once (a load past
the cap is refused: the router unloads first), and a request names its
adapter by the caller-minted ``lora_id`` (an id not loaded is refused). Each
adapter's prefix cache is its own, so a prompt cached under one adapter is
never a hit under another (or the base model): ``cached_tokens`` is per adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from direct_frontend.simulator.kvcache import SimPrefixCache


@dataclasses.dataclass(slots=True)
class LoadedAdapter:
    lora_id: str
    name: str
    path: str
    cache: SimPrefixCache


@dataclasses.dataclass(slots=True)
class LoraStats:
    loads: int = 0
    unloads: int = 0
    refused: int = 0


class LoraSlots:
    """The adapters one simulated engine holds (``capacity`` at most)."""

    def __init__(
        self, capacity: int, load_s: float, new_cache: Callable[[], SimPrefixCache]
    ) -> None:
        self.capacity = capacity
        self.load_s = load_s
        self._new_cache = new_cache
        self.loaded: dict[str, LoadedAdapter] = {}
        self.stats = LoraStats()

    @property
    def ids(self) -> list[str]:
        return list(self.loaded)

    async def load(self, lora_id: str, name: str, path: str) -> str:
        """Load an adapter; the reason it was refused, or "" when it is loaded."""
        if not lora_id:
            return "lora_id is required"
        if lora_id in self.loaded:
            return ""
        if len(self.loaded) >= self.capacity:
            self.stats.refused += 1
            return f"all {self.capacity} LoRA slots are in use; unload one first"
        await asyncio.sleep(self.load_s)
        if len(self.loaded) >= self.capacity:  # another load took the last slot meanwhile
            self.stats.refused += 1
            return f"all {self.capacity} LoRA slots are in use; unload one first"
        self.loaded[lora_id] = LoadedAdapter(lora_id, name, path, self._new_cache())
        self.stats.loads += 1
        return ""

    def unload(self, lora_id: str, name: str) -> str:
        """Unload by id (or by name); the reason it failed, or ""."""
        found = self.loaded.get(lora_id) or next(
            (a for a in self.loaded.values() if a.name == name), None
        )
        if found is None:
            return f"LoRA adapter {lora_id or name!r} is not loaded"
        del self.loaded[found.lora_id]
        self.stats.unloads += 1
        return ""

    def cache_of(self, lora_id: str) -> SimPrefixCache | None:
        adapter = self.loaded.get(lora_id)
        return None if adapter is None else adapter.cache

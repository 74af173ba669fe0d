"""The prompt cache: exact hits, LRU order, the byte bound, and what is never kept."""

from __future__ import annotations

from direct_frontend.pipeline.prompt_cache import PromptCache


def test_a_kept_prompt_is_found_and_counted() -> None:
    cache = PromptCache()
    assert cache.get(b"k") is None
    cache.put(b"k", "text", (1, 2, 3))
    assert cache.get(b"k") == ("text", (1, 2, 3))
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


def test_bytes_and_str_keys_never_meet() -> None:
    cache = PromptCache()
    cache.put(b"same", "chat", (1,))
    cache.put("same", "prompt", (2,))
    assert cache.get(b"same") == ("chat", (1,))
    assert cache.get("same") == ("prompt", (2,))


def test_the_least_recently_used_leave_first_within_the_bound() -> None:
    entry = len(b"k0") + len("t") + 36  # what one entry below costs
    cache = PromptCache(max_bytes=3 * entry)
    for i in range(3):
        cache.put(f"k{i}".encode(), "t", (i,))
    cache.get(b"k0")  # now the most recent
    cache.put(b"k3", "t", (3,))
    assert cache.get(b"k1") is None
    assert [cache.get(f"k{i}".encode()) is not None for i in (0, 2, 3)] == [True, True, True]
    assert cache.size == 3 * entry <= cache.max_bytes


def test_replacing_a_key_keeps_the_size_true() -> None:
    cache = PromptCache()
    cache.put(b"k", "a", (1, 2))
    cache.put(b"k", "abc", (1,))
    assert cache.size == 1 + 3 + 36
    assert len(cache) == 1


def test_long_prompts_and_entries_over_the_budget_are_not_kept() -> None:
    cache = PromptCache(max_bytes=1000, max_entry_chars=10)
    cache.put(b"k", "x" * 11, (1,))
    cache.put(b"j", "x" * 5, tuple(range(100)))  # 36 bytes a token: over 1000
    assert len(cache) == 0 and cache.size == 0

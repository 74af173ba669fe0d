"""The prompt caches: exact hits, LRU order, the byte bound, and what is never kept; the
prefix cache's longest shared cut."""

from __future__ import annotations

from direct_frontend.pipeline.prompt_cache import PrefixCache, PromptCache, Rendered
from direct_frontend.text.prompt_ids import PromptIds


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


def _rendered(text: str, cuts: list[int], n: int) -> Rendered:
    return Rendered(text, PromptIds(range(n)), cuts, [c // 2 for c in cuts])


def test_a_prefix_is_found_at_the_last_cut_both_share() -> None:
    cache = PrefixCache()
    kept = _rendered("<s>sys<u>hi<a>", [0, 6, 11], 7)
    cache.put(kept)
    # the kept text, then a cut: all of its ids
    reuse = cache.find("<s>sys<u>hi<a><u>more", [0, 6, 11, 14])
    assert reuse is not None and (reuse.cut, reuse.tokens) == (14, 7)
    # the kept text, then no cut: up to its last cut
    reuse = cache.find("<s>sys<u>hi<a>yes<u>more<a>", [0, 6, 11, 17, 24])
    assert reuse is not None and (reuse.cut, reuse.tokens) == (11, 5)
    # differs within "hi": only the first piece is shared
    reuse = cache.find("<s>sys<u>ho<a>", [0, 6, 11])
    assert reuse is not None and (reuse.cut, reuse.tokens) == (6, 3)
    # another first piece: nothing
    assert cache.find("<s>other<u>hi", [0, 8]) is None
    assert (cache.hits, cache.misses) == (3, 1)


def test_the_longest_kept_prompt_a_text_begins_with_is_found_by_its_early_cuts() -> None:
    cache = PrefixCache()
    short = _rendered("<s>sys<u>hi", [0, 6], 5)
    long = _rendered("<s>sys<u>hi<a>ok", [0, 6, 11], 8)
    other = _rendered("<s>sys<u>ho<a>", [0, 6, 11], 7)
    for entry in (long, short, other):
        cache.put(entry)
    assert cache.extended_by("<s>sys<u>hi<a>ok<u>more", [0, 6]) is long
    assert cache.extended_by("<s>sys<u>hi<u>more", [0, 6, 11]) is short
    assert cache.extended_by("<s>sys<u>h", [0, 6]) is None  # no kept one is its prefix
    assert cache.extended_by("<s>sys<u>hX<a>ok<u>more", [0, 6]) is None  # same head, then not
    assert cache.extended_by("<s>sya<u>hi<a>ok", [0, 6]) is None  # another first piece
    # a first piece longer than HEAD_CHARS: keyed by that much of it
    sys_prompt = "<s>" + "y" * 2000
    kept = _rendered(sys_prompt + "<u>hi", [0, 2003], 600)
    cache.put(kept)
    assert cache.extended_by(kept.text + "<a>", [0]) is kept
    assert (cache.hits, cache.misses) == (0, 0)  # look-ups, not uses


def test_find_takes_a_match_extended_by_proved_for_that_text_only() -> None:
    cache = PrefixCache()
    kept = _rendered("<s>sys<u>hi<a>", [0, 6, 11], 7)
    cache.put(kept)
    text = "".join(["<s>sys<u>hi<a>", "<u>more"])
    assert cache.extended_by(text, [0, 6]) is kept
    # another text of the same length that does not begin with the kept one: compared
    other = "".join(["<s>sys<u>ho<a>", "<u>more"])
    reuse = cache.find(other, [0, 6, 11, 14])
    assert reuse is not None and (reuse.cut, reuse.tokens) == (6, 3)
    # for the text it was made for: what a fresh look-up finds
    assert cache.extended_by(text, [0, 6]) is kept
    reuse = cache.find(text, [0, 6, 11, 14])
    assert reuse is not None and (reuse.entry, reuse.cut, reuse.tokens) == (kept, 14, 7)
    fresh = PrefixCache()
    fresh.put(kept)
    again = fresh.find(text, [0, 6, 11, 14])
    assert again is not None and (again.entry, again.cut, again.tokens) == (kept, 14, 7)


def test_the_prefix_cache_is_bounded_and_drops_what_a_longer_prompt_covers() -> None:
    cache = PrefixCache(max_bytes=10_000)
    first = _rendered("<s>sys<u>" + "x" * 100, [0, 6], 50)
    cache.put(first)
    longer = _rendered(first.text + "<a>", [0, 6, 109], 51)
    cache.put(longer, replaces=first)
    assert len(cache) == 1 and cache.size == longer.cost
    for i in range(100):
        cache.put(_rendered(f"<s>{i}<u>" + "y" * 100, [0, 4 + len(str(i))], 60))
    assert cache.size <= 10_000 and len(cache) < 100
    assert cache.find(longer.text, longer.cuts) is None  # the oldest left first

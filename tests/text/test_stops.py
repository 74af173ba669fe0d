"""Stop strings: matched across chunks, never emitted, earliest first, linear in time and memory."""

from __future__ import annotations

import random
import tracemalloc

from direct_frontend.text.stops import StopResult, StopStringMatcher


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character by character: the first stop string to complete, longest on ties."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            best = max(done, key=len)
            return text[: end - len(best)], best
    return text, None


def _held_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
    for start in range(len(text)):
        tail = text[start:]
        if any(len(s) > len(tail) and s.startswith(tail) for s in stops):
            return len(tail)
    return 0


def test_stop_across_chunk_boundary() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("The EN") == StopResult("The ", None)
    assert matcher.push("D and more") == StopResult("", "END")
    assert matcher.push("ignored") == StopResult("", None)
    assert matcher.flush() == ""


def test_stop_split_over_three_chunks() -> None:
    matcher = StopStringMatcher(["<stop>"])
    assert matcher.push("a<s").text == "a"
    assert matcher.push("to").text == ""
    assert matcher.push("p>b") == StopResult("", "<stop>")


def test_held_prefix_released_when_it_cannot_match() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xxab").text == "xx"
    assert matcher.push("d").text == "abd"
    assert matcher.push("a").text == ""
    assert matcher.flush() == "a"
    assert matcher.flush() == ""


def test_earliest_match_wins() -> None:
    assert StopStringMatcher(["b", "a"]).push("xaby") == StopResult("x", "a")
    # "BC" completes before "ABCD" does, whether or not the text comes in one chunk.
    assert StopStringMatcher(["ABCD", "BC"]).push("ABCD") == StopResult("A", "BC")
    chunked = StopStringMatcher(["ABCD", "BC"])
    assert chunked.push("AB") == StopResult("", None)
    assert chunked.push("CD") == StopResult("A", "BC")
    # Completing at the same character: the longer one (earlier start) wins.
    assert StopStringMatcher(["ND", "END"]).push("THE END") == StopResult("THE ", "END")


def test_stop_at_the_very_first_characters() -> None:
    assert StopStringMatcher(["Hi"]).push("Hi there") == StopResult("", "Hi")
    matcher = StopStringMatcher(["Hi"])
    assert matcher.push("H") == StopResult("", None)
    assert matcher.push("i") == StopResult("", "Hi")


def test_empty_and_duplicate_stops_ignored() -> None:
    matcher = StopStringMatcher(["", "x", "x"])
    assert matcher.stops == ("x",)
    assert StopStringMatcher([""]).push("anything") == StopResult("anything", None)
    assert StopStringMatcher([]).push("") == StopResult("", None)


def test_multichar_unicode_stop() -> None:
    matcher = StopStringMatcher(["🦜!"])
    assert matcher.push("hello 🦜") == StopResult("hello ", None)
    assert matcher.push("!") == StopResult("", "🦜!")


def test_stop_matcher_agrees_with_reference_on_random_streams() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        stops = [
            "".join(rng.choices("abc", k=rng.randrange(0, 5))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choices("abcd", k=rng.randrange(0, 30)))
        expected_text, expected_stop = _reference_stop(text, stops)
        matcher = StopStringMatcher(stops)
        out = ""
        consumed = ""
        matched: str | None = None
        pos = 0
        while pos < len(text) and matched is None:
            size = rng.randrange(1, 6)
            chunk = text[pos : pos + size]
            pos += size
            consumed += chunk
            result = matcher.push(chunk)
            out += result.text
            matched = result.matched
            assert expected_text.startswith(out), (text, stops)
            if matched is None:
                # Holds back exactly the longest tail that could still start a stop.
                assert len(consumed) - len(out) == _held_len(consumed, stops), (consumed, stops)
        if matched is None:
            out += matcher.flush()
        assert (out, matched) == (expected_text, expected_stop), (text, stops)



def _run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, str | None]:
    """Push ``chunks`` until a stop matches; flush at the end if none did."""
    out: list[str] = []
    for chunk in chunks:
        result = matcher.push(chunk)
        out.append(result.text)
        if result.matched is not None:
            return "".join(out), result.matched
    out.append(matcher.flush())
    return "".join(out), None


def _chunked(rng: random.Random, text: str, largest: int) -> list[str]:
    chunks = []
    pos = 0
    while pos < len(text):
        size = rng.randrange(0, largest + 1)  # empty chunks too
        chunks.append(text[pos : pos + size])
        pos += size
    return chunks


def test_agrees_with_reference_on_periodic_stops_and_special_characters() -> None:
    # Periodic stops exercise the fallbacks (borders) of the automaton; the alphabet
    # includes characters special in a regular-expression class, and astral ones.
    rng = random.Random(17)
    alphabets = ["ab", "ab]", "^-\\]a", "🦜a\n", "abcdefgh"]
    for _ in range(2000):
        alphabet = rng.choice(alphabets)
        text = "".join(rng.choices(alphabet, k=rng.randrange(0, 60)))
        stops = []
        for _ in range(rng.randint(1, 16)):
            if text and rng.random() < 0.5:  # a piece of the text, so that matches happen
                start = rng.randrange(len(text))
                stops.append(text[start : start + rng.randint(1, 12)])
            else:
                stops.append("".join(rng.choices(alphabet, k=rng.randrange(0, 12))))
        expected = _reference_stop(text, stops)
        assert _run(StopStringMatcher(stops), _chunked(rng, text, 8)) == expected, (text, stops)


def test_flush_releases_the_held_tail_and_the_matcher_starts_afresh() -> None:
    matcher = StopStringMatcher(["abcabd", "xyz"])
    assert matcher.push("..abcab") == StopResult("..", None)
    assert matcher.push("cab") == StopResult("abc", None)  # "abcab" again, shifted by three
    assert matcher.flush() == "abcab"
    assert matcher.push("d") == StopResult("d", None)  # a new stream: nothing held any more
    assert matcher.push("xy") == StopResult("", None)
    assert matcher.push("z!") == StopResult("", "xyz")


def test_a_100000_character_stop_string_is_linear_in_memory() -> None:
    # The stream keeps matching all but the last character of the stop: the worst case for
    # holding back (99,999 characters held for every chunk) and for the automaton's fallbacks.
    stop = "a" * 99_999 + "b"
    stream = "a" * 120_000
    chunks = [stream[i : i + 4] for i in range(0, len(stream), 4)]
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "zz"])
        emitted = sum(len(matcher.push(chunk).text) for chunk in chunks)
        final = matcher.push("b!")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert emitted == len(stream) - (len(stop) - 1)
    assert final == StopResult("", stop)
    # The stop string alone is 100 kB; a matcher that listed its prefixes took gigabytes.
    assert peak < 4_000_000, peak


def test_a_long_stop_string_releases_its_held_tail_exactly() -> None:
    rng = random.Random(3)
    stop = "".join(rng.choices("ab", k=20_000))
    stream = stop[:-1] + ("a" if stop[-1] == "b" else "b") + "tail"
    expected = _reference_stop(stream, [stop])
    assert expected == (stream, None)
    assert _run(StopStringMatcher([stop]), _chunked(rng, stream, 50)) == expected

"""The KV plane's page-size rule: the fleet file wins when set, discovery otherwise."""

from __future__ import annotations

from direct_frontend.control.kv_plane import engine_page_size
from direct_frontend.kv.regroup import compatible


def test_the_file_wins_over_discovery() -> None:
    assert engine_page_size(16, 1, 16) == 16
    assert engine_page_size(32, 16, 16) == 32


def test_discovery_when_the_file_is_silent_else_ours() -> None:
    assert engine_page_size(None, 1, 16) == 1
    assert engine_page_size(None, None, 16) == 16


def test_what_the_index_can_follow() -> None:
    ours = 16
    assert compatible(engine_page_size(None, 1, ours), ours)  # SGLang's default: re-cut
    assert compatible(engine_page_size(None, 64, ours), ours)  # coarser: split
    assert not compatible(engine_page_size(24, 16, ours), ours)  # the file's word, unusable

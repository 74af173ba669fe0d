"""Where a request crosses between http/ and pipeline/, seen from inside the daemon.

A *crossing* is a function of one of the two rooms that the other room's
code calls while a request runs: a pipeline function called from an http/
frame (the request going in), or an http/ function called from a pipeline/
frame (its events coming out). Each counts once, however often it is
called: the writer that gets a thousand batches is one crossing. They are
seen with a profile hook on the daemon's Trio thread for as long as the
block runs (a coroutine resumed counts like a call, from the frame that
awaits it), so a call through an attribute or a callback is seen as surely
as an import.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from tests.support.daemon import Daemon

PACKAGE = Path(__file__).resolve().parents[2] / "direct_frontend"
HTTP = str(PACKAGE / "http") + "/"
PIPELINE = str(PACKAGE / "pipeline") + "/"


@contextlib.contextmanager
def crossings(daemon: Daemon) -> Iterator[set[tuple[str, str]]]:
    """The crossings of what runs in the block: ("in", a pipeline function's qualified
    name) and ("out", an http/ function's)."""
    seen: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee.startswith(PIPELINE) and caller.startswith(HTTP):
            seen.add(("in", frame.f_code.co_qualname))
        elif callee.startswith(HTTP) and caller.startswith(PIPELINE):
            seen.add(("out", frame.f_code.co_qualname))

    daemon.run_sync(sys.setprofile, profile)
    try:
        yield seen
    finally:
        daemon.run_sync(sys.setprofile, None)

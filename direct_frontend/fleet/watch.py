"""Watch the fleet file and ask for a reload when it changes.

Polling ``stat`` twice a second is deliberate: it needs no inotify binding,
works on every filesystem, and sees every way editors save (in place, or a
new file renamed over the old one: the inode changes). A change is acted on
once the file has looked the same for one more poll, so a save in progress,
or the moment between an editor's unlink and rename, is not reloaded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

POLL_INTERVAL_S = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class FileStamp:
    """What ``stat`` says about a file; any field changing means the file may have."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp_of(path: Path) -> FileStamp | None:
    """The file's stamp, or None when it does not exist (right now)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ChangeDetector:
    """Sans-IO debouncing: feed one stamp per poll, get True once per settled change."""

    def __init__(self, initial: FileStamp | None) -> None:
        self.applied = initial  # the stamp the running fleet was loaded from
        self._last = initial

    def feed(self, stamp: FileStamp | None) -> bool:
        settled = stamp == self._last
        self._last = stamp
        if settled and stamp != self.applied:
            self.applied = stamp
            return True
        return False


async def watch_file(
    path: Path,
    on_change: Callable[[], Awaitable[object]],
    *,
    interval_s: float = POLL_INTERVAL_S,
    initial: FileStamp | None = None,
) -> None:
    """Call ``on_change`` after each settled change of ``path``, until cancelled.

    ``initial`` is the stamp taken when the running fleet was read, so an
    edit made while the daemon was starting is not missed.
    """
    detector = ChangeDetector(initial if initial is not None else stamp_of(path))
    while True:
        await trio.sleep(interval_s)
        stamp = await trio.to_thread.run_sync(stamp_of, path)
        if detector.feed(stamp):
            await on_change()

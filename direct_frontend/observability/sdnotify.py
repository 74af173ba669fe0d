"""systemd's notify protocol (``sd_notify``), written against the stdlib.

It is one datagram of ``KEY=value`` lines to the unix socket named by
``$NOTIFY_SOCKET`` (``@name`` is Linux's abstract namespace), so a
dependency would buy nothing. Outside systemd (no ``$NOTIFY_SOCKET``) every
call is a cheap no-op. A failed send is logged once and never raised: the
daemon must not die because its supervisor went away.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

import trio

log = logging.getLogger("direct_frontend.sdnotify")


def _address(raw: str) -> str | None:
    if raw.startswith("@"):
        return "\0" + raw[1:]  # abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # vsock and other schemes are not used by service units


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as systemd wants with ``RELOADING=1``."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends state to systemd; the environment decides whether anything is sent."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = _address(raw) if raw else None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying", raw)
        self.watchdog_s = _watchdog_interval(env)
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keyword names are the keys); True if it was sent."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # never stall the event loop on a full queue
            self._sock.sendto(message, self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("cannot notify systemd at %r: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def reloading(self) -> bool:
        return self.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec())

    def stopping(self) -> bool:
        return self.send(STOPPING=1, STATUS="stopping")

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def watchdog_loop(self) -> None:
        """Ping at half the watchdog interval, from the event loop itself.

        Running here (not in a thread) is the point: if the loop wedges, the
        pings stop and systemd restarts the daemon.
        """
        if self.watchdog_s is None or self.address is None:
            return
        while True:
            self.watchdog()
            await trio.sleep(self.watchdog_s / 2)


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """``$WATCHDOG_USEC`` in seconds when it is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # inherited from a parent that is the watched one
    return int(usec) / 1_000_000

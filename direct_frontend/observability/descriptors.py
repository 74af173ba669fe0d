"""The process's file descriptors: how many are open, and a soft limit raised to the hard one.

Every HTTP connection, engine channel and KV-event socket is a descriptor.
systemd (and most shells) start a service with a soft limit of 1,024 and a
much higher hard limit; at the soft limit ``accept`` fails with EMFILE and
the daemon stops answering, even ``/health``. An unprivileged process may
raise its soft limit up to the hard one, so the daemon does at start-up.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

#: Below this many descriptors after raising, the daemon warns: a busy server will run out.
LOW_LIMIT = 4096


def open_count() -> float:
    """Descriptors open in this process now (NaN where the system does not list them)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            # The directory handle listdir opens is in the listing too.
            return float(len(os.listdir(listing)) - 1)
        except OSError:
            continue
    return float("nan")


def soft_limit() -> float:
    """The soft descriptor limit (RLIMIT_NOFILE) now; infinity when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return float("inf") if soft == resource.RLIM_INFINITY else float(soft)


def raise_soft_limit() -> int:
    """Raise the soft descriptor limit to the hard one and log it; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS refuses RLIM_INFINITY
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
            return soft
        log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d", soft, hard)
        soft = hard
    else:
        log.info("open-file limit (RLIMIT_NOFILE): %d", soft)
    if soft != resource.RLIM_INFINITY and soft < LOW_LIMIT:
        log.warning(
            "the open-file limit is only %d (each connection takes one); raise it, e.g. "
            "LimitNOFILE= in the systemd unit or ulimit -n", soft,
        )  # fmt: skip
    return soft

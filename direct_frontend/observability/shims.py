"""Whether each hot-path shim over a library's internals is in use, and if not, why.

Two shims read or replace library internals to save CPU or latency per token
(docs/decisions/0002-hot-path-shims.md): :mod:`direct_frontend.engines.grpclib_reader`
and :mod:`direct_frontend.http.coalesce`. Both are gated alike by :func:`gate`:
the installed release must be on the shim's allow-list *and* the internals must
have the shape the shim reads; otherwise the library's own code runs. (A
third, :mod:`direct_frontend.http.keepalive`, stops hypercorn leaking closed
connections rather than saving CPU; it goes through the same gate.) Each
shim module registers how to read its state, so :func:`shims_active` is one
report, logged at start and exported as ``direct_frontend_shim_active``: a
dependency bump that switches a shim off is seen, not just paid for.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable, Collection


@dataclasses.dataclass(frozen=True, slots=True)
class ShimStatus:
    """One shim's state: in use or not, and the library release it was judged on."""

    shim: str
    active: bool
    reason: str  # the release it runs on, or why the library's own code runs instead

    def __str__(self) -> str:
        return f"{self.shim} {'on' if self.active else 'off'} ({self.reason})"


#: how to read each shim's state now, by shim name (each shim module adds its own)
_REPORTS: dict[str, Callable[[], ShimStatus]] = {}


def gate(
    shim: str,
    distribution: str,
    checked: Collection[str],
    shape_problem: Callable[[], str | None],
) -> ShimStatus:
    """The one gate for every shim: a checked release, and the internals as the shim reads them.

    ``shape_problem`` returns what differs (``None`` when nothing does); it is
    only asked on a release from ``checked``.
    """
    try:
        release = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        release = "of unknown release"
    if release not in checked:
        return ShimStatus(shim, False, f"{distribution} {release} is not a release it was "
                                       f"checked against ({', '.join(checked)})")
    problem = shape_problem()
    if problem is not None:
        return ShimStatus(shim, False, f"{distribution} {release}: {problem}")
    return ShimStatus(shim, True, f"{distribution} {release}")


def register(shim: str, report: Callable[[], ShimStatus]) -> None:
    """Make ``report`` (cheap: it runs on every metrics scrape) the way to read ``shim``."""
    _REPORTS[shim] = report


def shims_active() -> tuple[ShimStatus, ...]:
    """Every registered shim's state now, by name."""
    return tuple(report() for _, report in sorted(_REPORTS.items()))


def log_report(log: logging.Logger) -> None:
    """One line: info when every shim is in use, a warning when one is off (it costs CPU)."""
    report = shims_active()
    level = logging.INFO if all(s.active for s in report) else logging.WARNING
    log.log(level, "hot-path shims: %s", "; ".join(map(str, report)) or "none registered")

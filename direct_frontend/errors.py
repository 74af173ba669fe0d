"""Error kinds shared by every layer.

Dialects decide the kind of an engine failure once (from a gRPC status or a
transport fault); everything above them acts on kinds, never on raw codes.
"""

from __future__ import annotations

import dataclasses
import enum


class ErrorKind(enum.Enum):
    """What went wrong, in terms a router can act on."""

    UNAVAILABLE = "unavailable"  # transport fault, engine down: mark down, retry/migrate
    TIMEOUT = "timeout"  # deadline exceeded or stalled stream: like UNAVAILABLE
    OVERLOADED = "overloaded"  # resource exhausted: try another engine, never mark down
    BAD_REQUEST = "bad_request"  # the engine refused the input: a 4xx for the client
    CANCELLED = "cancelled"  # cancelled on purpose: never retried
    INTERNAL = "internal"  # engine-side failure: a 500
    PROTOCOL = "protocol"  # the engine broke its contract (e.g. no terminal message)
    DRAINING = "draining"  # the engine is leaving the fleet: move the stream, engine is fine

    @property
    def engine_is_down(self) -> bool:
        """Whether this failure should take the engine out of rotation at once."""
        return self in (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.PROTOCOL)


@dataclasses.dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class EngineError(Exception):
    """A failure of one engine call, already classified by the engine's dialect."""

    kind: ErrorKind
    message: str
    _: dataclasses.KW_ONLY
    #: the engine that failed ("" until the layer that knows it says)
    engine: str = ""
    #: the request field to blame, for a request refused before it was sent
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def at(self, engine: str) -> EngineError:
        """This failure as ``engine``'s: itself when it names an engine already (another
        leg's failure passing through), else a copy naming ``engine``."""
        return self if self.engine else dataclasses.replace(self, engine=engine)

    def __str__(self) -> str:
        where = f" ({self.engine})" if self.engine else ""
        return f"{self.kind.value}{where}: {self.message}"


class NoEngineAvailable(Exception):
    """No serving engine can take the request right now."""

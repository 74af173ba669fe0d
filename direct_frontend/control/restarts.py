"""Counting an engine's restarts from whatever that engine lets us see (sans-IO).

Engines say unequally much about their own restarts. SGLang reports its start
time and a vLLM servicer may report its uptime (the dialect turns either into
an *identity* that changes with each process), but the stock vLLM servicer
0.14.1 reports neither (docs/real-vllm.md §6). Two witnesses remain then: the
KV-event publisher, whose connection drops and comes back, or whose sequence
starts over, only when its process does (docs/kv-events.md §8.2); and the gRPC
connection, lost while the engine was out and replaced to rediscover it.

Several witnesses see the same restart (the identity and the publisher, and
every data-parallel rank's publisher restarts with its engine), so the count is
the most any one witness counted, never their sum. The connection witness is
a guess (an engine hung long enough for keepalive to drop its connection looks
the same), so it counts only where neither exact witness can say: the
reported starts are not comparable and the KV events are not followed.

Routing needs the other error bound: :attr:`RestartCount.lives` moves at every
witness, the guess included, and what the router remembers about the engine
is fenced by it. Forgetting a live process's placements costs a few cache
misses; crediting a new process with its predecessor's blocks sends requests
to a cold cache while the engine that holds their prefix stands by.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class RestartCount:
    """One engine incarnation's restarts, as its witnesses report them.

    ``total`` never goes down: it is the most any one witness has counted.
    """

    total: int = 0
    by_identity: int = 0
    by_publisher: int = 0
    by_connection: int = 0
    #: the engine's own start identity at the last discovery ("": it reports none)
    identity: str = ""
    #: the number of the gRPC connection the engine was last discovered on
    connection: int | None = None
    #: restarts each KV-event rank has seen of its publisher
    ranks: dict[int, int] = dataclasses.field(default_factory=dict)
    #: whether the engine's KV events are followed (the publisher is a witness)
    follows_publisher: bool = False
    #: moves whenever any witness says the process may be new (the guess too, and once
    #: per witness of one restart): the fence for what routing remembers of the engine
    lives: int = 0

    def discovered(self, identity: str, connection: int) -> bool:
        """The engine answered discovery over ``connection``; whether it looks restarted.

        The first discovery is the engine's start. After it, an engine that
        reports an identity restarted when that identity changed; otherwise, when
        a new connection was needed to reach it again. Whether that raises
        :attr:`total` depends on the other witnesses (one may have counted it).
        """
        first = self.connection is None
        comparable = bool(identity and self.identity)
        changed = comparable and identity != self.identity
        reconnected = not first and not comparable and connection != self.connection
        self.identity, self.connection = identity, connection
        self.by_identity += int(changed)
        if reconnected and not self.follows_publisher:  # the guess, when nothing better can say
            self.by_connection += 1
        self._settle()
        if changed or reconnected:
            self.lives += 1
        return changed or reconnected

    def publisher_restarted(self, rank: int) -> None:
        """Rank ``rank``'s KV-event publisher started over."""
        self.ranks[rank] = self.ranks.get(rank, 0) + 1
        self.by_publisher = max(self.ranks.values())
        self.lives += 1
        self._settle()

    def _settle(self) -> None:
        self.total = max(self.total, self.by_identity, self.by_publisher, self.by_connection)

"""When an engine call fails, what happens next: retry, migrate, or give up (sans-IO).

Before the first output token a failed request is simply retried on another
engine. After it, the request *migrates*: it continues on another engine
with the original prompt plus every token already generated, and a budget
reduced by what was produced, so the client's stream goes on unbroken (the
detokenizer and stop-string state live in the frontend and carry across).
Both are bounded. An overloaded engine is never marked down, only skipped.

A request does not go back to an engine it failed on, with one exception: an
engine that left the catalog and came back (a restart, a rejoin) is a new
chance. The rule is by serving stint: the control plane builds a new
:class:`EngineHandle` each time an engine starts serving, and a request only
excludes the handles it failed on. So a stream survives "every engine down
for a while, then one back" even when the one back is an engine it tried.

A request under a structured-output constraint cannot continue that way: no
contract can start an engine's grammar part-way (vLLM's
``grammar_from_first_token`` only says where a grammar starts, and a
continuation's generated tokens are prompt to the new engine, so its grammar
would start over on the rest). It is retried before its first token as any
other. After it, a *deterministic* one (temperature 0, or a seed) is
*replayed*: the new engine runs the client's own call again, constraint and
all (:func:`replay`), and the relay checks that its first tokens are the
ones already streamed, drops them, and streams on from there; a replay that
differs ends the stream with an error. Any other constrained stream ends
with an error rather than go on unconstrained (``unmigratable`` says why,
and the relay counts it).
"""

from __future__ import annotations

import dataclasses
import enum
import random

from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FaultsConfig
from direct_frontend.routing.catalog import Catalog, EngineHandle


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FailoverConfig:
    """Bounds on retries and migrations: ``[frontend.faults]`` (whose defaults are the
    schema's), and the backoff between attempts, which the fleet file does not set.
    """

    max_retries: int  # extra attempts before the first token
    max_migrations: int  # continuations after tokens were streamed
    stall_timeout_s: float  # no event for this long counts as an engine fault
    backoff_base_s: float = 0.02
    backoff_max_s: float = 0.5

    @classmethod
    def from_fleet(cls, faults: FaultsConfig) -> FailoverConfig:
        return cls(
            max_retries=faults.max_retries,
            max_migrations=faults.max_migrations,
            stall_timeout_s=faults.stall_timeout_s,
        )


class Decision(enum.Enum):
    RETRY = "retry"  # nothing was produced: same request on another engine
    MIGRATE = "migrate"  # continue on another engine from the tokens produced so far
    GIVE_UP = "give_up"


RETRYABLE = frozenset({
    ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.PROTOCOL, ErrorKind.OVERLOADED,
    ErrorKind.DRAINING,
})


class FailoverState:
    """The failure history of one request."""

    def __init__(
        self, config: FailoverConfig, rng: random.Random | None = None, *,
        unmigratable: str | None = None, replayable: bool = False,
    ) -> None:
        self.config = config
        #: why this request cannot continue on another engine once it has output (None: it can)
        self.unmigratable = unmigratable
        #: an unmigratable request that may move all the same, by a :func:`replay`
        self.replayable = replayable
        self.refused_migration = False  # it gave up for that reason
        self.retries = 0
        self.migrations = 0
        self.tried: set[str] = set()
        self.overloaded: set[str] = set()
        #: the serving stint each tried engine failed in (None: not known)
        self.failed_in: dict[str, EngineHandle | None] = {}
        self._rng = rng  # made on first use: seeding one costs a syscall, most requests never retry

    def decide(
        self, error: EngineError, produced_tokens: int, stint: EngineHandle | None = None
    ) -> Decision:
        """Record ``error`` from engine ``error.engine`` (serving as ``stint``) and decide."""
        if error.engine:
            self.tried.add(error.engine)
            self.failed_in[error.engine] = stint
            if error.kind is ErrorKind.OVERLOADED:
                self.overloaded.add(error.engine)
        if error.kind not in RETRYABLE:
            return Decision.GIVE_UP
        if produced_tokens == 0:
            if self.retries >= self.config.max_retries:
                return Decision.GIVE_UP
            self.retries += 1
            return Decision.RETRY
        if self.unmigratable is not None and not self.replayable:
            self.refused_migration = True
            return Decision.GIVE_UP
        if self.migrations >= self.config.max_migrations:
            return Decision.GIVE_UP
        self.migrations += 1
        return Decision.MIGRATE

    def backoff(self) -> float:
        """Seconds to wait before the next attempt: exponential, with full jitter."""
        attempt = self.retries + self.migrations
        cap = min(self.config.backoff_max_s, self.config.backoff_base_s * (2 ** (attempt - 1)))
        if self._rng is None:
            self._rng = random.Random()
        return self._rng.uniform(0, cap)

    def excluded(self, catalog: Catalog) -> set[str]:
        """The engines of ``catalog`` this request may not use: still in the stint it failed in.

        A tried engine whose stint is not known is excluded whatever its stint.
        """
        failed_in = self.failed_in
        return {
            engine.name for engine in catalog.engines
            if engine.name in failed_in and failed_in[engine.name] in (None, engine)
        }

    @property
    def all_overloaded(self) -> bool:
        return bool(self.overloaded) and self.overloaded == self.tried


def continuation(call: GenerateCall, generated: tuple[int, ...], attempt: int) -> GenerateCall:
    """The call that resumes ``call`` after ``generated`` tokens, token-exactly.

    The engine sees the original prompt followed by the generated tokens as
    its prompt, and only the remaining budget, so its logprobs start at the
    first new token: positions neither repeat nor go missing. A fresh request id keeps it
    distinct from the failed attempt, which may still linger on its engine.
    """
    sampling = dataclasses.replace(
        call.sampling,
        max_tokens=call.sampling.max_tokens - len(generated),
        min_tokens=max(0, call.sampling.min_tokens - len(generated)),
        # output logprobs are asked again (for the new tokens only: the old are the
        # prompt now); the prompt's came with the first tokens, so only a retry asks
        prompt_logprobs=call.sampling.prompt_logprobs if not generated else None,
    )
    return dataclasses.replace(
        call,
        request_id=f"{call.request_id.split('~')[0]}~{attempt}",
        input_ids=(*call.input_ids, *generated) if generated else call.input_ids,
        sampling=sampling,
    )


def deterministic(sampling: SamplingOptions) -> bool:
    """Whether another engine given the same call would produce the same tokens (a replay may)."""
    return sampling.temperature == 0 or sampling.top_k == 1 or sampling.seed is not None


def replay(call: GenerateCall, attempt: int) -> GenerateCall:
    """The client's own call again, for an engine to regenerate a constrained output from its start.

    Its constraint then holds from the first token, as on the engine that
    failed; the relay checks the tokens already streamed against the replay's
    first ones and drops them. The prompt's logprobs came with the first
    attempt, so they are not asked again; a fresh request id, as for a
    :func:`continuation`.
    """
    return dataclasses.replace(
        call,
        request_id=f"{call.request_id.split('~')[0]}~{attempt}",
        sampling=dataclasses.replace(call.sampling, prompt_logprobs=None),
    )

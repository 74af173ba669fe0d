"""The real-time routing bench's workload shapes, and the same shapes in virtual time.

A shape is one point of ``bench_routing.py live``: the fleet (engines, each
one's prefix cache, their step timing) and the traffic. Traffic comes in
*sessions*: a user's chat, or an agent's loop. Sessions start open-loop
(Poisson at ``sessions_per_s``; with ``burst``, on/off: the rate is
``burst[2]`` times higher for ``burst[0]`` seconds, then low for ``burst[1]``,
the same mean), each picks a tenant (Zipf ``skew`` popularity) whose system
prompt it starts with, and runs its turns one after another: a turn appends a
message (a user's, or an agent's tool output) and is sent ``think`` seconds
after the previous answer arrived, which is appended in turn. So every prompt
extends its session's previous one, and a hot tenant's sessions share its
system prompt.

:func:`run_virtual` plays a shape against engines modelled in virtual time
(``routing_cached.CachedEngine``: the simulated engines' own prefix cache,
pages of the shape's size, and their chunked-prefill steps) in the grid's
event loop (``routing_model.VirtualTime``), with the real policy objects and
the real KV index, each request reaching its engine ``daemon_s`` after it is
sent; and the pooled-LRU reference (every engine's cache as one LRU of the
router's blocks, each request on the least-loaded engine: what partitioning
perfectly would leave to gain). The live bench (``routing_live.py``) plays
the same sessions, seed for seed, against the real daemon and simulated
engines whose steps and caches are these (``direct_frontend/simulator/``),
so the two rank the policies on the same traffic. What the model leaves
out: the answer travels back as text and is tokenized again (offline, the
next prompt keeps every token of ~95 % of answers and loses 1–2 of the
rest), the foreign load the daemon reads from the engines, and the CPU the
processes spend, but for the fixed ``daemon_s``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

from routing_cached import CachedEngine
from routing_model import ModelEngine, Request, VirtualTime, held_blocks
from routing_sim import Point, make_policy, pct

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import Placement, RequestView

MODES = ("round_robin", "least_loaded", "cache_affinity", "kv-events", "approximate")
OURS = "kv-events"
POOLED_LRU = "pooled-lru"
#: the chat template's tokens around each message (the demo model's ChatML)
TEMPLATE_TOKENS = 5


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """One point of the real-time bench (see the module docstring)."""

    name: str
    engines: int = 4
    #: the fleet's prefix caches together, as a multiple of the working set (see
    #: :meth:`working_set_tokens`), shared out by ``sizes`` (relative, one per engine in
    #: turn: (2, 1) makes every other engine's cache half the size)
    cache: float = 1.0
    sizes: tuple[float, ...] = (1.0,)
    tenants: int = 8
    skew: float = 0.0
    system_tokens: int = 1200
    #: agent loops: each turn's message is a tool output (``message_tokens`` long)
    agent: bool = False
    message_tokens: tuple[int, int] = (30, 90)
    answer_tokens: tuple[int, int] = (20, 50)
    turns: tuple[int, int] = (3, 6)
    think_s: float = 1.0
    sessions_per_s: float = 3.0
    #: on/off bursts of session starts: (on seconds, off seconds, on rate ÷ off rate)
    burst: tuple[float, float, float] | None = None
    #: sessions start within this many seconds (the run lasts until the last one ends)
    duration_s: float = 14.0
    #: the engines' KV page (1: SGLang's default) and the router's block
    page_size: int = 16
    block_size: int = 16
    # engine timing, as simulator/steps.py runs it
    step_us: float = 8000.0
    prefill_us: float = 150.0
    decode_us: float = 600.0
    chunk_tokens: int = 2048
    max_running: int = 32
    #: the model only: how late the router's index hears of a cache change (KV events over
    #: ZMQ, then the daemon's own event loop; up to 50 ms changes nothing measurable)
    event_lag_s: float = 0.0
    #: the model only: how long after a request is sent it is routed and reaches its engine
    #: (the client's and the daemon's own work on it). The live run's TTFT on the roomy
    #: shape, where nearly everything is cached, is ~10 ms above the model's without it; half
    #: of that is taken to come before the engine (the rest, the first token's way back,
    #: moves no decision)
    daemon_s: float = 0.005
    #: the modelled engines store a prompt's blocks when they admit it, as the live bench's
    #: simulated engines do (False: when its prefill ends, as vLLM does)
    store_at_admission: bool = True

    def cache_of(self, engine: int) -> int:
        """Engine ``engine``'s prefix cache in tokens (a whole number of blocks)."""
        share = [self.sizes[n % len(self.sizes)] for n in range(self.engines)]
        tokens = self.cache * self.working_set_tokens() * share[engine] / sum(share)
        return max(1, round(tokens / self.block_size)) * self.block_size

    def capacity_blocks(self, engine: int) -> int:
        return max(1, self.cache_of(engine) // self.block_size)

    def point(self) -> Point:
        """The virtual engines' parameters (their caches are set one by one)."""
        return Point(engines=self.engines, block_size=self.block_size,
                     step_ms=self.step_us / 1e3, prefill_us=self.prefill_us,
                     decode_us=self.decode_us, chunk=self.chunk_tokens,
                     max_running=self.max_running, store_at_admission=self.store_at_admission)

    def working_set_tokens(self) -> float:
        """Every system prompt, plus the sessions running at once at half their length.

        A session lasts its turns × (think time + about half a second to answer);
        by Little's law ``sessions_per_s`` × that many run at once.
        """
        turns = sum(self.turns) / 2
        per_turn = (sum(self.message_tokens) / 2 + sum(self.answer_tokens) / 2
                    + 2 * TEMPLATE_TOKENS)
        live = self.sessions_per_s * turns * (self.think_s + 0.5)
        return self.tenants * self.system_tokens + live * turns * per_turn / 2

    def describe(self) -> str:
        caches = "/".join(sorted({f"{self.cache_of(n) / 1024:.1f}k"
                                  for n in range(self.engines)}, reverse=True))
        kind = "agent loops" if self.agent else "chat"
        burst = (f", bursts {self.burst[0]:g}s on/{self.burst[1]:g}s off ×{self.burst[2]:g}"
                 if self.burst else "")
        return (f"{self.name}: {self.engines} engines, caches {caches} tokens "
                f"(fleet {self.cache:g}× the working set), page {self.page_size}; {kind}, "
                f"{self.tenants} tenants skew {self.skew:g}, system {self.system_tokens}, "
                f"messages {self.message_tokens[0]}–{self.message_tokens[1]}, answers "
                f"{self.answer_tokens[0]}–{self.answer_tokens[1]}, turns "
                f"{self.turns[0]}–{self.turns[1]}; {self.sessions_per_s:g} sessions/s"
                f"{burst} for {self.duration_s:g} s")


def shapes() -> list[Shape]:
    """The real-time grid: every dimension the issue names, in five points.

    Uniform and Zipf tenants, steady and on/off starts, chat and agent loops,
    roomy to tight caches, 2 to 8 engines, equal and unequal caches, pages of
    1 and 16 tokens. Each plays in about 20 s (sessions start for
    ``duration_s``, the last ones finish a few turns later).
    """
    return [
        Shape("two-roomy", engines=2, tenants=6, skew=0.8, cache=3.0, sessions_per_s=2.5),
        Shape("chat-tight-p1", tenants=16, system_tokens=2000, cache=0.8, page_size=1),
        Shape("zipf-burst", tenants=12, skew=1.0, cache=1.0, burst=(3.0, 4.0, 4.0)),
        Shape("agent-zipf-burst", agent=True, tenants=8, skew=1.0, system_tokens=2000,
              message_tokens=(100, 400), answer_tokens=(15, 40), turns=(5, 10),
              think_s=0.3, cache=1.5, burst=(3.0, 4.0, 3.0), sessions_per_s=1.5),
        Shape("hetero-8", engines=8, sizes=(2.0, 1.0), tenants=16, skew=0.6, cache=0.8,
              sessions_per_s=4.0),
    ]


QUICK = ("chat-tight-p1", "agent-zipf-burst")


# -- sessions ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    message: int  # tokens of the user message or tool output
    answer: int  # tokens the engine generates (engines never stop early)
    think_s: float  # pause after the previous answer before this turn is sent


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    number: int
    start: float
    tenant: int
    turns: tuple[Turn, ...]


def session_starts(shape: Shape, rng: random.Random) -> list[float]:
    """Open-loop start times within ``duration_s`` (on/off rates by thinning)."""
    mean = shape.sessions_per_s
    if shape.burst is None:
        high = low = mean
    else:
        on, off, ratio = shape.burst
        low = mean * (on + off) / (on * ratio + off)
        high = low * ratio
    out = []
    t = 0.0
    while True:
        t += rng.expovariate(high)
        if t >= shape.duration_s:
            return out
        if shape.burst is not None:
            on, off, _ = shape.burst
            if (t % (on + off)) >= on and rng.random() > low / high:
                continue
        out.append(t)


def sessions(shape: Shape, seed: int) -> list[Session]:
    """The seeded sessions: the same for every mode, live and virtual."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** shape.skew for k in range(shape.tenants)]
    out = []
    for number, start in enumerate(session_starts(shape, rng)):
        tenant = rng.choices(range(shape.tenants), weights)[0]
        turns = tuple(
            Turn(rng.randint(*shape.message_tokens), rng.randint(*shape.answer_tokens),
                 0.0 if k == 0 else rng.expovariate(1 / shape.think_s))
            for k in range(rng.randint(*shape.turns)))
        out.append(Session(number, start, tenant, turns))
    return out


# -- virtual time ----------------------------------------------------------------


def run_virtual(shape: Shape, seed: int, mode: str,
                knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One mode (or :data:`POOLED_LRU`) on fresh modelled engines; the run's figures."""
    rng = random.Random(seed ^ 0x5EED)
    systems = [[rng.randrange(10, 30_000) for _ in range(shape.system_tokens)]
               for _ in range(shape.tenants)]
    point = shape.point()
    bs = shape.block_size
    index = KvIndex(bs)

    lag = shape.event_lag_s

    def publish(key: str, event: Any) -> None:
        if lag > 0:  # the router hears of it later (transport, its own event loop)
            clock.later(clock.now + lag, lambda: index.apply_events(key, (event,)))
        else:
            index.apply_events(key, (event,))

    pooled = mode == POOLED_LRU
    # the simulated engines' own caches (pages of the shape's size), but for the reference
    engines = [ModelEngine(point, n, publish) if pooled
               else CachedEngine(point, n, publish, shape.page_size, shape.cache_of(n))
               for n in range(shape.engines)]
    pool: dict[int, None] = {}  # one LRU over every engine's blocks (the reference)
    pool_capacity = sum(shape.capacity_blocks(n) for n in range(shape.engines))
    for n, engine in enumerate(engines):
        engine.capacity = math.inf if pooled else shape.capacity_blocks(n)
    handles = tuple(
        EngineHandle(name=f"e{n}", kind="vllm", url=f"sim://{n}", incarnation=n,
                     role=EngineRole.BOTH,
                     info=EngineInfo("sim", block_size=bs, kv_capacity_tokens=shape.cache_of(n)),
                     context_length=None, transport=None)
        for n in range(shape.engines))
    catalog = Catalog(1, handles)
    clock = VirtualTime(engines, None)
    policy = None if pooled else make_policy(
        mode, KvAwareKnobs(block_size=bs, **(knobs or {})), index, shape.engines,
        lambda: clock.now)
    clock.policy = policy
    state: dict[int, tuple[Session, list[int], int]] = {}  # number → (session, history, turn)
    for session in sessions(shape, seed):
        state[session.number] = (session, list(systems[session.tenant]), 0)
        clock.send_at(session.start, session.number)
    issued = 0

    def send(t: float, number: int) -> None:
        nonlocal issued
        session, history, k = state[number]
        turn = session.turns[k]
        message = [rng.randrange(10, 30_000) for _ in range(turn.message + TEMPLATE_TOKENS)]
        answer = [rng.randrange(10, 30_000) for _ in range(turn.answer + TEMPLATE_TOKENS)]
        tokens = history + message
        request = Request(issued, session, tokens, answer[:turn.answer], t)  # type: ignore[arg-type]
        issued += 1
        state[number] = (session, tokens + answer, k)
        request.hashes = prefix_hashes(tokens, bs)
        if shape.daemon_s > 0:  # the daemon's own work before it routes and sends
            clock.later(t + shape.daemon_s, lambda: route(request, turn.answer, tokens + answer))
        else:
            route(request, turn.answer, tokens + answer)

    def route(request: Request, answer_tokens: int, whole: list[int]) -> None:
        """``request`` placed (``whole``: its prompt and answer as the next turn carries them)."""
        tokens = request.tokens
        if pooled:
            request.bound_blocks = held_blocks(pool, request.hashes)
            for h in reversed(prefix_hashes(whole, bs)):
                pool.pop(h, None)
                pool[h] = None  # most recent last
            while len(pool) > pool_capacity:
                del pool[next(iter(pool))]
            placement = Placement(handles[min(range(len(engines)),
                                              key=lambda n: (engines[n].queued, n))])
        else:
            assert policy is not None
            chosen = policy.choose(catalog, RequestView(tuple(tokens), answer_tokens))
            assert chosen is not None
            placement = chosen
        clock.dispatch(request, placement)

    def done(t: float, request: Request) -> None:
        number = request.user.number  # type: ignore[attr-defined]
        session, history, k = state[number]
        if k + 1 < len(session.turns):
            state[number] = (session, history, k + 1)
            clock.send_at(t + session.turns[k + 1].think_s, number)

    finished = clock.run(send, done)
    return figures(mode, seed, finished, engines, policy, shape.prefill_us)


def figures(mode: str, seed: int, finished: Sequence[Request], engines: Sequence[ModelEngine],
            policy: Any, prefill_us: float) -> dict[str, Any]:
    ttft = sorted(r.ttft * 1e3 for r in finished)
    prompt = sum(len(r.tokens) for r in finished)
    cached = sum(r.cached_tokens for r in finished)
    return {
        "mode": mode, "seed": seed, "requests": len(finished), "ttft_ms": ttft,
        "ttft_mean_ms": statistics.fmean(ttft), "ttft_p90_ms": pct(ttft, 90),
        "ttft_p99_ms": pct(ttft, 99), "hit_rate": cached / max(1, prompt),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_ms": (prompt - cached) * prefill_us / 1e3 / max(1, len(finished)),
        "evictions": sum(e.evictions for e in engines),
        "per_engine": [e.requests for e in engines],
        "spills": policy.spills if isinstance(policy, KvAware) else 0,
    }

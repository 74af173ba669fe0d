"""Routing policies against modelled engines in virtual time: a grid that tells them apart.

Why: on a 2-core machine shared with other work, wall-clock runs over real
sockets measure CPU noise as much as routing. Here the *real* policy objects
(``direct_frontend.routing``) and the *real* KV index (``direct_frontend.kv``)
route an open-loop multi-turn workload to engines modelled in virtual time, so
every figure is deterministic for a seed and a grid of dozens of points runs in
minutes.

Engines (``routing_model.py``; the live shapes' run the simulated engines' own
cache instead, ``routing_cached.py``): a prefix cache of
``capacity`` blocks with LRU eviction (a block's
chain is touched tail first, so a prefix's tail goes before its root, as
vLLM's free-block queue does; blocks of running requests are pinned), and
the simulated engines' own chunked-prefill steps (``StepLoop`` of
``direct_frontend/simulator/steps.py``, played in virtual time): each step
prefills up to ``chunk`` tokens of the admitted requests (first come, first
served) and decodes one token of every decoding request, and lasts
``step_ms + prefill_us × prefill tokens + decode_us × decoding requests`` —
so prefill slows with concurrent prefills (they share the chunk budget) and
with the decode batch, and decode slows with batch size and with prefills.
At most ``max_running`` requests are admitted; the rest wait. The cache hit
is looked up when a request is admitted; computed blocks enter the cache
(BlockStored events to the router's index) when its prefill ends (or, with
``store_at_admission``, when it is admitted, as the simulated engines store
them), the answer's blocks when it finishes; evictions are BlockRemoved events.

Workload: ``tenants`` × ``users`` users; each tenant has one system prompt
(``system_tokens``) its users share (tenants picked with Zipf ``skew`` when a
user starts a conversation); a conversation has ``turns`` turns, each appending
a user message and the answer, so prompts grow. Each user sends open-loop
(Poisson, an exponential think time after its previous turn was *sent*, so
an overloaded fleet is not spared by slower users; answers are known in
advance, so a turn sent before its previous answer arrived simply finds less
cached). The rate is ``load`` × the fleet's nominal capacity: what it could
serve if every prompt but its new message were cached.

Cache size: ``cache`` × the per-engine share of the live working set (every
tenant's system prompt plus every user's current conversation at its mean
length, divided by the engines).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import heapq
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from routing_model import ExactGreedy, ModelEngine, Request, VirtualTime, held_blocks

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.cache_affinity import CacheAffinity
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.hitrate import HitRateMonitor
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import LeastLoaded, Placement, Policy, RequestView, RoundRobin
from direct_frontend.simulator.model import TimingModel

MODES = ("round_robin", "least_loaded", "cache_affinity", "kv-events", "approximate")
OURS = "kv-events"
#: with data-parallel engines (``Point.dp_ranks`` > 1): ours without pinning a rank (as it
#: was before it pinned them): the engine's own balancer picks the rank, and sees no cache
UNPINNED = "kv-events-unpinned"
#: not policies: bounds no router can beat on the same engines and workload (:class:`Oracle`):
#: the engines' caches pooled, and one unbounded shared cache; and a reference, no bound:
#: the engines' caches pooled under their own LRU
ORACLE = "oracle"
ORACLE_UNBOUNDED = "oracle-unbounded"
POOLED_LRU = "pooled-lru"
#: a reference, no bound: each request where its own first token comes soonest, by the
#: engines' exact state (:func:`first_token_in`): the best a router without foresight does greedily
EXACT_GREEDY = "exact-greedy"
ORACLES = (ORACLE, ORACLE_UNBOUNDED, POOLED_LRU, EXACT_GREEDY)


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    """One grid point: the fleet, the workload and the load."""

    engines: int = 4
    tenants: int = 8
    users: int = 16  # per tenant
    skew: float = 0.0
    system_tokens: int = 1500
    user_tokens: tuple[int, int] = (40, 120)
    answer_tokens: tuple[int, int] = (60, 160)
    turns: int = 4
    load: float = 0.7
    cache: float = 0.5
    requests: int = 1200
    block_size: int = 16
    # engine timing
    step_ms: float = 6.0
    prefill_us: float = 100.0
    decode_us: float = 250.0
    chunk: int = 2048
    max_running: int = 48
    #: data-parallel ranks per engine: each a cache and a step loop of its own behind one
    #: handle (``max_running`` and the cache are per rank, as a real engine's are)
    dp_ranks: int = 1
    #: the engines store a prompt's blocks (and announce them) when they admit it, as the
    #: simulated engines do (simulator/kvcache.py), not when its prefill ends, as vLLM does
    store_at_admission: bool = False

    def label(self) -> str:
        ranks = f" · {self.engines} engines × {self.dp_ranks} ranks" if self.dp_ranks > 1 else ""
        return (f"cache {self.cache:g}× · {self.tenants}×{self.users} skew {self.skew:g} · "
                f"system {self.system_tokens} · load {self.load:g}{ranks}")

    @property
    def caches(self) -> int:
        """The caches (and step loops) of the fleet: one per engine and rank."""
        return self.engines * self.dp_ranks

    @property
    def mean_user(self) -> float:
        return sum(self.user_tokens) / 2

    @property
    def mean_answer(self) -> float:
        return sum(self.answer_tokens) / 2

    def working_set_blocks(self) -> float:
        systems = self.tenants * math.ceil(self.system_tokens / self.block_size)
        history = self.turns * (self.mean_user + self.mean_answer) / self.block_size
        return systems + self.tenants * self.users * history

    def capacity_blocks(self) -> int:
        """One cache's size: one engine's, or one rank's of a data-parallel engine."""
        return max(1, round(self.cache * self.working_set_blocks() / self.caches))

    def timing(self) -> TimingModel:
        """The engines' steps, as the simulator's engines run them (simulator/steps.py)."""
        return TimingModel(prefill_us_per_token=self.prefill_us, decode_us_per_token=self.decode_us,
                           max_running=self.max_running, chunk_tokens=self.chunk,
                           step_us=self.step_ms * 1e3)

    def capacity_rps(self) -> float:
        """Requests/s the fleet serves if only each new message were prefilled (batch 16)."""
        prefill_s = (self.mean_user + self.block_size) * self.prefill_us * 1e-6
        decode_s = self.mean_answer * (self.decode_us * 1e-6 + self.step_ms * 1e-3 / 16)
        return self.caches / (prefill_s + decode_s)


# -- workload ----------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class User:
    tenant: int
    rng: random.Random
    history: list[int] = dataclasses.field(default_factory=list)
    turn: int = 0
    next_at: float = 0.0  # when the user sends first


class Workload:
    """Users' next prompts; the same seed gives every mode the same prompts and answers."""

    def __init__(self, point: Point, seed: int) -> None:
        self.point = point
        rng = random.Random(seed)
        self.systems = [[rng.randrange(10, 50_000) for _ in range(point.system_tokens)]
                        for _ in range(point.tenants)]
        weights = [1 / (k + 1) ** point.skew for k in range(point.tenants)]
        self.weights = weights
        self.users = [User(t, random.Random(rng.getrandbits(64)))
                      for t in range(point.tenants) for _ in range(point.users)]
        think = len(self.users) / (point.load * point.capacity_rps())
        self.think_s = think
        for user in self.users:
            user.next_at = user.rng.expovariate(1 / think)

    def next_request(self, user: User, rid: int, now: float) -> Request:
        p = self.point
        rng = user.rng
        if user.turn == 0:
            user.tenant = rng.choices(range(p.tenants), self.weights)[0]
            user.history = list(self.systems[user.tenant])
        message = [rng.randrange(10, 50_000) for _ in range(rng.randint(*p.user_tokens))]
        answer = [rng.randrange(10, 50_000) for _ in range(rng.randint(*p.answer_tokens))]
        tokens = user.history + message
        user.history = tokens + answer
        user.turn = (user.turn + 1) % p.turns
        return Request(rid, user, tokens, answer, now)


# -- the oracles: bounds, not policies ---------------------------------------


def arrivals(point: Point, seed: int) -> list[Request]:
    """The run's requests in the order they are sent: the same for every mode (see ``run``)."""
    workload = Workload(point, seed)
    heap = [(user.next_at, n) for n, user in enumerate(workload.users)]
    heapq.heapify(heap)
    out: list[Request] = []
    while len(out) < point.requests:
        t, n = heapq.heappop(heap)
        user = workload.users[n]
        out.append(workload.next_request(user, len(out), t))
        heapq.heappush(heap, (t + user.rng.expovariate(1 / workload.think_s), n))
    return out


def best_hits(point: Point, requests: Sequence[Request], capacity: float) -> list[int]:
    """Per request, the most of its prompt blocks one cache of ``capacity`` blocks can hold.

    Belady's MIN with bypass, which no eviction policy beats on hits: in the
    order requests are sent, each request finds whatever of its blocks is
    cached (wherever in its prompt), then every block of its prompt and answer
    may stay, and the cache keeps those read again soonest. Optimistic on
    purpose: no pinning, an answer is cacheable the instant it is sent, a hit
    needs no cached parent.
    """
    bs = point.block_size
    reads = [prefix_hashes(r.tokens, bs) for r in requests]
    uses: dict[int, list[int]] = {}
    for i, hashes in enumerate(reads):
        for h in hashes:
            uses.setdefault(h, []).append(i)
    cached: dict[int, int] = {}  # block → the next request to read it
    farthest: list[tuple[int, int]] = []  # (−next read, block), stale entries skipped
    hits = []
    for i, request in enumerate(requests):
        hits.append(sum(h in cached for h in reads[i]))
        for h in prefix_hashes(request.tokens + request.answer, bs):
            later = uses.get(h, ())
            k = bisect.bisect_right(later, i)
            if k == len(later):
                cached.pop(h, None)  # never read again
                continue
            cached[h] = later[k]
            heapq.heappush(farthest, (-later[k], h))
        while len(cached) > capacity:
            neg, h = heapq.heappop(farthest)
            if cached.get(h) == -neg:
                del cached[h]
    return hits


def lru_hits(point: Point, requests: Sequence[Request], capacity: float) -> list[int]:
    """Per request, its leading blocks one LRU cache of ``capacity`` blocks holds (no bound).

    The engines' own eviction, pooled: what a router that never cached a
    block twice and balanced for free would find, with the same optimism as
    :func:`best_hits` (no pinning, answers cached when sent).
    """
    bs = point.block_size
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = []
    for request in requests:
        hits.append(held_blocks(cache, prefix_hashes(request.tokens, bs)))
        for h in reversed(prefix_hashes(request.tokens + request.answer, bs)):
            cache[h] = None  # tail first: the root ends up most recent
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


class Oracle:
    """A lower bound on TTFT for any router on these engines and this workload (not a policy).

    Hits (:func:`best_hits`, in the order requests are sent): ``unbounded``,
    one KV cache shared by every engine holding every block of every earlier
    request, so only the new user message and blocks nobody sent before are
    prefilled; else the engines' caches pooled (engines × capacity blocks) with
    the best possible eviction. Any router's engines together hold at most that
    many distinct blocks, each only what was sent to it earlier (engines
    admit first come, first served), and a request hits only its own engine's.
    Assumed, not proven: that admission order is close to sending order
    (queues are tens of ms, reuse seconds), and that fewer tokens to prefill
    never delays a first token (step times only shrink).

    Balance: no bound is proven here. The engines' exact state is known at no
    cost and the hits do not depend on placement, so each request goes to the
    engine with the fewest requests (waiting or running): join the shortest
    queue with zero switching cost. (An estimate of when the first token would
    come, queued prefill and decode batch included, did worse on every
    pressured point: the decode batch, which a count balances, dominates.)
    A non-greedy schedule could beat it a little; a router that must keep
    each prefix on one engine cannot balance as freely.

    ``POOLED_LRU`` (``hits=lru_hits``) is no bound: the same, under the engines'
    own LRU, pooled: what partitioning perfectly would leave to gain.
    """

    def __init__(self, point: Point, seed: int, *, unbounded: bool = False,
                 hits: Callable[[Point, Sequence[Request], float], list[int]] = best_hits,
                 ) -> None:
        self.point = point
        self.requests = arrivals(point, seed)
        capacity = math.inf if unbounded else point.caches * point.capacity_blocks()
        self.hits = hits(point, self.requests, capacity)

    def bound(self, request: Request) -> None:
        """Set the request's cached blocks and miss (it must be the one sent as ``rid``)."""
        expected = self.requests[request.rid]
        assert (expected.tokens, expected.answer) == (request.tokens, request.answer)
        request.bound_blocks = self.hits[request.rid]

    def choose(self, engines: Sequence[ModelEngine]) -> int:
        return min(range(len(engines)), key=lambda n: (engines[n].queued, n))


# -- one run -----------------------------------------------------------------

def make_policy(mode: str, knobs: KvAwareKnobs, index: KvIndex, engines: int,
                clock: Callable[[], float]) -> Policy:
    if mode == "round_robin":
        return RoundRobin(start=0)
    if mode == "least_loaded":
        return LeastLoaded(start=0)
    kind = CacheAffinity if mode == "cache_affinity" else KvAware
    return kind(knobs, index, clock=clock, rng=random.Random(0), tie_start=0,
                uses_events=() if mode == "approximate" else set(range(engines)))


def run(point: Point, seed: int, mode: str, knobs: dict[str, Any] | None = None,
        capacity_reported: bool = True) -> dict[str, Any]:
    """One mode (or the :class:`Oracle`) on fresh engines at one grid point; per request figures.

    ``capacity_reported``: the engines' discovery reports their cache size (vLLM
    GetLoads, SGLang server info); False as TRT-LLM, whose size the router learns.
    """
    workload = Workload(point, seed)
    index = KvIndex(point.block_size)
    bs = point.block_size

    def publish(key: str, event: Any) -> None:
        index.apply_events(key, (event,))

    dp = point.dp_ranks
    if dp > 1 and mode in ORACLES:
        raise ValueError("the oracles and exact greedy model engines of one rank")
    # one per engine and rank: rank r of engine n is engines[n * dp + r]
    engines = [ModelEngine(point, n, publish, r) for n in range(point.engines) for r in range(dp)]
    greedy = ExactGreedy(engines) if mode == EXACT_GREEDY else None
    oracle = (Oracle(point, seed, unbounded=mode == ORACLE_UNBOUNDED,
                     hits=lru_hits if mode == POOLED_LRU else best_hits)
              if mode in ORACLES and greedy is None else None)
    if oracle is not None:
        for engine in engines:  # its hits come from the shared cache; nothing is evicted
            engine.capacity = math.inf
    handles = tuple(
        EngineHandle(name=f"e{n}", kind="vllm", url=f"sim://{n}", incarnation=n,
                     role=EngineRole.BOTH,
                     # the cache size, as discovery reports it (vLLM GetLoads, SGLang server info)
                     info=EngineInfo("sim", block_size=bs, kv_capacity_tokens=(
                         point.capacity_blocks() * bs if capacity_reported else None)),
                     context_length=None, transport=None,
                     dp_ranks=tuple(range(dp)) if dp > 1 and mode != UNPINNED else ())
        for n in range(point.engines))
    catalog = Catalog(1, handles)
    clock = VirtualTime(engines, None, dp)
    policy = (None if oracle is not None or greedy is not None else
              make_policy(mode, KvAwareKnobs(block_size=bs, **(knobs or {})), index,
                          point.engines, lambda: clock.now))
    clock.policy = policy
    monitors = [HitRateMonitor() for _ in range(point.engines)]
    diverged: set[int] = set()
    for user in workload.users:
        clock.send_at(user.next_at, user)
    issued = 0
    predicted_total = 0

    def send(t: float, user: User) -> None:
        nonlocal issued
        if issued >= point.requests:
            return
        request = workload.next_request(user, issued, t)
        issued += 1
        clock.send_at(t + user.rng.expovariate(1 / workload.think_s), user)
        if oracle is not None:
            request.hashes = prefix_hashes(request.tokens, bs)  # its hits are set: unused
            oracle.bound(request)
            placement = Placement(handles[oracle.choose(engines)])
        elif greedy is not None:
            request.hashes = prefix_hashes(request.tokens, bs)
            placement = Placement(handles[greedy.choose(request, t)], tuple(request.hashes))
        else:
            assert policy is not None
            chosen = policy.choose(catalog, RequestView(tuple(request.tokens),
                                                        len(request.answer)))
            assert chosen is not None
            placement = chosen
            request.hashes = (list(placement.blocks) if placement.blocks
                              else prefix_hashes(request.tokens, bs))
        clock.dispatch(request, placement)

    def done(t: float, request: Request) -> None:
        nonlocal predicted_total
        predicted = request.placement.predicted_cached_tokens if request.placement else None
        if predicted is not None:
            predicted_total += predicted
            if monitors[request.engine].record(predicted, request.cached_tokens):
                diverged.add(request.engine)

    finished = clock.run(send, done)
    ttft = sorted(r.ttft * 1e3 for r in finished)
    prompt = sum(len(r.tokens) for r in finished)
    cached = sum(r.cached_tokens for r in finished)
    return {
        "mode": mode, "seed": seed, "requests": len(finished),
        "ttft_ms": ttft, "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "hit_rate": cached / prompt, "evictions": sum(e.evictions for e in engines),
        "per_engine": [e.requests for e in engines],
        "spills": getattr(policy, "spills", 0),
        "predicted_cached_tokens": predicted_total if isinstance(policy, KvAware) else None,
        "reported_cached_tokens": cached,
        "diverged_engines": len(diverged),
        "rate_rps": len(finished) / max(1e-9, max(r.arrival for r in finished)
                                        - min(r.arrival for r in finished)),
    }


def pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# -- the grid ----------------------------------------------------------------


def default_grid() -> list[Point]:
    """Each dimension around a middle point, plus the hardest corner."""
    base = Point()
    points = [dataclasses.replace(base, cache=c) for c in (0.25, 0.5, 1.0, 1.5)]
    points += [dataclasses.replace(base, load=x) for x in (0.3, 0.5, 0.9)]
    points += [
        dataclasses.replace(base, tenants=16, skew=1.0),
        dataclasses.replace(base, tenants=16, system_tokens=1800, load=0.9, cache=0.25),
        dataclasses.replace(base, system_tokens=500),
        dataclasses.replace(base, cache=1.5, load=0.3),  # the one roomy point
    ]
    return points


def pressured(point: Point) -> bool:
    return point.cache <= 0.5 or point.load >= 0.7


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(t for r in runs for t in r["ttft_ms"])
    prompt_cached = sum(r["reported_cached_tokens"] for r in runs)
    predicted = [r["predicted_cached_tokens"] for r in runs]
    return {
        "mode": runs[0]["mode"], "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "seed_means": [r["ttft_mean_ms"] for r in runs],
        "seed_p90s": [r["ttft_p90_ms"] for r in runs],
        "hit_rate": statistics.fmean(r["hit_rate"] for r in runs),
        "evictions": sum(r["evictions"] for r in runs) / len(runs),
        "per_engine": runs[0]["per_engine"],
        "spills": sum(r["spills"] for r in runs),
        "prediction_ratio": (None if None in predicted else
                             sum(predicted) / max(1, prompt_cached)),
        "rate_rps": statistics.fmean(r["rate_rps"] for r in runs),
        "diverged_engines": max(r["diverged_engines"] for r in runs),
    }


def run_point(point: Point, seeds: Sequence[int], modes: Sequence[str],
              knobs: dict[str, Any] | None = None,
              capacity_reported: bool = True) -> dict[str, dict[str, Any]]:
    return {mode: pooled([run(point, seed, mode, knobs, capacity_reported) for seed in seeds])
            for mode in modes}


def verdict(point: Point, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours against the best other mode (TTFT mean and p90), cache_affinity and approximate."""
    ours = results.get(OURS)
    others = [r for m, r in results.items()
              if m not in (OURS, UNPINNED, "approximate", *ORACLES)]
    if ours is None or not others:
        return {}
    best_mean = min(r["ttft_mean_ms"] for r in others)
    best_p90 = min(r["ttft_p90_ms"] for r in others)
    out = {"mean_ratio": best_mean / ours["ttft_mean_ms"],
           "p90_ratio": best_p90 / ours["ttft_p90_ms"]}
    if "cache_affinity" in results:
        out["vs_cache_affinity"] = results["cache_affinity"]["ttft_mean_ms"] / ours["ttft_mean_ms"]
    if "approximate" in results:
        out["approx_over_events"] = results["approximate"]["ttft_mean_ms"] / ours["ttft_mean_ms"]
    if UNPINNED in results:
        out["unpinned_over_pinned"] = results[UNPINNED]["ttft_mean_ms"] / ours["ttft_mean_ms"]
    if ORACLE in results:
        out["oracle_over_ours"] = results[ORACLE]["ttft_mean_ms"] / ours["ttft_mean_ms"]
        if "cache_affinity" in results:  # the most any router could beat cache_affinity by
            out["cache_affinity_over_oracle"] = (results["cache_affinity"]["ttft_mean_ms"]
                                                 / results[ORACLE]["ttft_mean_ms"])
    for mode, name in ((ORACLE_UNBOUNDED, "unbounded"), (POOLED_LRU, "pooled_lru"),
                       (EXACT_GREEDY, "exact_greedy")):
        if mode in results and "cache_affinity" in results:
            out[f"cache_affinity_over_{name}"] = (results["cache_affinity"]["ttft_mean_ms"]
                                                  / results[mode]["ttft_mean_ms"])
    return out


def print_point(point: Point, results: dict[str, dict[str, Any]]) -> None:
    unit = "rank" if point.dp_ranks > 1 else "engine"
    print(f"\n## {point.label()}  (cache {point.capacity_blocks()} blocks/{unit}, "
          f"{point.tenants * point.users} users)")
    print(f"| mode | TTFT mean | p90 | p99 (ms) | hit | predicted / cached | evictions "
          f"| per {unit} | spills |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for mode, r in results.items():
        ratio = r["prediction_ratio"]
        predicted = "–" if ratio is None else f"{ratio:.3f}"
        print(f"| {mode} | {r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['hit_rate']:.3f} | {predicted} | "
              f"{r['evictions']:.0f} | {r['per_engine']} | {r['spills']} |")


def summary_line(point: Point, results: dict[str, dict[str, Any]]) -> str:
    v = verdict(point, results)
    if not v:
        return point.label()
    tag = "pressured" if pressured(point) else "roomy"
    parts = [f"{point.label()} [{tag}]: ours/best-other mean ×{v['mean_ratio']:.2f} "
             f"p90 ×{v['p90_ratio']:.2f}"]
    if "vs_cache_affinity" in v:
        parts.append(f"vs cache_affinity ×{v['vs_cache_affinity']:.2f}")
    if "approx_over_events" in v:
        parts.append(f"approximate/events {v['approx_over_events']:.2f}")
    if "unpinned_over_pinned" in v:
        parts.append(f"ranks pinned vs unpinned ×{v['unpinned_over_pinned']:.2f}")
    if "cache_affinity_over_oracle" in v:
        parts.append(f"oracle bound vs cache_affinity ×{v['cache_affinity_over_oracle']:.2f}")
    if "cache_affinity_over_unbounded" in v:
        parts.append(f"(unbounded cache ×{v['cache_affinity_over_unbounded']:.2f}; "
                     f"pooled LRU, no bound, ×{v.get('cache_affinity_over_pooled_lru', 0):.2f}; "
                     f"exact greedy, no bound, "
                     f"×{v.get('cache_affinity_over_exact_greedy', 0):.2f})")
    return ", ".join(parts)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_routing.py grid",
                                description="Routing policies against modelled engines.")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--seeds", default="1,2", help="workload seeds, pooled per point")
    p.add_argument("--points", default=None,
                   help="comma-separated indices into the default grid (default: all)")
    p.add_argument("--requests", type=int, default=None, help="per run (default 1200)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a [frontend.routing.knobs] entry for the KV modes (repeatable)")
    p.add_argument("--json", action="store_true", help="also one JSON line per point")
    p.add_argument("--dp-ranks", type=int, default=1,
                   help="data-parallel ranks per engine, each a cache and step loop of its own "
                        f"(> 1 adds the mode {UNPINNED}: ours, the engine picking the rank)")
    p.add_argument("--engines", type=int, default=None, help="engines per point (default 4)")
    p.add_argument("--unreported-capacity", action="store_true",
                   help="the engines' discovery reports no cache size (as TRT-LLM's): the "
                        "router measures fullness against the fullest engine it has seen")
    p.add_argument("--oracle", action="store_true",
                   help="also the oracle rows, lower bounds for any router, not policies: the "
                        "engines' caches pooled with the best eviction, one unbounded shared "
                        "cache; and two references, no bounds: pooled-lru (the caches pooled "
                        "under LRU), exact-greedy (each request where its own first token "
                        "comes soonest, by the engines' exact state)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.dp_ranks > 1 and UNPINNED not in args.modes:
        args.modes.append(UNPINNED)
    unknown = set(args.modes) - {*MODES, UNPINNED}
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; choose from {MODES}")
    if args.oracle:
        if args.dp_ranks > 1:
            p.error("--oracle models engines of one rank")
        args.modes += ORACLES
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    knobs: dict[str, Any] = {}
    for knob in args.knob:
        name, eq, value = knob.partition("=")
        if not eq:
            p.error(f"--knob {knob!r} is not NAME=VALUE")
        knobs[name.strip()] = float(value) if "." in value or "e" in value else int(value)
    args.knobs = knobs
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    grid = default_grid()
    if args.points:
        grid = [grid[int(i)] for i in args.points.split(",")]
    if args.requests:
        grid = [dataclasses.replace(p, requests=args.requests) for p in grid]
    if args.dp_ranks > 1 or args.engines:
        grid = [dataclasses.replace(p, dp_ranks=args.dp_ranks, engines=args.engines or p.engines)
                for p in grid]
    first = grid[0]
    print(f"routing_sim: {first.engines} modelled engines, block {first.block_size}; step "
          f"{first.step_ms:g} ms + {first.prefill_us:g} µs per prefilled token (chunk "
          f"{first.chunk}) + {first.decode_us:g} µs per decoding request; max_running "
          f"{first.max_running}; {first.requests} requests per run, seeds {args.seeds}; "
          f"users' turns {first.user_tokens} tokens, answers {first.answer_tokens}, "
          f"{first.turns} turns per conversation", flush=True)
    lines = []
    for point in grid:
        results = run_point(point, args.seeds, args.modes, args.knobs or None,
                            not args.unreported_capacity)
        print_point(point, results)
        lines.append(summary_line(point, results))
        print(lines[-1], flush=True)
        if args.json:
            print(json.dumps({"point": dataclasses.asdict(point),
                              "verdict": verdict(point, results), "results": results},
                             separators=(",", ":")))
    print("\n## Summary (ours = kv-events; ratios > 1: ours faster)")
    print("\n".join(f"- {line}" for line in lines))
    return 0

"""Preemption: which running request gives its slot to a tenant short of its share (sans-IO).

Admission slots free only when requests end, so a quiet tenant whose
requests arrive several at once, with every slot taken by a tenant past
its share, waits for one of that tenant's requests to end. Preemption
takes one of them off its engine instead, the way a planned migration
moves a stream off a draining engine: the relay leaves the engine at its
next safe point (its engine call aborted), gives its slot to the waiting
request, waits for a slot again first in its tenant's line, and continues
from the tokens it produced (a continuation of the client's prompt and
them, whose prefix the engine most likely still has cached), so its
client's stream goes on unbroken and token-exact.

What bounds the waste (measured with scripts/sim_admission.py):

- only a waiting request of a tenant below its share (by its usage: the
  slots it held lately, averaged), with no slot free, asks for one, once
  (one slot, at an interactive tier; :func:`preempt_for` says when);
- only a request of a tenant past its share (or backlogged: with
  requests of its own waiting) at the waiter's tier or a later one is taken (a
  ``priority`` request never gives way to a ``default`` one; ``flex``
  gives way first), never one of the waiter's own tenant;
- of those, the tenant most past its share gives one, and of its requests
  the one that has produced the fewest tokens (on a tie, the latest
  started): it has the least context to prefill again, the most left to
  run, and the least chance of ending by itself soon (in virtual time,
  where a second prefill costs the same whatever came before, fewest,
  most and oldest did equally well);
- a request gives way at most ``max_preemptions`` times, and only while it
  streams from an engine with nothing that a continuation would lose or
  change (one choice, no structured-output constraint, no reasoning budget,
  no seed, no frequency or presence penalty).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterable, Mapping

from direct_frontend.openai.types import TIERS, Tier
from direct_frontend.pipeline.shares import Shares


@dataclasses.dataclass(eq=False, slots=True)
class Hold:
    """One admitted request's slots, as the admission queue sees it while it runs.

    Whoever runs the request on an engine sets :attr:`leave` for as long as
    it may be preempted (:meth:`running`): a call that asks it off its engine
    at the next safe point (True: it will go), and :attr:`work`, the tokens
    it has produced. :attr:`asked` says it was asked and has not given its
    slots back yet; :attr:`held`, whether it holds them (not while it waits
    for them again).
    """

    flow: str
    count: int
    tier: Tier
    granted: float  # when it last got its slots
    seq: int = 0  # the order holds were granted in (a tie's tie-break)
    held: bool = True
    asked: bool = False
    preemptions: int = 0
    leave: Callable[[], bool] | None = None
    work: Callable[[], int] = lambda: 0

    def running(self, leave: Callable[[], bool] | None,
                work: Callable[[], int] = lambda: 0) -> None:
        """It may be preempted through ``leave`` now (None: no longer); ``work``: its tokens."""
        self.leave = leave
        self.work = work


_SEQ = itertools.count()


def new_hold(flow: str, count: int, tier: Tier, now: float) -> Hold:
    return Hold(flow, count, tier, now, next(_SEQ))


def choose_victim(holds: Iterable[Hold], flow: str, tier: Tier,
                  excess: Callable[[Hold], float], max_preemptions: int,
                  declined: Collection[Hold] = ()) -> Hold | None:
    """The running request to take off its engine for a waiter of ``flow`` at ``tier``, or
    None (never one of ``flow``'s own, nor one in ``declined``).

    ``excess(hold)``: how far past its share the hold's tenant is at the
    hold's tier, less the slots it is already giving back (not past it: 0
    or less). Later tiers first, then the tenant most past its share, then
    the fewest tokens produced, then the latest granted.
    """
    first = TIERS.index(tier)
    best: Hold | None = None
    best_key: tuple[int, float, int, int] | None = None
    for hold in holds:
        if hold.leave is None or hold.asked or hold.preemptions >= max_preemptions or (
                hold.flow == flow) or hold in declined:
            continue
        rank = TIERS.index(hold.tier)
        if rank < first:
            continue  # a tier served first never gives way
        over = excess(hold)
        if over <= 0:
            continue
        key = (rank, over, -hold.work(), hold.seq)
        if best_key is None or key > best_key:
            best, best_key = hold, key
    return best


def preempt_for(holds: Collection[Hold], shares: Mapping[Tier, Shares], flow: str, tier: Tier,
                ahead: int, waiting: Callable[[str], int], now: float,
                max_preemptions: int) -> Hold | None:
    """A request of ``flow`` at ``tier`` (an interactive one, whose ``shares`` account is
    there) waits for a slot, with ``ahead`` of its tenant's requests before it that no
    preemption frees a slot for; ``waiting``: how many requests a tenant has waiting. The
    running request asked off its engine for it (:func:`choose_victim`), or None.

    Its tenant must be owed a slot: its usage (what it held lately) short of its share,
    no more of its requests waiting than its count in flight varies by (a burst, not a
    backlog: two backlogged tenants never take slots from each other back and forth on the
    noise of their usage), and what it would hold with them past its share by no more than
    that either (a tenant just arrived, whose usage is still near nothing, takes its share
    and its variance, not every slot). A victim's tenant must be past its share
    (by its usage or what it holds now), or have requests waiting: a tenant that asks for
    less than its share is served in full before one that asks for more gets more (max-min
    fairness), and a tenant just arrived has no usage yet to be judged by.
    """
    account = shares[tier]
    for each in shares.values():
        each.active(now)  # the shares below are of the tenants active now
    share, room = account.share(flow), account.room(flow)
    # alone at the interactive tiers (priority tenants count at default too): flex only
    alone = len(shares.get("default", account).active(now)) < 2
    if account.usage(flow, now) >= share or ahead >= room \
            or account.held(flow) + ahead + 1 > share + room:
        return None
    giving = collections.Counter(hold.flow for hold in holds if hold.asked)

    def excess(hold: Hold) -> float:
        if hold.tier == "flex":  # it has no share, and gives way to any interactive tier
            return 1.0
        if alone:
            return 0.0
        theirs, other = shares[hold.tier], hold.flow
        held = theirs.held(other) - giving[other]
        over = max(theirs.usage(other, now) - giving[other], held) - theirs.share(other)
        if over > 0:
            return over
        return 1e-3 * held if waiting(other) else 0.0  # its demand is past what it holds

    declined: set[Hold] = set()  # those past relaying already (ending by themselves)
    while (chosen := choose_victim(holds, flow, tier, excess, max_preemptions,
                                   declined)) is not None:
        assert chosen.leave is not None
        if chosen.leave():
            chosen.asked = True
            chosen.preemptions += 1
            return chosen
        declined.add(chosen)
    return None

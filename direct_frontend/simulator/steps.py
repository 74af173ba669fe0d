"""Batched scheduler steps for the simulated engines: chunked prefill, one decode batch.

With :attr:`TimingModel.chunk_tokens` set, each data-parallel rank runs one
:class:`StepLoop`, as vLLM's and SGLang's schedulers do: a step prefills up to
``chunk_tokens`` prompt tokens of the running requests, first come first
served, and decodes one token of every request past its prefill, and it lasts

    step_us + prefill_us_per_token × tokens prefilled + decode_us_per_token × requests decoded

So a prefill waits for the prefills admitted before it, a long one stalls the
decode batch, and decoding slows as the batch grows: the contention a router
must weigh. ``scripts/routing_sim.py`` plays these steps (this :class:`StepLoop`)
in virtual time.

A request holds a :class:`Seat` from its admission (its batch slot) to its end;
each step end gives every seat it served a turn: the first token after the
prefill, one token per step after. A sequence slower to take its turns than the
steps (a stalled stream) keeps them, and emits them as soon as it can.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from direct_frontend.simulator.model import TimingModel


class Seat:
    """One running request's place in the steps: prefill left, and turns not yet taken."""

    __slots__ = ("_wake", "given", "left", "turns", "wanted")

    def __init__(self, left: int, wanted: int) -> None:
        self.left = left  # prompt tokens still to prefill
        self.wanted = wanted  # turns it can use at most (its token budget; 1 at least)
        self.given = 0
        self.turns = 0  # tokens the steps have produced that the sequence has not emitted
        self._wake: asyncio.Future[None] | None = None

    def give(self) -> None:
        self.given += 1
        self.turns += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def take(self, abort_signal: asyncio.Future[None]) -> bool:
        """Wait for a turn and take it; False if ``abort_signal`` fired first."""
        while not self.turns:
            if abort_signal.done():
                return False
            self._wake = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._wake, abort_signal), return_when=asyncio.FIRST_COMPLETED)
        self.turns -= 1
        return True


class StepLoop:
    """One rank's scheduler: steps of chunked prefill and batched decode (see the module)."""

    def __init__(self, timing: TimingModel) -> None:
        self.timing = timing
        self.prefilling: collections.deque[Seat] = collections.deque()  # admission order
        self.decoding: dict[Seat, None] = {}
        self.steps = 0
        self._task: asyncio.Task[None] | None = None

    def join(self, uncached: int, wanted: int) -> Seat:
        """A request admitted with ``uncached`` prompt tokens to prefill; its seat.

        ``wanted``: the most tokens it may generate (a step decodes no request
        that has had them all). Starts the steps if they had stopped (they stop
        when no request is left).
        """
        seat = self.admit(uncached, wanted)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return seat

    def admit(self, uncached: int, wanted: int) -> Seat:
        """The seat of a request admitted with ``uncached`` prompt tokens to prefill."""
        seat = Seat(uncached, max(1, wanted))
        self.prefilling.append(seat)
        return seat

    def leave(self, seat: Seat) -> None:
        """The request ended (or was aborted): no more steps for it."""
        if seat in self.decoding:
            del self.decoding[seat]
            return
        with contextlib.suppress(ValueError):
            self.prefilling.remove(seat)

    def step_seconds(self, prefilled: int, decoding: int) -> float:
        t = self.timing
        return (t.step_us + t.prefill_us_per_token * prefilled
                + t.decode_us_per_token * decoding) / 1e6

    def plan(self) -> tuple[int, list[Seat]]:
        """The next step: the prompt tokens it prefills (taken off the seats), who it decodes."""
        budget = self.timing.chunk_tokens
        prefilled = 0
        for seat in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, seat.left)
            seat.left -= take
            budget -= take
            prefilled += take
        return prefilled, [seat for seat in self.decoding if seat.given < seat.wanted]

    def finish(self, decoded: list[Seat]) -> None:
        """The step ended: a token for each seat it decoded and each whose prefill is done."""
        self.steps += 1
        for seat in decoded:
            if seat in self.decoding:
                seat.give()
        while self.prefilling and self.prefilling[0].left <= 0:
            seat = self.prefilling.popleft()
            self.decoding[seat] = None
            seat.give()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while True:
                prefilled, decoded = self.plan()
                if not (self.prefilling or decoded):
                    break  # nothing left to step (a request that had its tokens is leaving)
                # steps follow each other on a schedule; one that starts late (a busy
                # CPU) does not make up for it by shortening the next
                deadline = max(deadline, loop.time()) + self.step_seconds(prefilled, len(decoded))
                await asyncio.sleep(deadline - loop.time())
                self.finish(decoded)
        finally:
            self._task = None

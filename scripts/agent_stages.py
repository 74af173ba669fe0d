"""Where a growing conversation's CPU goes: the daemon with per-stage CPU clocks, by turn.

Pass it as the candidate daemon of the long-prompt agent workload::

    CONVS=16 python scripts/bench_overhead.py --long agent --agent-conversations 16 \\
        --long-policy round_robin --daemon-cmd "python scripts/agent_stages.py"

It starts ``direct-frontend`` with its arguments, counts chat bodies parsed
(``CONVS`` per turn: the workload runs its conversations in lockstep), and
adds the thread CPU of each wrapped synchronous stage (body decoding,
rendering, the prompt caches, tokenizing, building and encoding the engine
request, h11 and h2 calls), and of each garbage collection, to the turn
it ran in. On exit (SIGTERM) it writes to ``$STAGE_OUT`` (default
``agent-stages.txt``) the process's user and system CPU and its main
thread's per request over turns 5–14 (A) and 30–39 (B), then each stage's
per request, the stages whose cost grows most first. A stage's time includes
the stages it calls (``render`` holds ``render_turns``, ``cuts`` and
``boundaries``), so the rows overlap.

The wrappers add about 1 µs per call; coroutines are not wrapped (their
clock would count whatever ran while they waited).
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

OUT = os.environ.get("STAGE_OUT", "agent-stages.txt")
K = int(os.environ.get("CONVS", "4"))
A, B = (4, 14), (29, 39)

parsed = 0
spent: dict[str, dict[int, float]] = collections.defaultdict(
    lambda: collections.defaultdict(float))
calls: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
marks: dict[int, tuple[float, ...]] = {}
_gc_start = [0.0]


def turn() -> int:
    return max(parsed - 1, 0) // K


def mark(at: int) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    marks[at] = (usage.ru_utime, usage.ru_stime, time.thread_time(), time.process_time(),
                 usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw)


def wrap(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label][turn()] += time.thread_time() - start
            calls[label][turn()] += 1

    setattr(owner, name, timed)


def on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.thread_time()
    else:
        label = f"gc{info['generation']}"
        spent[label][turn()] += time.thread_time() - _gc_start[0]
        calls[label][turn()] += 1


def instrument() -> None:
    import h2.connection
    import h11

    import direct_frontend.http.endpoints as endpoints
    from direct_frontend.engines import transport
    from direct_frontend.engines.dialects import ids, sglang
    from direct_frontend.pipeline import preprocess, prompt_cache, render_cache, tokenizing
    from direct_frontend.pipeline.dispatch import Dispatcher
    from direct_frontend.text import encoder

    parse = getattr(endpoints, "parse_chat_request")  # noqa: B009 (not exported)

    def counted(body: bytes) -> Any:
        global parsed
        if parsed % K == 0:
            mark(parsed // K)
        parsed += 1
        return parse(body)

    setattr(endpoints, "parse_chat_request", counted)  # noqa: B010
    wrap(endpoints, "parse_chat_request", "parse_chat_request")
    for name in ("chat_chars", "render", "_chat_key"):
        wrap(preprocess, name, f"preprocess.{name}")
    wrap(tokenizing, "joined", "tokenizing.joined")
    wrap(tokenizing, "render_turns", "tokenizing.render_turns")
    wrap(tokenizing.Tokenizing, "cuts", "Tokenizing.cuts")
    for cache in (prompt_cache.PrefixCache, render_cache.TurnCache, prompt_cache.PromptCache):
        for name in ("find", "get", "put"):
            if name in vars(cache):
                wrap(cache, name, f"{cache.__name__}.{name}")
    for name in ("encode_batch_raw", "boundaries", "boundaries_after"):
        wrap(encoder.Encoder, name, f"Encoder.{name}")
    wrap(ids, "packed_varints", "packed_varints")
    wrap(sglang.SglangDialect, "build", "dialect.build")
    wrap(transport, "encode_request", "encode_request")
    wrap(Dispatcher, "choose", "Dispatcher.choose")
    for name in ("send_data", "data_to_send", "receive_data", "send_headers"):
        wrap(h2.connection.H2Connection, name, f"h2.{name}")
    for name in ("receive_data", "next_event", "send"):
        wrap(h11.Connection, name, f"h11.{name}")
    # the I/O under the coroutines: socket calls (their kernel time included), the engine
    # connections' reads (asyncio: h2 and grpclib under them) and writes, trio's epoll
    import asyncio.selector_events as selector_events
    import socket

    from trio._core._io_epoll import EpollIOManager

    for name in ("send", "recv", "recv_into", "sendmsg"):
        wrap(socket.socket, name, f"socket.{name}")
    for name in ("write", "_read_ready__data_received", "_read_ready__get_buffer"):
        if hasattr(selector_events._SelectorSocketTransport, name):
            wrap(selector_events._SelectorSocketTransport, name, f"asyncio.{name}")
    wrap(EpollIOManager, "get_events", "trio.epoll get_events")
    gc.callbacks.append(on_gc)
    if os.environ.get("TASK_STEPS"):  # each Trio task step's CPU, by the task's name
        import trio

        run = trio.run

        def instrumented(*args: Any, **kwargs: Any) -> Any:
            return run(*args, instruments=[TaskSteps()], **kwargs)

        trio.run = instrumented


class TaskSteps:
    """A Trio instrument: the thread CPU of every task step, by the task's name."""

    def __init__(self) -> None:
        self.start = 0.0

    def before_task_step(self, task: Any) -> None:
        self.start = time.thread_time()

    def after_task_step(self, task: Any) -> None:
        label = "task " + _short_task(task.name)
        spent[label][turn()] += time.thread_time() - self.start
        calls[label][turn()] += 1


def _short_task(name: str) -> str:
    return name.replace("direct_frontend.", "").replace("<locals>.", "")[-60:]


def per_request(counter: dict[int, float] | collections.Counter[int], turns: tuple[int, int]
                ) -> float:
    return sum(counter.get(t, 0) for t in range(*turns)) / ((turns[1] - turns[0]) * K)


def dump(*_: object) -> None:
    mark(-(-parsed // K))
    lines = [f"requests {parsed}, {K} per turn; per request, turns 5-14 (A), 30-39 (B)"]
    if all(t in marks for t in A + B):
        for i, name in enumerate(("utime", "stime", "main thread", "process", "minor faults",
                                  "voluntary switches", "involuntary switches")):
            a = (marks[A[1]][i] - marks[A[0]][i]) / ((A[1] - A[0]) * K)
            b = (marks[B[1]][i] - marks[B[0]][i]) / ((B[1] - B[0]) * K)
            if i < 4:
                lines.append(f"{name:32s} A {a * 1e3:8.3f} ms  B {b * 1e3:8.3f} ms")
            else:
                lines.append(f"{name:32s} A {a:8.1f}     B {b:8.1f}")
    rows = [(per_request(spent[label], B) - per_request(spent[label], A), label)
            for label in spent]
    for grows, label in sorted(rows, reverse=True):
        a, b = per_request(spent[label], A), per_request(spent[label], B)
        lines.append(f"{label:32s} A {a * 1e6:8.1f} µs  B {b * 1e6:8.1f} µs  "
                     f"(+{grows * 1e6:6.1f})  calls {per_request(calls[label], A):.2f} "
                     f"{per_request(calls[label], B):.2f}")
    with open(OUT, "w") as out:
        out.write("\n".join(lines) + "\n")
    os._exit(0)


if __name__ == "__main__":
    instrument()
    signal.signal(signal.SIGTERM, dump)
    from direct_frontend.cli import main

    sys.argv = ["direct-frontend", *sys.argv[1:]]
    try:
        main()  # (a daemon that fails to start says why, and exits as it would)
    except SystemExit as end:
        if end.code:
            raise
    dump()

"""``direct-frontend top URL``: the fleet, live, in a terminal.

It follows the daemon's ``/fleet/events`` WebSocket: a snapshot, then each
state change, reload and load tick. :class:`FleetModel` folds events into
rows and renders them (sans-IO, so tests check it without a terminal);
:func:`follow` keeps the connection, reconnecting with backoff so the view
survives daemon restarts and reloads of the admin token.
"""

from __future__ import annotations

import contextlib
import json
import os
import termios
import time
import tty
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, wrap_client_stream

RECONNECT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
CONNECT_TIMEOUT_S = 5.0

_COLOURS = {
    "serving": "\x1b[32m", "joining": "\x1b[36m", "unhealthy": "\x1b[31m",
    "refused": "\x1b[35m", "draining": "\x1b[33m", "gone": "\x1b[90m",
}
_RESET = "\x1b[0m"


class Unauthorized(Exception):
    """The daemon refused the admin token; retrying would not help."""


def events_url(base: str) -> str:
    """``http://host:port`` (or ``ws://...``) → ``ws://host:port/fleet/events``."""
    parts = urlsplit(base if "://" in base else f"http://{base}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith("/fleet/events"):
        path += "/fleet/events"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


class FleetModel:
    """What the terminal shows, built from the events stream."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, int], dict[str, Any]] = {}  # (name, incarnation)
        self.config: dict[str, Any] = {}
        self.last_reload: dict[str, Any] | None = None
        self.serving = 0
        self.total = 0
        self.connected = False
        self.note = "connecting..."
        self.dropped = 0

    def apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "snapshot":
            fleet = event["fleet"]
            self.engines = {(e["name"], e["incarnation"]): e for e in fleet["engines"]}
            self.config = fleet.get("config", {})
            self.last_reload = fleet.get("last_reload")
            self.dropped += int(event.get("dropped", 0))
        elif kind == "engine":
            engine = event["engine"]
            key = (engine["name"], engine["incarnation"])
            if engine["state"] == "gone":
                self.engines.pop(key, None)
            else:
                self.engines[key] = engine
        elif kind == "reload":
            self.last_reload = event["reload"]
            if self.last_reload and self.last_reload.get("ok"):
                self.config["version"] = self.last_reload.get("version")
        elif kind == "load":
            # "engines": in flight now; "requests": sent so far (absent from older daemons)
            for field, per_engine in (("load", event.get("engines", {})),
                                      ("requests", event.get("requests", {}))):
                for key, value in per_engine.items():
                    name, _, incarnation = key.rpartition("#")
                    engine = self.engines.get((name, int(incarnation)))
                    if engine is not None:
                        engine[field] = value
        live = [e for e in self.engines.values() if e["state"] != "draining"]
        self.serving = sum(1 for e in live if e["state"] == "serving")
        self.total = len(live)

    def render(self, url: str, *, colour: bool = True, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        status = "connected" if self.connected else self.note
        version = self.config.get("version", "?")
        lines = [
            f"direct-frontend top  {url}  [{status}]",
            f"engines {self.serving}/{self.total} serving   config v{version}"
            + (f"   events dropped {self.dropped}" if self.dropped else ""),
        ]
        reload = self.last_reload
        if reload is not None:
            when = time.strftime("%H:%M:%S", time.localtime(reload["at"]))
            if reload["ok"]:
                changes = "; ".join(_diff_summary(reload.get("diff") or {})) or "no changes"
                lines.append(f"last reload {when} ({reload['trigger']}): ok, {changes}")
            else:
                first = (reload.get("errors") or ["?"])[0]
                lines.append(f"last reload {when} ({reload['trigger']}): REJECTED  {first}")
        lines.append("")
        header = ("NAME", "STATE", "GEN", "LOAD", "REQS", "ROLE", "KIND", "URL", "FOR", "PROBE")
        rows = [header]
        for engine in sorted(self.engines.values(), key=lambda e: (e["name"], e["incarnation"])):
            probe = engine.get("last_probe")
            probe_text = "-" if probe is None else ("ok" if probe["ok"] else probe["message"])
            if engine.get("last_error") and engine["state"] != "serving":
                probe_text = engine["last_error"]
            rows.append((
                engine["name"], engine["state"], str(engine["incarnation"]),
                str(engine.get("load", 0)), str(engine.get("requests", 0)), engine["role"],
                engine["kind"], engine["url"], _age(now - engine["since"]), probe_text[:60],
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
        for index, row in enumerate(rows):
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            line = "  ".join([*cells, row[-1]])
            if colour and index > 0 and (code := _COLOURS.get(row[1])):
                line = f"{code}{line}{_RESET}"
            lines.append(line)
        return lines


def _diff_summary(diff: dict[str, Any]) -> list[str]:
    out = []
    for key, sign in (("added", "+"), ("removed", "-")):
        if diff.get(key):
            out.append(f"{sign}{','.join(diff[key])}")
    if diff.get("changed"):
        out.append("~" + ",".join(c["name"] for c in diff["changed"]))
    if diff.get("live"):
        out.append("frontend " + ",".join(diff["live"]))
    if diff.get("restart"):
        out.append("needs restart: " + ",".join(diff["restart"]))
    return out


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


async def session(
    base_url: str,
    on_event: Callable[[dict[str, Any]], None],
    *,
    token: str | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
) -> None:
    """One connection to ``/fleet/events``: feed each event to ``on_event`` until it ends.

    The TCP stream is ours, not trio-websocket's, because the library leaves
    it open when the handshake is rejected (a reconnecting viewer would leak
    a socket per attempt). Errors come out unwrapped: ``ConnectionRejected``,
    ``ConnectionClosed``, ``OSError``, ``trio.TooSlowError``, or whatever
    ``on_event`` raised.
    """
    parts = urlsplit(events_url(base_url))
    host, secure = parts.hostname or "localhost", parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(connect_timeout):
                stream: trio.SocketStream | trio.SSLStream[trio.SocketStream] = (
                    await trio.open_ssl_over_tcp_stream(host, port, https_compatible=True)
                    if secure else await trio.open_tcp_stream(host, port)
                )
            try:
                with trio.fail_after(connect_timeout):
                    ws = await wrap_client_stream(nursery, stream, parts.netloc, parts.path,
                                                  extra_headers=headers)
                while True:
                    on_event(json.loads(await ws.get_message()))
            finally:
                with trio.CancelScope(shield=True):  # a Cancelled here would hide our error
                    await trio.aclose_forcefully(stream)
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


async def follow(
    base_url: str,
    on_update: Callable[[FleetModel], None],
    *,
    token: str | None = None,
    backoff: Sequence[float] = RECONNECT_BACKOFF_S,
) -> None:
    """Keep ``on_update`` fed with the fleet until cancelled, reconnecting with backoff.

    Raises :class:`Unauthorized` if the daemon refuses the token.
    """
    model = FleetModel()
    attempt = 0

    def on_event(event: dict[str, Any]) -> None:
        nonlocal attempt
        model.connected, attempt = True, 0
        model.apply(event)
        on_update(model)

    while True:
        try:
            await session(base_url, on_event, token=token)
            reason = "the daemon closed the stream"  # pragma: no cover (get_message raises)
        except ConnectionRejected as exc:
            if exc.status_code in (401, 403):
                raise Unauthorized(f"{events_url(base_url)}: the daemon refused the admin "
                                   f"token (HTTP {exc.status_code})") from None
            reason = f"rejected (HTTP {exc.status_code})"
        except ConnectionClosed as exc:
            reason = f"disconnected ({exc.reason.name if exc.reason else 'no reason'})"
        except (HandshakeError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            reason = f"cannot connect ({exc.__class__.__name__})"
        delay = backoff[min(attempt, len(backoff) - 1)]
        attempt += 1
        model.connected = False
        model.note = f"{reason}; retrying in {delay:g}s"
        on_update(model)
        await trio.sleep(delay)


#: Keys that end ``top`` (Ctrl-C does too, as a signal).
QUIT_KEYS = frozenset(b"qQ")
#: On a terminal: the alternate screen (the shell's screen comes back on exit), no cursor.
ENTER_SCREEN, LEAVE_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


def wants_quit(keys: bytes) -> bool:
    """Whether the bytes read from the keyboard hold a quit key."""
    return any(key in QUIT_KEYS for key in keys)


def frame(lines: Sequence[str], *, screen: bool) -> str:
    """One update as written: over the last one on a terminal, appended otherwise.

    On a terminal the cursor goes home and each line clears what is left of the old one,
    so nothing flickers; anything else (a pipe, a file) gets plain text, one block per
    update with a blank line after it, and no control sequences.
    """
    if screen:
        return "\x1b[H" + "".join(f"{line}\x1b[K\n" for line in lines) + "\x1b[J"
    return "\n".join(lines) + "\n\n"


async def read_keys(fd: int, on_quit: Callable[[], None]) -> None:
    """Call ``on_quit`` once a quit key arrives on ``fd`` (or it reaches its end)."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        keys = os.read(fd, 64)
        if not keys or wants_quit(keys):
            on_quit()
            return


@contextlib.contextmanager
def _keyboard(fd: int) -> Iterator[None]:
    """The terminal on ``fd`` in cbreak mode (keys arrive at once, unechoed), then restored."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(base_url: str, token: str | None, out: TextIO, *, colour: bool = True,
            keys: TextIO | None = None) -> int:
    """The ``top`` command: redraw on every update until ``q`` or Ctrl-C.

    ``keys`` (a terminal) is read for ``q``; a ``top`` whose output is not a terminal
    writes plain updates one after the other and stops on Ctrl-C or a closed pipe.
    """
    screen = out.isatty()
    key_fd = keys.fileno() if keys is not None and keys.isatty() else None

    def draw(model: FleetModel) -> None:
        out.write(frame(model.render(base_url, colour=colour), screen=screen))
        out.flush()

    with _terminal(out, key_fd, screen=screen):
        refused = _until_interrupted(partial(_watch, base_url, token, draw, key_fd))
    if refused is not None:
        out.write(f"{refused}\n")
        return 1
    return 0


async def _watch(base_url: str, token: str | None, draw: Callable[[FleetModel], None],
                 key_fd: int | None) -> Unauthorized | None:
    """Follow the daemon until a quit key or a closed pipe; the daemon's refusal, if so."""
    refused = None
    async with trio.open_nursery() as nursery:
        if key_fd is not None:
            nursery.start_soon(read_keys, key_fd, nursery.cancel_scope.cancel)
        try:
            await follow(base_url, draw, token=token)
        except Unauthorized as exc:
            refused = exc
        except BrokenPipeError:
            pass  # whoever read the output is gone
        nursery.cancel_scope.cancel()
    return refused


@contextlib.contextmanager
def _terminal(out: TextIO, key_fd: int | None, *, screen: bool) -> Iterator[None]:
    """The keyboard in cbreak mode and the alternate screen, where there are; restored."""
    with contextlib.ExitStack() as stack:
        if key_fd is not None:
            stack.enter_context(_keyboard(key_fd))
        if screen:
            out.write(ENTER_SCREEN)
            stack.callback(lambda: (out.write(LEAVE_SCREEN), out.flush()))
        yield


def _until_interrupted(main: Callable[[], Awaitable[Unauthorized | None]]) -> Unauthorized | None:
    """``main`` under Trio; Ctrl-C ends it quietly (inside a nursery it comes out grouped)."""
    try:
        return trio.run(main)
    except KeyboardInterrupt:
        return None
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        return None

"""``direct-frontend top``: the view's model and frames, and the command on a terminal and a pipe.

The model and the frames are sans-IO. The command itself runs as a subprocess, once on a
pseudo-terminal (where ``q`` must end it and the shell's screen come back) and once into a
pipe (where no control sequence may appear), against an address nothing listens on: the
view then shows its reconnecting state, which is enough to see it drawn.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from direct_frontend.top import LEAVE_SCREEN, FleetModel, frame, wants_quit
from tests.support.daemon import free_port

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"name": "a", "incarnation": 1, "state": "serving", "load": 0, "requests": 0,
          "role": "both", "kind": "sglang", "url": "grpc://h:1", "since": 100.0,
          "last_probe": {"ok": True, "message": "", "at": 1}, "last_error": None}


def row(model: FleetModel) -> dict[str, str]:
    lines = model.render("http://x", colour=False, now=130.0)
    header = lines.index(next(line for line in lines if line.startswith("NAME")))
    return dict(zip(lines[header].split(), lines[header + 1].split(), strict=True))


def snapshot(*engines: dict[str, Any]) -> dict[str, Any]:
    return {"type": "snapshot",
            "fleet": {"engines": list(engines), "config": {"version": 1}, "last_reload": None}}


def test_a_load_tick_updates_load_and_requests() -> None:
    model = FleetModel()
    model.apply(snapshot(ENGINE))
    model.apply({"type": "load", "engines": {"a#1": 2}, "requests": {"a#1": 7}})
    assert (row(model)["LOAD"], row(model)["REQS"]) == ("2", "7")
    model.apply({"type": "load", "engines": {"a#1": 0}, "requests": {"a#1": 9, "gone#3": 1}})
    assert (row(model)["LOAD"], row(model)["REQS"]) == ("0", "9")


def test_a_load_tick_of_an_older_daemon_leaves_requests_as_they_were() -> None:
    model = FleetModel()
    model.apply(snapshot({**ENGINE, "requests": 4}))
    model.apply({"type": "load", "engines": {"a#1": 1}})
    assert (row(model)["LOAD"], row(model)["REQS"]) == ("1", "4")


def test_a_terminal_frame_redraws_in_place_and_a_piped_one_is_plain_text() -> None:
    on_screen = frame(["one", "two"], screen=True)
    assert on_screen.startswith("\x1b[H") and on_screen.endswith("\x1b[J")
    assert "\x1b[2J" not in on_screen  # no clear of the whole screen: no flicker
    assert frame(["one", "two"], screen=False) == "one\ntwo\n\n"


def test_q_quits_and_other_keys_do_not() -> None:
    assert wants_quit(b"q") and wants_quit(b"Q") and wants_quit(b"xq")
    assert not wants_quit(b"") and not wants_quit(b"x\x1b[A")


def top_command(port: int) -> list[str]:
    return [sys.executable, "-m", "direct_frontend.cli", "top", f"http://127.0.0.1:{port}"]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}


def read_until(fd: int, wanted: bytes, deadline: float) -> bytes:
    seen = b""
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {wanted!r} in {seen!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal's other end closed (Linux says EIO)
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_top_on_a_terminal_quits_on_q_and_gives_the_screen_back() -> None:
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(top_command(free_port()), stdin=terminal, stdout=terminal,
                            stderr=terminal, env=environment(), start_new_session=True)
    os.close(terminal)
    try:
        drawn = read_until(controller, b"cannot connect", time.monotonic() + 30)
        assert b"\x1b[?1049h" in drawn  # the alternate screen
        os.write(controller, b"q")
        assert proc.wait(timeout=10) == 0
        assert LEAVE_SCREEN.encode() in read_until(controller, LEAVE_SCREEN.encode(),
                                                   time.monotonic() + 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)


def test_top_into_a_pipe_writes_plain_updates() -> None:
    proc = subprocess.Popen(top_command(free_port()), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment())
    assert proc.stdout is not None
    try:
        output = read_until(proc.stdout.fileno(), b"retrying in 0.5s", time.monotonic() + 30)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()
    assert b"\x1b" not in output
    # one block per update, each from its first line, one after the other
    assert output.startswith(b"direct-frontend top")
    assert output.count(b"\n\ndirect-frontend top") >= 1

"""The one gate and the one report of the hot-path shims (observability/shims.py)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from direct_frontend.observability import shims
from direct_frontend.observability.shims import ShimStatus, gate

HYPERCORN = importlib.metadata.version("hypercorn")


def test_a_checked_release_of_the_expected_shape_is_on() -> None:
    status = gate("x", "hypercorn", ("0.1.0", HYPERCORN), lambda: None)
    assert status == ShimStatus("x", True, f"hypercorn {HYPERCORN}")
    assert str(status) == f"x on (hypercorn {HYPERCORN})"


def test_a_release_off_the_allow_list_is_off_whatever_its_shape() -> None:
    asked: list[bool] = []

    def shape() -> str | None:
        asked.append(True)
        return None

    status = gate("x", "hypercorn", ("0.1.0", "0.2.0"), shape)
    assert not status.active and not asked
    assert status.reason == (f"hypercorn {HYPERCORN} is not a release it was checked against "
                             "(0.1.0, 0.2.0)")


def test_a_checked_release_of_another_shape_is_off() -> None:
    status = gate("x", "hypercorn", (HYPERCORN,), lambda: "stream_send moved")
    assert status == ShimStatus("x", False, f"hypercorn {HYPERCORN}: stream_send moved")


def test_a_library_without_metadata_is_off() -> None:
    status = gate("x", "no-such-distribution-here", ("1.0",), lambda: None)
    assert not status.active and "of unknown release" in status.reason


def test_the_report_reads_every_shim_now_and_warns_when_one_is_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shims, "_REPORTS", {})
    state = {"b": ShimStatus("b", True, "lib 1.0")}
    shims.register("b", lambda: state["b"])
    shims.register("a", lambda: ShimStatus("a", True, "other 2.0"))
    assert [s.shim for s in shims.shims_active()] == ["a", "b"]  # by name
    log = logging.getLogger("test.shims")
    with caplog.at_level(logging.INFO, logger="test.shims"):
        shims.log_report(log)
        state["b"] = ShimStatus("b", False, "lib 1.1 is not a release it was checked against")
        shims.log_report(log)
    first, second = caplog.records
    assert first.levelno == logging.INFO
    assert first.getMessage() == "hot-path shims: a on (other 2.0); b on (lib 1.0)"
    assert second.levelno == logging.WARNING
    assert "b off (lib 1.1 is not a release it was checked against)" in second.getMessage()


def test_the_daemons_shims_register_themselves() -> None:
    import direct_frontend.daemon  # noqa: F401  (what the daemon imports registers them)

    assert {s.shim for s in shims.shims_active()} >= {
        "grpclib_reader", "hypercorn_coalesce", "hypercorn_keepalive"
    }

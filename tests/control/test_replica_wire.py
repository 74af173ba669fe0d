"""The replica link's messages (sans-IO)."""

from __future__ import annotations

from direct_frontend.control.replica_wire import (
    FaultReport,
    LoadReport,
    Placements,
    ResponseQuery,
    Subjects,
    decode,
    encode,
)
from direct_frontend.errors import EngineError, ErrorKind


def test_messages_round_trip_and_garbage_is_none() -> None:
    report = LoadReport.of("r1", 7, {"a": (2, frozenset({5, 2**64 - 1}))})
    decoded_report = decode(LoadReport, encode(report))
    assert decoded_report == report
    assert decoded_report.unpacked() == {"a": (2, frozenset({5, 2**64 - 1}))}
    assert decode(LoadReport, b"\x93garbage") is None
    assert decode(FaultReport, encode(report)) is None
    placements = Placements.of("r1", [("a", (1, 2**64 - 1))])
    decoded = decode(Placements, encode(placements))
    assert decoded is not None and decoded.each() == [("a", [1, 2**64 - 1])]
    query = ResponseQuery("r1", "get", "resp_0a1b2c3d01", "_INBOX.x")
    assert decode(ResponseQuery, encode(query)) == query
    assert decode(ResponseQuery, encode(report)) is None


def test_only_faults_that_take_an_engine_down_are_acted_on() -> None:
    down = FaultReport.of("r1", "a", "grpc://a:1", EngineError(ErrorKind.UNAVAILABLE, "gone"))
    error = down.error()
    assert error is not None and error.kind is ErrorKind.UNAVAILABLE
    assert "r1" in error.message and error.engine == "a"
    busy = FaultReport.of("r1", "a", "grpc://a:1", EngineError(ErrorKind.OVERLOADED, "busy"))
    assert busy.error() is None
    assert FaultReport("r1", "a", "u", "no-such-kind", "?").error() is None


def test_subjects_name_the_cluster() -> None:
    subjects = Subjects("prod")
    assert {subjects.load, subjects.fault, subjects.placements, subjects.snapshot} == {
        "prod.load", "prod.fault", "prod.placements", "prod.kv-snapshot"}
    assert subjects.responses("0a1b2c3d") == "prod.responses.0a1b2c3d"

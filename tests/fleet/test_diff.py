"""The sans-IO parts of live reload: the fleet diff and change detection."""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from pathlib import Path

import pytest

from direct_frontend.fleet.describe import describe_fleet, to_jsonable
from direct_frontend.fleet.diff import RESTART_FIELDS, diff_fleet_data, diff_fleets
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.fleet.schema import FleetConfig, FrontendConfig
from direct_frontend.fleet.watch import ChangeDetector, stamp_of

BASE = """\
[frontend]
served_model_name = "demo"
tokenizer = "m"
{frontend}

[[engine]]
name = "a"
url = "grpc://10.0.0.1:50051"
kind = "sglang"

[[engine]]
name = "b"
url = "grpc://10.0.0.2:50051"
kind = "vllm"
{b}
{more}
"""


def fleet(frontend: str = "", b: str = "", more: str = "") -> FleetConfig:
    return parse_fleet(BASE.format(frontend=frontend, b=b, more=more), Path("fleet.toml"))


def test_identical_fleets_have_an_empty_diff() -> None:
    diff = diff_fleets(fleet(), fleet())
    assert diff.empty and diff.lines() == ["no changes"]
    assert diff.unchanged == ("a", "b")


def test_added_removed_and_changed_engines() -> None:
    old = fleet(more='[[engine]]\nname = "c"\nurl = "grpc://10.0.0.3:1"\nkind = "sglang"')
    new = fleet(b='role = "decode"\ncontext_length = 8192',
                more='[[engine]]\nname = "d"\nurl = "grpc://10.0.0.4:1"\nkind = "trtllm"')
    diff = diff_fleets(old, new)
    assert diff.added == ("d",)
    assert diff.removed == ("c",)
    assert [(c.name, c.fields) for c in diff.changed] == [("b", ("role", "context_length"))]
    assert diff.unchanged == ("a",)
    assert diff.lines()[:3] == [
        "+ engine d (joins: probe first, then serves)",
        "- engine c (drains, then leaves)",
        "~ engine b (replaced: role, context_length)",
    ]


def test_a_new_url_or_kind_replaces_the_engine_and_a_rename_is_remove_plus_add() -> None:
    moved = BASE.replace("grpc://10.0.0.2:50051", "grpc://10.0.0.9:50051")
    diff = diff_fleets(fleet(), parse_fleet(moved.format(frontend="", b="", more=""),
                                            Path("fleet.toml")))
    assert [(c.name, c.fields) for c in diff.changed] == [("b", ("url",))]
    renamed = BASE.replace('name = "b"', 'name = "b2"')
    diff = diff_fleets(fleet(), parse_fleet(renamed.format(frontend="", b="", more=""),
                                            Path("fleet.toml")))
    assert (diff.added, diff.removed, diff.changed) == (("b2",), ("b",), ())


def test_frontend_changes_split_into_live_and_restart() -> None:
    new = fleet(frontend=textwrap.dedent("""\
        listen = "0.0.0.0:9000"
        max_tokens_default = 77
        drain_timeout_s = 5
        [frontend.routing]
        policy = "least_loaded"
        [frontend.probe]
        interval_s = 1.0
        [frontend.admin]
        token = "a-very-secret-admin-token"
        """))
    diff = diff_fleets(fleet(), new)
    assert diff.restart == ("listen",)
    assert set(diff.live) == {
        "max_tokens_default", "drain_timeout_s", "routing.policy", "probe.interval_s",
        "admin.token",
    }
    assert "! frontend.listen (needs a restart; keeps its running value)" in diff.lines()
    assert not diff.added and not diff.changed


def test_secrets_are_redacted_in_output_but_rotations_are_still_changes() -> None:
    secret = "s3cret-admin-token-123"
    key = "sk-client-key-456789"
    old = fleet(frontend=f'[frontend.admin]\ntoken = "{secret}"\n[frontend.auth]\n'
                         f'api_keys = ["{key}"]')
    new = fleet(frontend=f'[frontend.admin]\ntoken = "{secret}-2"\n[frontend.auth]\n'
                         f'api_keys = ["{key}"]')
    shown = repr(old) + describe_fleet(old) + str(to_jsonable(old))
    assert secret not in shown and key not in shown
    assert re.search(r"admin.token +set \(redacted\)", describe_fleet(old))
    assert diff_fleets(old, new).live == ("admin.token",)
    # Against a daemon's redacted /fleet, secrets compare by presence only.
    assert diff_fleet_data(to_jsonable(old), to_jsonable(new)).empty


def test_secret_errors_never_quote_the_value() -> None:
    text = BASE.format(frontend='[frontend.admin]\ntoken = "has space"\n[frontend.auth]\n'
                                'api_keys = ["ok-key", 123456]', b="", more="")
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, Path("fleet.toml"))
    message = str(caught.value)
    assert "fleet.toml:5: frontend.admin.token: must be non-empty" in message
    assert "frontend.auth.api_keys[2]: expected a string, got integer" in message
    assert "has space" not in message and "123456" not in message


def test_restart_fields_name_real_frontend_fields() -> None:
    fields = set(FrontendConfig.__dataclass_fields__)
    assert {"listen_host", "tokenizer", "served_model_name", "log_json", "tracing",
            "replicas"} <= fields
    assert set(RESTART_FIELDS) == {
        "listen", "tokenizer", "served_model_name", "log_json", "tracing", "replicas", "workers",
        "responses", "default_context_length",
    }


def test_drain_timeout_defaults_to_30_and_is_checked() -> None:
    assert fleet().frontend.drain_timeout_s == 30.0
    with pytest.raises(FleetError, match="drain_timeout_s: must be at least 0"):
        fleet(frontend="drain_timeout_s = -1")


# -- change detection ----------------------------------------------------------------


def test_change_detector_waits_for_the_file_to_settle(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("one")
    detector = ChangeDetector(stamp_of(path))
    assert not detector.feed(stamp_of(path))
    path.write_text("two, longer")
    assert not detector.feed(stamp_of(path))  # just changed: wait one more poll
    assert detector.feed(stamp_of(path))  # settled: reload once
    assert not detector.feed(stamp_of(path))


def test_change_detector_sees_an_editor_rename_and_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("same")
    detector = ChangeDetector(stamp_of(path))
    replacement = tmp_path / "fleet.toml.swp"
    replacement.write_text("same")
    os.utime(replacement, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    path.unlink()
    assert not detector.feed(stamp_of(path))  # gone for a moment: not settled yet
    os.replace(replacement, path)  # same size and mtime, new inode
    assert not detector.feed(stamp_of(path))
    assert detector.feed(stamp_of(path))


def test_tracing_is_built_at_start_so_a_change_needs_a_restart() -> None:
    new = fleet(frontend='[frontend.tracing]\notlp_endpoint = "http://127.0.0.1:4318/v1/traces"')
    diff = diff_fleets(fleet(), new)
    assert diff.restart == ("tracing.otlp_endpoint",) and not diff.live



def test_every_frontend_setting_is_in_the_json_form_the_diff_reads() -> None:
    """A setting missing from ``to_jsonable`` would be a reload edit the diff cannot see."""
    aliases = {"listen_host": "listen", "listen_port": "listen", "kv_aware": "knobs"}

    def missing(config: object, shown: object, path: str) -> list[str]:
        assert isinstance(shown, dict), path
        gaps = []
        for field in dataclasses.fields(config):  # type: ignore[arg-type]
            key = aliases.get(field.name, field.name)
            if key not in shown:
                gaps.append(path + key)
                continue
            value = getattr(config, field.name)
            if dataclasses.is_dataclass(value) and key != "knobs" and shown[key] is not None:
                gaps += missing(value, shown[key], f"{path}{key}.")
        return gaps

    loaded = fleet()
    assert missing(loaded.frontend, to_jsonable(loaded)["frontend"], "frontend.") == []

"""The fleet file: parsing, defaults, every error message, and the shipped configs."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet import (
    EngineConfig,
    FleetConfig,
    FleetError,
    FleetProblem,
    FrontendConfig,
    Knobs,
    KvAwareKnobs,
    ProbeConfig,
    RoutingConfig,
    SimulatorConfig,
    describe_fleet,
    load_fleet,
    parse_fleet,
    to_jsonable,
)
from direct_frontend.fleet.locate import Locator

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path("fleet.toml")

FRONTEND = """\
[frontend]
served_model_name = "demo"
tokenizer = "demo-model"
"""

# One engine, for tests about the frontend: a file with none is refused (after the
# lines under test, so their numbers stay).
ENGINE = '[[engine]]\nurl = "grpc://10.0.0.9:50051"\nkind = "vllm"\n'

ENGINE_KEYS = (
    "name, url, kind, role, kv_events, kv_replay, dp_ranks, context_length, block_size, "
    "bootstrap_port, simulate, simulator, model"
)


def with_an_engine(text: str) -> str:
    """``text`` (dedented) followed by :data:`ENGINE`."""
    return textwrap.dedent(text).rstrip("\n") + "\n\n" + ENGINE


def parse(text: str, source: Path = SOURCE) -> FleetConfig:
    return parse_fleet(textwrap.dedent(text), source)


def problems(text: str) -> list[str]:
    """The lines of the FleetError that ``text`` must raise."""
    with pytest.raises(FleetError) as caught:
        parse(text)
    return str(caught.value).splitlines()


def only_problem(text: str) -> str:
    found = problems(text)
    assert len(found) == 1, found
    return found[0]


# -- good files ------------------------------------------------------------------


def test_full_file_parses_to_expected_objects() -> None:
    cfg = parse(
        """\
        [frontend]
        listen = "0.0.0.0:9000"
        served_model_name = "llama"
        tokenizer = "/models/llama"
        max_body_bytes = 1024
        max_tokens_default = 256
        request_timeout_s = 30
        log_json = true

        [frontend.routing]
        policy = "kv_aware"

        [frontend.routing.knobs]
        overlap_weight = 2.5
        temperature = 0.5

        [frontend.probe]
        interval_s = 1.5
        timeout_s = 10
        failure_threshold = 5
        success_threshold = 1
        join_timeout_s = 90

        [[engine]]
        name = "prefill-0"
        url = "grpc://node-1:30000"
        kind = "sglang"
        role = "prefill"
        bootstrap_port = 8998
        context_length = 8192
        block_size = 64
        kv_events = ["tcp://node-1:5557", "tcp://node-1:5558"]
        kv_replay = ["tcp://node-1:5567", "tcp://node-1:5568"]

        [[engine]]
        url = "grpc://127.0.0.1:50061"
        kind = "vllm"
        role = "decode"
        simulate = true

        [engine.simulator]
        prefill_us_per_token = 5
        decode_us_per_token = 100.0
        max_running = 8
        vocab_size = 512
        eos_probability = 0
        context_length = 2048
        """
    )
    assert cfg == FleetConfig(
        source=SOURCE,
        frontend=FrontendConfig(
            listen_host="0.0.0.0",
            listen_port=9000,
            served_model_name="llama",
            tokenizer=Path("/models/llama"),
            max_body_bytes=1024,
            max_tokens_default=256,
            request_timeout_s=30.0,
            log_json=True,
            routing=RoutingConfig(
                policy="kv_aware",
                knobs={"overlap_weight": 2.5, "temperature": 0.5},
                kv_aware=KvAwareKnobs(overlap_weight=2.5, temperature=0.5),
            ),
            probe=ProbeConfig(
                interval_s=1.5,
                timeout_s=10.0,
                failure_threshold=5,
                success_threshold=1,
                join_timeout_s=90.0,
            ),
        ),
        engines=(
            EngineConfig(
                name="prefill-0",
                url="grpc://node-1:30000",
                kind="sglang",
                role=EngineRole.PREFILL,
                kv_events=("tcp://node-1:5557", "tcp://node-1:5558"),
                kv_replay=("tcp://node-1:5567", "tcp://node-1:5568"),
                context_length=8192,
                block_size=64,
                bootstrap_port=8998,
            ),
            EngineConfig(
                name="127.0.0.1:50061",
                url="grpc://127.0.0.1:50061",
                kind="vllm",
                role=EngineRole.DECODE,
                simulate=True,
                simulator=SimulatorConfig(
                    prefill_us_per_token=5.0,
                    decode_us_per_token=100.0,
                    max_running=8,
                    vocab_size=512,
                    eos_probability=0.0,
                    context_length=2048,
                ),
            ),
        ),
    )
    # Integers written for float settings come back as floats.
    assert isinstance(cfg.frontend.request_timeout_s, float)
    assert isinstance(cfg.engines[1].simulator.prefill_us_per_token, float)


def test_defaults() -> None:
    cfg = parse(FRONTEND + '[[engine]]\nurl = "grpc://10.0.0.7:50051"\nkind = "trtllm"\n')
    frontend = cfg.frontend
    assert (frontend.listen_host, frontend.listen_port) == ("127.0.0.1", 8000)
    assert frontend.max_body_bytes == 4 * 1024 * 1024
    assert frontend.max_tokens_default == 1024
    assert frontend.request_timeout_s == 600.0
    assert frontend.log_json is False
    assert frontend.routing == RoutingConfig(policy="round_robin", knobs={})
    assert frontend.probe == ProbeConfig(
        interval_s=5.0, timeout_s=2.0, failure_threshold=3, success_threshold=2, join_timeout_s=30
    )
    (engine,) = cfg.engines
    assert engine == EngineConfig(name="10.0.0.7:50051", url="grpc://10.0.0.7:50051", kind="trtllm")
    assert engine.role is EngineRole.BOTH
    assert (engine.kv_events, engine.kv_replay) == ((), ())
    assert (engine.context_length, engine.block_size, engine.bootstrap_port) == (None, None, None)
    assert engine.simulate is False
    assert engine.simulator == SimulatorConfig(
        prefill_us_per_token=20.0,
        decode_us_per_token=2000.0,
        max_running=64,
        vocab_size=None,
        eos_probability=0.02,
        context_length=4096,
    )


def test_simulated_engine_without_simulator_table_gets_defaults() -> None:
    cfg = parse(
        FRONTEND + '[[engine]]\nurl = "grpc://127.0.0.1:1"\nkind = "vllm"\nsimulate = true\n'
    )
    assert cfg.engines[0].simulate
    assert cfg.engines[0].simulator == SimulatorConfig()


def test_a_fleet_without_engines_is_refused_unless_it_says_so() -> None:
    # Cut short after [frontend] (or its last table): the problem is where the engines are not.
    refusal = (
        "engine: no [[engine]] or [[pool]] tables (is the file cut short?); add engines, or set"
        " allow_empty_fleet = true in [frontend] to run with none"
    )
    assert only_problem(FRONTEND) == f"fleet.toml:3: {refusal}"
    assert only_problem(FRONTEND + "\n[frontend.probe]\ninterval_s = 1\n\n\n") == (
        f"fleet.toml:6: {refusal}"
    )
    assert only_problem("engine = []\n" + FRONTEND) == f"fleet.toml:1: {refusal}"
    # Engine tables that are all invalid are reported as such, not as "none".
    assert "no [[engine]]" not in "".join(problems(FRONTEND + "[[engine]]\n"))
    allowed = FRONTEND + "allow_empty_fleet = true\n"
    assert parse(allowed).engines == ()
    assert parse(allowed).frontend.allow_empty_fleet
    assert parse("engine = []\n" + allowed).engines == ()


def test_ipv6_addresses_in_brackets() -> None:
    cfg = parse(
        FRONTEND.replace("[frontend]", '[frontend]\nlisten = "[::1]:8080"')
        + '[[engine]]\nurl = "grpc://[fe80::1]:50051"\nkind = "sglang"\n'
    )
    assert (cfg.frontend.listen_host, cfg.frontend.listen_port) == ("::1", 8080)
    assert cfg.frontend.listen == "[::1]:8080"
    assert cfg.engines[0].name == "[fe80::1]:50051"


def test_listen_port_zero_picks_a_free_port() -> None:
    text = FRONTEND.replace("[frontend]", '[frontend]\nlisten = "127.0.0.1:0"')
    cfg = parse(with_an_engine(text))
    assert cfg.frontend.listen_port == 0


def test_dotted_and_inline_tables_mean_the_same() -> None:
    cfg = parse(
        """\
        frontend.served_model_name = "demo"
        frontend.tokenizer = "m"
        frontend.routing.policy = "least_loaded"
        engine = [
          { url = "grpc://[::1]:7", kind = "sglang", simulate = true, simulator.max_running = 3 },
        ]
        """
    )
    assert cfg.frontend.routing.policy == "least_loaded"
    assert cfg.engines[0].simulator.max_running == 3


# -- tokenizer path --------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "tokenizer", "expected"),
    [
        (Path("fleet.toml"), "demo-model", Path("demo-model")),
        (Path("config/fleet.toml"), "demo-model", Path("config/demo-model")),
        (Path("/etc/df/fleet.toml"), "models/m", Path("/etc/df/models/m")),
        (Path("/etc/df/fleet.toml"), "../m", Path("/etc/df/../m")),
        (Path("/etc/df/fleet.toml"), "/models/m", Path("/models/m")),
    ],
)
def test_tokenizer_resolves_against_the_fleet_file(
    source: Path, tokenizer: str, expected: Path
) -> None:
    text = f'[frontend]\nserved_model_name = "x"\ntokenizer = "{tokenizer}"\n' + ENGINE
    assert parse_fleet(text, source).frontend.tokenizer == expected


def test_tokenizer_tilde_is_not_expanded() -> None:
    text = FRONTEND.replace('"demo-model"', '"~/models/m"')
    assert only_problem(with_an_engine(text)) == (
        "fleet.toml:3: frontend.tokenizer: '~/models/m': '~' is not expanded; write the full path"
    )


def test_tokenizer_directory_need_not_exist(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(with_an_engine(FRONTEND))
    cfg = load_fleet(fleet)
    assert cfg.frontend.tokenizer == tmp_path / "demo-model"
    assert not cfg.frontend.tokenizer.exists()
    assert cfg.source == fleet


# -- error messages --------------------------------------------------------------


def test_non_ascii_secrets_are_refused_without_being_quoted() -> None:
    # A client's header arrives as bytes; no UTF-8 key could ever match it.
    text = with_an_engine(
        FRONTEND + '[frontend.admin]\ntoken = "jeton-\u00e9t\u00e9"\n'
        '[frontend.auth]\napi_keys = ["sk-ok", "sk-\u043a\u043b\u044e\u0447"]\n'
    )
    ascii_only = "must be ASCII (an Authorization header cannot carry it otherwise)"
    assert problems(text) == [
        f"fleet.toml:5: frontend.admin.token: {ascii_only}",
        f"fleet.toml:7: frontend.auth.api_keys[2]: {ascii_only}",
    ]
    assert "\u00e9" not in "".join(problems(text))



def test_unknown_key() -> None:
    text = FRONTEND + '\n[[engine]]\nurl = "grpc://h:1"\nkind = "vllm"\ncolour = "red"\n'
    assert only_problem(text) == (
        f"fleet.toml:8: engine[1].colour: unknown key (expected one of: {ENGINE_KEYS})"
    )


def test_unknown_keys_in_every_table() -> None:
    found = problems(with_an_engine(
        """\
        engines = 1
        [frontend]
        served_model_name = "demo"
        tokenizer = "m"
        port = 8000
        [frontend.routing]
        polcy = "kv_aware"
        [frontend.probe]
        interval = 5
        """
    ))
    assert found == [
        "fleet.toml:1: engines: unknown key (expected one of: frontend, engine, model, pool)",
        "fleet.toml:5: frontend.port: unknown key (expected one of: listen, served_model_name, "
        "tokenizer, max_body_bytes, max_tokens_default, default_context_length, request_timeout_s, "
        "header_timeout_s, body_timeout_s, log_json, drain_timeout_s, allow_empty_fleet, "
        "workers, routing, probe, admin, auth, faults, limits, tracing, access_log, tenants, "
        "replicas, kubernetes, responses, batches)",
        "fleet.toml:7: frontend.routing.polcy: unknown key (expected one of: policy, knobs, "
        "session_key, session_weight, cold_prefix_home)",
        "fleet.toml:9: frontend.probe.interval: unknown key (expected one of: interval_s, "
        "timeout_s, failure_threshold, success_threshold, join_timeout_s, read_loads)",
    ]


def test_bad_url_has_no_line_when_none_is_known() -> None:
    problem = FleetProblem("fleet.toml", None, "engine[2].url", "'grpc//x' is not a valid URL")
    assert str(problem) == "fleet.toml: engine[2].url: 'grpc//x' is not a valid URL"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("grpc//x", ""),
        ("h:1", ""),
        ("http://h:1", "the scheme must be grpc://, not http://"),
        ("grpc://h", "the port is missing (expected grpc://host:port)"),
        ("grpc://h:", "the port is missing (expected grpc://host:port)"),
        ("grpc://:1", "the host is missing (expected grpc://host:port)"),
        ("grpc://h:0", "the port must be between 1 and 65535, got 0"),
        ("grpc://h:65536", "the port must be between 1 and 65535, got 65536"),
        ("grpc://h:x", "the port 'x' is not a number"),
        ("grpc://h:1/v1", "only grpc://host:port is allowed (no path, query or fragment)"),
        ("grpc://h:1/", "only grpc://host:port is allowed (no path, query or fragment)"),
        ("grpc://u@h:1", "user info is not allowed"),  # quoted as grpc://<redacted>@h:1
        ("grpc://h_ st:1", "'h_ st' is not a valid host name or IP address"),
        ("grpc://300.1.1.1:1", "'300.1.1.1' is not a valid host name or IP address"),
        ("grpc://::1:5", "an IPv6 address must be in brackets, like [::1]:port"),
        ("grpc://[zz]:5", "'zz' is not an IPv6 address"),
    ],
)
def test_bad_url(url: str, reason: str) -> None:
    text = FRONTEND + f'[[engine]]\nname = "e"\nkind = "vllm"\nurl = "{url}"\n'
    shown = url.replace("u@", "<redacted>@")
    message = f"{shown!r} is not a valid URL" + (f": {reason}" if reason else "")
    assert only_problem(text) == f"fleet.toml:7: engine[1].url: {message}"


def test_bad_listen_address() -> None:
    text = FRONTEND + 'listen = "localhost"\n'
    assert only_problem(with_an_engine(text)) == (
        "fleet.toml:4: frontend.listen: 'localhost' is not a valid listen address: "
        "the port is missing (expected host:port)"
    )


def test_duplicate_names() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        name = "a"
        url = "grpc://h:1"
        kind = "vllm"

        [[engine]]
        name = "a"
        url = "grpc://h:2"
        kind = "vllm"
        """
    )
    assert only_problem(text) == "fleet.toml:10: engine[2].name: 'a' is already used by engine[1]"


def test_duplicate_derived_name() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        name = "h:2"
        url = "grpc://h:1"
        kind = "vllm"

        [[engine]]
        url = "grpc://h:2"
        kind = "vllm"
        """
    )
    assert only_problem(text) == (
        "fleet.toml:9: engine[2].name: 'h:2' (derived from the url) is already used by engine[1]"
    )


def test_duplicate_urls_compare_host_case_insensitively() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://node-1:1"
        kind = "vllm"

        [[engine]]
        url = "grpc://NODE-1:1"
        kind = "sglang"
        """
    )
    # Reported once: the derived names differ only because the URLs clash.
    assert only_problem(text) == (
        "fleet.toml:9: engine[2].url: 'grpc://NODE-1:1' is already used by engine[1]"
    )


def test_simulated_engines_need_distinct_ports() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://127.0.0.1:50061"
        kind = "sglang"
        simulate = true

        [[engine]]
        url = "grpc://localhost:50061"
        kind = "sglang"
        simulate = true
        """
    )
    assert only_problem(text) == (
        "fleet.toml:10: engine[2].url: port 50061 is already used by simulated engine[1]"
    )


def test_simulated_engine_must_be_on_loopback() -> None:
    text = FRONTEND + '[[engine]]\nurl = "grpc://10.1.1.1:5"\nkind = "sglang"\nsimulate = true\n'
    assert only_problem(text) == (
        "fleet.toml:5: engine[1].url: a simulated engine listens on 127.0.0.1; "
        "use grpc://127.0.0.1:5"
    )


def test_bad_kind() -> None:
    text = FRONTEND + '[[engine]]\nurl = "grpc://h:1"\nkind = "tgi"\n'
    assert only_problem(text) == (
        "fleet.toml:6: engine[1].kind: 'tgi' is not a valid engine kind "
        "(expected one of: sglang, vllm, trtllm)"
    )


def test_bad_policy_and_role() -> None:
    found = problems(
        FRONTEND
        + 'routing = { policy = "random" }\n'
        + '[[engine]]\nurl = "grpc://h:1"\nkind = "vllm"\nrole = "both-ish"\n'
    )
    assert found == [
        "fleet.toml:4: frontend.routing.policy: 'random' is not a valid policy "
        "(expected one of: round_robin, least_loaded, kv_aware, cache_affinity)",
        "fleet.toml:8: engine[1].role: 'both-ish' is not a valid role "
        "(expected one of: both, prefill, decode)",
    ]


def test_missing_required_keys() -> None:
    found = problems('[[engine]]\nname = "e"\n')
    assert found == [
        "fleet.toml: frontend.served_model_name: required key is missing",
        "fleet.toml: frontend.tokenizer: required key is missing",
        "fleet.toml:1: engine[1].url: required key is missing",
        "fleet.toml:1: engine[1].kind: required key is missing",
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('max_tokens_default = "abc"', 'expected an integer, got string "abc"'),
        ("max_tokens_default = 1.5", "expected an integer, got float 1.5"),
        ("max_tokens_default = true", "expected an integer, got boolean true"),
        ("request_timeout_s = true", "expected a number, got boolean true"),
        ("request_timeout_s = inf", "must be a finite number, got inf"),
        ('log_json = "yes"', 'expected a boolean, got string "yes"'),
        ("listen = 8000", "expected a string, got integer 8000"),
        ("listen = 1979-05-27", "expected a string, got date 1979-05-27"),
        ("routing = 1", "expected a table, got integer 1"),
        ("probe = []", "expected a table, got array"),
        ('served_model_name = " "', "must not be empty"),
    ],
)
def test_wrong_type(line: str, message: str) -> None:
    text = f'[frontend]\ntokenizer = "m"\n{line}\n'
    if not line.startswith("served_model_name"):
        text += 'served_model_name = "d"\n'
    key = line.split(" ")[0]
    assert only_problem(with_an_engine(text)) == f"fleet.toml:3: frontend.{key}: {message}"


def test_wrong_types_in_engines() -> None:
    found = problems(
        FRONTEND
        + textwrap.dedent(
            """\
            [[engine]]
            url = "grpc://h:1"
            kind = "vllm"
            kv_events = "tcp://h:2"
            kv_replay = [1]
            simulate = "yes"
            """
        )
    )
    assert found == [
        'fleet.toml:7: engine[1].kv_events: expected an array of strings, got string "tcp://h:2"',
        "fleet.toml:8: engine[1].kv_replay[1]: expected a string, got integer 1",
        'fleet.toml:9: engine[1].simulate: expected a boolean, got string "yes"',
    ]


def test_engine_must_be_an_array_of_tables() -> None:
    assert only_problem(FRONTEND + '[engine]\nurl = "grpc://h:1"\n') == (
        "fleet.toml:4: engine: expected an array of tables ([[engine]]), got table"
    )
    assert only_problem("engine = [1]\n" + FRONTEND) == (
        "fleet.toml:1: engine[1]: expected a table, got integer 1"
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("[frontend.probe]\ninterval_s = 0", "must be greater than 0, got 0"),
        ("[frontend.probe]\ntimeout_s = -1.5", "must be greater than 0, got -1.5"),
        ("[frontend.probe]\nsuccess_threshold = 0", "must be at least 1, got 0"),
        ("[frontend]\nmax_body_bytes = 0", "must be at least 1, got 0"),
        (
            '[frontend]\nlisten = "h:70000"',
            "'h:70000' is not a valid listen address: "
            "the port must be between 0 and 65535, got 70000",
        ),
    ],
)
def test_out_of_range_frontend(setting: str, message: str) -> None:
    table, line = setting.split("\n")
    key = line.split(" ")[0]
    if table == "[frontend]":
        expected = f"fleet.toml:4: frontend.{key}: {message}"
        text = FRONTEND + line + "\n"
    else:
        expected = f"fleet.toml:5: frontend.probe.{key}: {message}"
        text = FRONTEND + table + "\n" + line + "\n"
    assert only_problem(with_an_engine(text)) == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("context_length = 0", "must be at least 1, got 0"),
        ("block_size = -16", "must be at least 1, got -16"),
        ("bootstrap_port = 70000", "must be between 1 and 65535, got 70000"),
        ("simulator.max_running = 0", "must be at least 1, got 0"),
        ("simulator.eos_probability = 1.5", "must be between 0 and 1, got 1.5"),
        ("simulator.decode_us_per_token = -1", "must be at least 0, got -1"),
        ("simulator.vocab_size = 0", "must be at least 1, got 0"),
        ("simulator.embedding_dim = -1", "must be at least 0, got -1"),
    ],
)
def test_out_of_range_engine(line: str, message: str) -> None:
    text = (
        FRONTEND
        + '[[engine]]\nurl = "grpc://127.0.0.1:1"\nkind = "sglang"\nsimulate = true\n'
        + line
        + "\n"
    )
    key = line.split(" ")[0]
    assert only_problem(text) == f"fleet.toml:8: engine[1].{key}: {message}"


def test_simulator_table_without_simulate() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://127.0.0.1:1"
        kind = "sglang"

        [engine.simulator]
        max_running = 0
        """
    )
    # The contents are not checked: the table should not be there at all.
    assert (
        only_problem(text) == "fleet.toml:8: engine[1].simulator: only allowed with simulate = true"
    )
    explicit_false = text.replace('kind = "sglang"', 'kind = "sglang"\nsimulate = false')
    assert only_problem(explicit_false) == (
        "fleet.toml:9: engine[1].simulator: only allowed with simulate = true"
    )


def test_kv_replay_length_mismatch() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://h:1"
        kind = "vllm"
        kv_events = ["tcp://h:5557", "tcp://h:5558"]
        kv_replay = ["tcp://h:5567"]
        """
    )
    assert only_problem(text) == (
        "fleet.toml:8: engine[1].kv_replay: has 1 endpoint but kv_events has 2 "
        "(one replay endpoint per data-parallel rank, in the same order)"
    )
    no_events = text.replace('kv_events = ["tcp://h:5557", "tcp://h:5558"]\n', "")
    assert only_problem(no_events) == (
        "fleet.toml:7: engine[1].kv_replay: has 1 endpoint but kv_events has 0 "
        "(one replay endpoint per data-parallel rank, in the same order)"
    )


def test_a_simulated_engines_ranks_publish_on_consecutive_ports() -> None:
    """One simulated rank per kv_events endpoint, on base port + rank, as vLLM publishes."""
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://127.0.0.1:1"
        kind = "vllm"
        simulate = true
        kv_events = ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
        kv_replay = ["tcp://127.0.0.1:5567", "tcp://127.0.0.1:5570"]
        """
    )
    assert only_problem(text) == (
        "fleet.toml:9: engine[1].kv_replay[2]: a simulated engine's rank 1 publishes on the "
        "first endpoint's port + 1: use port 5568"
    )
    assert parse(text.replace("5570", "5568")).engines[0].kv_replay[1] == "tcp://127.0.0.1:5568"
    real = text.replace("simulate = true\n", "")  # a real engine's endpoints are its own
    assert parse(real).engines[0].kv_replay[1] == "tcp://127.0.0.1:5570"


def test_dp_ranks_names_the_ranks_of_an_engine_without_kv_events() -> None:
    text = FRONTEND + textwrap.dedent(
        """\
        [[engine]]
        url = "grpc://h:1"
        kind = "vllm"
        dp_ranks = 4
        """
    )
    assert parse(text).engines[0].dp_ranks == 4
    both = text.replace("dp_ranks = 4", 'dp_ranks = 4\nkv_events = ["tcp://h:5557", "tcp://h:5558"]')
    assert only_problem(both) == (
        "fleet.toml:7: engine[1].dp_ranks: is 4 but kv_events has 2 endpoints "
        "(one per data-parallel rank)")
    assert parse(both.replace("dp_ranks = 4", "dp_ranks = 2")).engines[0].dp_ranks == 2
    assert "engine[1].dp_ranks" in only_problem(text.replace("dp_ranks = 4", "dp_ranks = 0"))


def test_kv_endpoints() -> None:
    found = problems(
        FRONTEND
        + textwrap.dedent(
            """\
            [[engine]]
            url = "grpc://h:1"
            kind = "vllm"
            kv_events = [
                "tcp://h:5557",
                "ipc:///tmp/kv",
                "tcp://*:5559",
            ]

            [[engine]]
            url = "grpc://h:2"
            kind = "vllm"
            kv_events = ["tcp://H:5557"]
            """
        )
    )
    assert found == [
        "fleet.toml:9: engine[1].kv_events[2]: 'ipc:///tmp/kv' is not a valid ZMQ endpoint: "
        "the scheme must be tcp://, not ipc://",
        "fleet.toml:10: engine[1].kv_events[3]: 'tcp://*:5559' is not a valid ZMQ endpoint: "
        "'*' is a bind address; give the host to connect to (tcp://host:port)",
        "fleet.toml:16: engine[2].kv_events[1]: 'tcp://H:5557' is already used by "
        "engine[1].kv_events[1]",
    ]


def test_role_rules() -> None:
    found = problems(
        FRONTEND
        + textwrap.dedent(
            """\
            [[engine]]
            url = "grpc://h:1"
            kind = "trtllm"
            role = "prefill"

            [[engine]]
            url = "grpc://h:2"
            kind = "sglang"
            role = "decode"
            bootstrap_port = 8998

            [[engine]]
            url = "grpc://h:3"
            kind = "vllm"
            bootstrap_port = 8998

            [[engine]]
            url = "grpc://h:8998"
            kind = "sglang"
            role = "prefill"
            bootstrap_port = 8998
            """
        )
    )
    assert found == [
        'fleet.toml:7: engine[1].role: trtllm engines have no P/D roles; use role = "both"',
        "fleet.toml:13: engine[2].bootstrap_port: only prefill engines run a bootstrap server "
        "(role is decode)",
        "fleet.toml:18: engine[3].bootstrap_port: only sglang engines have a bootstrap port "
        "(this one is vllm)",
        "fleet.toml:24: engine[4].bootstrap_port: must differ from the gRPC port in url (8998)",
    ]


def test_knobs_must_be_scalars() -> None:
    text = FRONTEND + "[frontend.routing.knobs]\nok = 1\nweights = [1, 2]\n"
    assert only_problem(with_an_engine(text)) == (
        "fleet.toml:6: frontend.routing.knobs.weights: expected a string, number or boolean, "
        "got array"
    )


def test_quoted_keys_are_quoted_in_messages() -> None:
    text = FRONTEND + '"served model" = "x"\n'
    assert only_problem(with_an_engine(text)).startswith(
        'fleet.toml:4: frontend."served model": unknown key'
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[frontend\n", "1:10: expected ']' at the end of a table declaration"),
        ("[frontend]\nlisten = \n", "2:10: invalid value"),
        ("[frontend]\n[frontend]\n", "2:10: cannot declare ('frontend',) twice"),
        ('[frontend]\nlisten = "x', "2:12: unterminated string"),  # at end of document
        ("[frontend]\na = [1,\n", "3:1: invalid value"),
    ],
)
def test_toml_syntax_error(text: str, expected: str) -> None:
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, SOURCE)
    where, message = expected.split(": ", 1)
    assert str(caught.value) == f"fleet.toml:{where}: invalid TOML: {message}"
    (problem,) = caught.value.problems
    assert problem.line is not None and problem.column is not None


def test_many_problems_are_reported_together_in_file_order() -> None:
    text = textwrap.dedent(
        """\
        [frontend]
        served_model_name = "demo"
        tokenizer = "m"
        max_tokens_default = "abc"

        [[engine]]
        url = "grpc//x"
        kind = "vllm"

        [[engine]]
        name = "b"
        url = "grpc://h:2"
        kind = "tgi"
        colour = "red"
        """
    )
    with pytest.raises(FleetError) as caught:
        parse(text)
    assert [(p.line, p.field) for p in caught.value.problems] == [
        (4, "frontend.max_tokens_default"),
        (7, "engine[1].url"),
        (13, "engine[2].kind"),
        (14, "engine[2].colour"),
    ]
    assert str(caught.value) == "\n".join(str(p) for p in caught.value.problems)


def test_file_name_is_used_as_given(tmp_path: Path) -> None:
    text = '[frontend]\nserved_model_name = "d"\ntokenizer = "m"\nlog_json = 1\n' + ENGINE
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, Path("conf/prod.toml"))
    assert str(caught.value) == (
        "conf/prod.toml:4: frontend.log_json: expected a boolean, got integer 1"
    )


def test_unreadable_and_undecodable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(FleetError) as caught:
        load_fleet(missing)
    assert str(caught.value) == f"{missing}: cannot read the file: No such file or directory"

    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[frontend]\nserved_model_name = "caf\xe9"\n')
    with pytest.raises(FleetError) as caught:
        load_fleet(latin1)
    assert str(caught.value) == f"{latin1}:2: not UTF-8 text (byte 0xe9 at offset 35)"


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_bytes(b"\xef\xbb\xbf" + with_an_engine(FRONTEND).encode())
    assert load_fleet(fleet).frontend.served_model_name == "demo"


# -- the line locator ----------------------------------------------------------


def test_locator_follows_toml_structure() -> None:
    text = textwrap.dedent(
        '''\
        # [[engine]] in a comment does not count
        title = """
        [[engine]]
        url = "not a key"
        """
        [frontend]
        routing.policy = "x"   # dotted key
        "quoted key" = 1

        [[engine]]
        url = "a"
        simulator = { max_running = 1, nested = { deep = 2 } }
        kv_events = [
            "tcp://a:1", # first
            [ "weird", "]" ],
            "tcp://a:3",
        ]

        [ engine . simulator ]
        max_running = 2

        [[engine]]
        'literal' = 'x'
        [engine.simulator]
        eos_probability = 0.5
        '''
    )
    locate = Locator(text).line_of
    assert locate(("title",)) == 2
    assert locate(("frontend",)) == 6
    assert locate(("frontend", "routing")) == 7
    assert locate(("frontend", "routing", "policy")) == 7
    assert locate(("frontend", "quoted key")) == 8
    assert locate(("engine",)) == 10
    assert locate(("engine", 1)) == 10
    assert locate(("engine", 1, "url")) == 11
    assert locate(("engine", 1, "simulator", "nested", "deep")) == 12
    assert locate(("engine", 1, "kv_events", 1)) == 14
    assert locate(("engine", 1, "kv_events", 3)) == 16
    assert locate(("engine", 1, "simulator", "max_running")) == 12  # first occurrence
    assert locate(("engine", 2)) == 22
    assert locate(("engine", 2, "literal")) == 23
    assert locate(("engine", 2, "simulator")) == 24
    assert locate(("engine", 2, "simulator", "eos_probability")) == 25
    # Unknown paths fall back to the nearest known ancestor, then to no line.
    assert locate(("engine", 2, "kind")) == 22
    assert locate(("engine", 9, "kind")) == 10
    assert locate(("nothing",)) is None


def test_locator_gives_up_quietly_on_text_it_cannot_follow() -> None:
    assert Locator("a = 1\n= = =\n").line_of(("a",)) == 1


# -- shipped configs, description and JSON ------------------------------------


def test_demo_fleet_parses() -> None:
    source = ROOT / "config" / "fleet.toml"
    cfg = load_fleet(source)
    assert cfg.frontend.listen == "127.0.0.1:8000"
    assert cfg.frontend.served_model_name == "demo"
    assert cfg.frontend.tokenizer == ROOT / "config" / "demo-model"
    assert cfg.frontend.routing.policy == "round_robin"
    assert [(e.url, e.kind, e.simulate) for e in cfg.engines] == [
        ("grpc://127.0.0.1:30061", "sglang", True),
        ("grpc://127.0.0.1:30062", "sglang", True),
    ]


@pytest.fixture(autouse=True)
def production_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """production.toml reads its API keys from the environment, as its deployment sets it."""
    monkeypatch.setenv("DIRECT_FRONTEND_API_KEYS", "sk-example-1,sk-example-2")


@pytest.mark.parametrize("name", ["mixed.toml", "production.toml", "embeddings.toml"])
def test_examples_parse(name: str) -> None:
    cfg = load_fleet(ROOT / "config" / "examples" / name)
    assert cfg.engines
    if name == "mixed.toml":
        assert sorted(e.kind for e in cfg.engines) == ["sglang", "trtllm", "vllm"]
        assert all(e.simulate for e in cfg.engines)
        assert cfg.frontend.tokenizer == ROOT / "config" / "examples" / ".." / "demo-model"
    elif name == "embeddings.toml":
        assert [m.name for m in cfg.models] == ["chat", "embed"]
        assert [e.simulator.embedding_dim for e in cfg.engines] == [0, 32, 32]
    else:
        assert not any(e.simulate for e in cfg.engines)
        assert {e.role for e in cfg.engines} == set(EngineRole)
        assert cfg.frontend.auth.api_keys == ("sk-example-1", "sk-example-2")
        assert not cfg.frontend.admin.enabled


def test_describe_shows_resolved_settings_and_facts() -> None:
    cfg = load_fleet(ROOT / "config" / "examples" / "production.toml")
    text = describe_fleet(cfg)
    assert re.search(r"^  max_body_bytes +16777216 \(16 MiB\)$", text, re.M)
    assert re.search(r"^  probe.failure_threshold +3$", text, re.M)
    assert re.search(r"^  faults.drain_migrate_after_s +10.0$", text, re.M)
    assert (
        "    context_length  sglang: server_args.context_length, if set "
        "(max_context_length is the KV pool); override: 131072\n" in text
    )
    assert "    context_length  vllm: GetModelInfo.max_context_length = max_model_len\n" in text
    assert (
        "    context_length  trtllm: not read (max_seq_len is a flag default); override: 131072\n"
        in text
    )
    assert "    block_size      vllm: GetServerInfo.block_size (0 until resolved)\n" in text
    assert "    block_size      sglang: server_args.page_size; override: 64\n" in text
    assert (
        "    model           trtllm: not reported (GetModelInfo.model_id is the launch path)\n"
        in text
    )
    assert (
        "    role            sglang: server_args.disaggregation_mode; override: prefill\n" in text
    )
    assert "    role            vllm: GetServerInfo.kv_role\n" in text
    assert ("    kv_capacity     vllm: GetLoads max_total_num_tokens / the ranks listed "
            "(each entry has their sum)\n" in text)
    assert ("    data_parallel   vllm: GetServerInfo.data_parallel_size, GetLoads' first rank; "
            "KV-aware routing pins requests to ranks (one kv_events endpoint per rank, or "
            "dp_ranks)\n" in text)
    assert ("    data_parallel   sglang: GetServerInfo dp_size; never pinned to a rank: its stock "
            "servicer drops data_parallel_rank\n" in text)
    assert ("    kv_capacity     trtllm: not reported; KV routing measures against the fullest "
            "engine seen\n" in text)
    assert (
        "    restarts        vllm: GetServerInfo.uptime_seconds when above 0, the KV-event "
        "publisher starting over; with neither, a new connection after an outage\n" in text
    )
    assert "    role            trtllm: none (no P/D)" in text
    assert ("    serves          vllm: GetModelInfo.is_generation (false: --runner pooling, "
            "/v1/embeddings only)\n" in text)
    assert "engine[4] gpu-node-4:50051\n" in text
    assert "  kv_events[rank 1]  tcp://gpu-node-3:5558 (replay tcp://gpu-node-3:5568)\n" in text
    assert "simulator" not in text


def test_describe_simulated_and_empty_fleets() -> None:
    demo = describe_fleet(load_fleet(ROOT / "config" / "fleet.toml"))
    assert "    block_size      sglang: server_args.page_size\n" in demo
    assert "  kind       sglang, simulated\n" in demo
    assert "    max_running           32\n" in demo
    assert "    vocab_size            from the tokenizer\n" in demo
    assert "engines: none yet" in describe_fleet(parse(FRONTEND + "allow_empty_fleet = true\n"))


def test_to_jsonable() -> None:
    cfg = load_fleet(ROOT / "config" / "examples" / "mixed.toml")
    data = json.loads(json.dumps(to_jsonable(cfg)))
    assert data["frontend"]["listen"] == "127.0.0.1:8000"
    assert data["frontend"]["routing"] == {"policy": "least_loaded", "knobs": {},
                                           "session_key": [], "session_weight": 8.0,
                                           "cold_prefix_home": False}
    assert data["frontend"]["probe"]["interval_s"] == 5.0
    trtllm = data["engines"][2]
    assert trtllm["kind"] == "trtllm"
    assert trtllm["role"] == "both"
    assert trtllm["simulator"]["max_running"] == 16
    real = to_jsonable(load_fleet(ROOT / "config" / "examples" / "production.toml"))
    engines = real["engines"]
    assert isinstance(engines, list) and isinstance(engines[0], dict)
    assert engines[0]["simulator"] is None
    assert engines[0]["bootstrap_port"] == 8998


# -- immutability ----------------------------------------------------------------


def test_configs_are_immutable_and_hashable() -> None:
    cfg = load_fleet(ROOT / "config" / "examples" / "production.toml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.frontend.listen_port = 1  # type: ignore[misc]
    knobs = RoutingConfig(knobs={"a": 1}).knobs
    assert isinstance(knobs, Knobs)
    with pytest.raises(TypeError):
        knobs["a"] = 2  # type: ignore[index]
    assert hash(cfg) == hash(load_fleet(ROOT / "config" / "examples" / "production.toml"))
    assert RoutingConfig(knobs={"a": 1}) == RoutingConfig(knobs=Knobs({"a": 1}))


def test_kv_aware_knobs_are_checked_with_their_lines() -> None:
    text = (
        '[frontend]\nserved_model_name = "x"\ntokenizer = "t"\n'
        '[frontend.routing]\npolicy = "kv_aware"\n[frontend.routing.knobs]\n'
        'block_size = 0\ncolour = 3\ntemperature = "hot"\noverlap_weight = 2\n' + ENGINE
    )
    with pytest.raises(FleetError) as info:
        parse_fleet(text, Path("fleet.toml"))
    lines = str(info.value).splitlines()
    assert lines[0] == "fleet.toml:7: frontend.routing.knobs.block_size: must be at least 1"
    assert lines[1].startswith("fleet.toml:8: frontend.routing.knobs.colour: unknown key")
    assert lines[2] == (
        'fleet.toml:9: frontend.routing.knobs.temperature: expected a number, got string "hot"'
    )
    assert len(lines) == 3


def test_faults_and_limits_tables() -> None:
    text = (
        '[frontend]\nserved_model_name = "x"\ntokenizer = "t"\n'
        "[frontend.faults]\nmax_retries = 0\nstall_timeout_s = 5\n"
        "[frontend.limits]\nmax_in_flight = 8\nqueue_timeout_s = 1.5\n" + ENGINE
    )
    frontend = parse_fleet(text, Path("fleet.toml")).frontend
    assert frontend.faults.max_retries == 0 and frontend.faults.stall_timeout_s == 5
    assert frontend.faults.max_migrations == 3 and frontend.faults.drain_migrate_after_s == 10
    assert frontend.limits.max_in_flight == 8 and frontend.limits.queue_timeout_s == 1.5
    with pytest.raises(FleetError) as info:
        parse_fleet(text.replace("max_in_flight = 8", "max_in_flight = 0"), Path("fleet.toml"))
    assert str(info.value) == (
        "fleet.toml:8: frontend.limits.max_in_flight: must be at least 1, got 0"
    )


def test_kv_aware_knobs_are_typed_by_the_loader() -> None:
    text = (
        FRONTEND + '[frontend.routing]\npolicy = "kv_aware"\n'
        "[frontend.routing.knobs]\noverlap_weight = 2\nblock_size = 32\n"
    )
    routing = parse(with_an_engine(text)).frontend.routing
    assert routing.kv_aware == KvAwareKnobs(overlap_weight=2.0, block_size=32)
    assert isinstance(routing.kv_aware.overlap_weight, float)
    assert dict(routing.knobs) == {"overlap_weight": 2, "block_size": 32}  # as written
    # Other policies take no knobs: whatever is written stays as written, unchecked.
    other = parse(with_an_engine(text.replace('"kv_aware"', '"least_loaded"') + 'colour = "red"'))
    assert other.frontend.routing.kv_aware == KvAwareKnobs()
    assert other.frontend.routing.knobs["colour"] == "red"


# -- tracing ---------------------------------------------------------------------------

TRACING = FRONTEND + "[frontend.tracing]\n"


def test_tracing_is_off_unless_an_endpoint_is_named() -> None:
    tracing = parse(with_an_engine(FRONTEND)).frontend.tracing
    assert tracing.otlp_endpoint is None
    assert (tracing.service_name, tracing.sample_ratio) == ("direct-frontend", 1.0)
    text = TRACING + 'otlp_endpoint = "http://127.0.0.1:4318/v1/traces"\nsample_ratio = 0.25\n'
    tracing = parse(with_an_engine(text)).frontend.tracing
    assert tracing.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert tracing.sample_ratio == 0.25


def test_tracing_endpoint_and_ratio_are_checked() -> None:
    assert problems(with_an_engine(
        TRACING + 'otlp_endpoint = "grpc://127.0.0.1:4317"\nsample_ratio = 1.5\n'
    )) == [
        "fleet.toml:5: frontend.tracing.otlp_endpoint: 'grpc://127.0.0.1:4317' is not an"
        " http:// or https:// URL",
        "fleet.toml:6: frontend.tracing.sample_ratio: must be between 0 and 1, got 1.5",
    ]


def test_tracing_without_the_extra_installed_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # as if `pip install direct-frontend` had run without the [tracing] extra
    for name in ("opentelemetry.sdk.trace",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        monkeypatch.setitem(sys.modules, name, None)
    text = TRACING + 'otlp_endpoint = "http://127.0.0.1:4318/v1/traces"\n'
    assert only_problem(with_an_engine(text)) == (
        "fleet.toml:5: frontend.tracing.otlp_endpoint: tracing needs the OpenTelemetry"
        " packages: pip install 'direct-frontend[tracing]'"
    )

"""``[[model]]`` tables: what they resolve to, every error with its line, engines' models."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineInfo
from direct_frontend.fleet import FleetError, describe_fleet, parse_fleet, to_jsonable
from direct_frontend.fleet.diff import diff_fleets
from direct_frontend.fleet.models import engine_model
from direct_frontend.fleet.schema import FleetConfig

SOURCE = Path("/srv/fleet/fleet.toml")

TWO_MODELS = textwrap.dedent("""\
    [frontend]
    tokenizer = "base-tok"

    [[model]]
    name = "chat"
    aliases = ["assistant"]
    chat_template = "chat.jinja"
    context_length = 8192
    owned_by = "team-a"
    tool_parser = "hermes"
    reasoning_parser = "deepseek_r1"
    max_adapters_per_engine = 2
    [model.sampling]
    temperature = 0.7
    max_tokens = 256
    thinking_token_budget = 4096
    [model.sampling.effort_budgets]
    low = 512
    high = 16384
    [model.routing]
    policy = "least_loaded"
    [model.limits]
    max_in_flight = 8
    [[model.adapter]]
    name = "chat-sql"
    path = "/adapters/sql"

    [[model]]
    name = "coder"
    tokenizer = "coder-tok"

    [[engine]]
    url = "grpc://10.0.0.1:1"
    kind = "sglang"
    model = "assistant"

    [[engine]]
    url = "grpc://10.0.0.2:1"
    kind = "vllm"
    """)


def parse(text: str) -> FleetConfig:
    return parse_fleet(text, SOURCE)


def problems(text: str) -> list[str]:
    with pytest.raises(FleetError) as caught:
        parse(text)
    return str(caught.value).splitlines()


def test_model_tables_resolve_with_their_defaults() -> None:
    fleet = parse(TWO_MODELS)
    chat, coder = fleet.models
    assert chat.names == ("chat", "assistant")
    assert chat.tokenizer == SOURCE.parent / "base-tok"  # [frontend]'s, relative to the file
    assert chat.chat_template == SOURCE.parent / "chat.jinja"
    assert (chat.context_length, chat.owned_by, chat.tool_parser) == (8192, "team-a", "hermes")
    assert chat.sampling.temperature == 0.7 and chat.sampling.max_tokens == 256
    assert chat.sampling.thinking_token_budget == 4096
    budgets = chat.sampling.effort_budgets
    assert (budgets.of("low"), budgets.of("high"), budgets.of("medium")) == (512, 16384, None)
    assert budgets.of("extreme") is None and budgets.of(None) is None
    assert chat.routing.policy == "least_loaded" and chat.limits.max_in_flight == 8
    assert [(a.name, a.path) for a in chat.adapters] == [("chat-sql", "/adapters/sql")]
    assert coder.tokenizer == SOURCE.parent / "coder-tok"
    assert coder.routing == fleet.frontend.routing and coder.limits == fleet.frontend.limits
    assert fleet.frontend.served_model_name == "chat"  # the first model's
    assert fleet.engine_model(fleet.engines[0]) is chat
    assert fleet.engine_model(fleet.engines[1]) is None  # discovery decides


def test_model_media_tables_resolve() -> None:
    fleet = parse(TWO_MODELS.replace('tokenizer = "coder-tok"', 'tokenizer = "coder-tok"\n'
                                     '[model.media]\n'
                                     'allowed_networks = ["127.0.0.1", "fd00::/8"]\n'
                                     'allowed_hosts = ["Images.Example.com"]\nfetch = false'))
    media = fleet.models[1].media
    assert media.allowed_networks == ("127.0.0.1/32", "fd00::/8")
    assert media.allowed_hosts == ("images.example.com",) and media.fetch is False
    assert media.images and fleet.models[0].media.allowed_networks == ()


def test_a_file_without_model_tables_is_a_fleet_of_one() -> None:
    fleet = parse('[frontend]\nserved_model_name = "demo"\ntokenizer = "t"\n'
                  '[[engine]]\nurl = "grpc://h:1"\nkind = "vllm"\n')
    (model,) = fleet.models
    assert model.implicit and model.name == "demo" and model.routing == fleet.frontend.routing
    assert fleet.engine_model(fleet.engines[0]) is model
    assert "model[1] demo (the one model [frontend] describes)" in describe_fleet(fleet)


def test_check_shows_every_resolved_model() -> None:
    text = describe_fleet(parse(TWO_MODELS))
    assert "model[1] chat" in text and "model[2] coder" in text
    assert "chat-sql (/adapters/sql)" in text
    assert "temperature = 0.7, max_tokens = 256, thinking_token_budget = 4096, " \
           "effort_budgets.high = 16384, effort_budgets.low = 512" in text


@pytest.mark.parametrize(("table", "expected"), [
    ('name = "x"\naliases = "y"', "fleet.toml:8: model[1].aliases: expected an array of strings"),
    ('name = "x"\ncontext_length = 0', "fleet.toml:8: model[1].context_length: must be at least 1"),
    ('name = "x"\n[model.sampling]\ntemperature = 3', "fleet.toml:9: model[1].sampling.temperature:"
     " must be between 0 and 2, got 3"),
    ('name = "x"\ncolour = 1', "fleet.toml:8: model[1].colour: unknown key"),
    ('name = "x"\n[model.sampling.effort_budgets]\nlow = -1',
     "fleet.toml:9: model[1].sampling.effort_budgets.low: must be at least 0"),
    ('name = "x"\n[model.sampling.effort_budgets]\nextreme = 9',
     "fleet.toml:9: model[1].sampling.effort_budgets.extreme: unknown key"),
    ('aliases = ["y"]', "fleet.toml:6: model[1].name: required key is missing"),
    ('name = "x"\n[[model.adapter]]\npath = "/a"',
     "fleet.toml:8: model[1].adapter[1].name: required"),
    ('name = "x"\n[model.routing]\npolicy = "best"', "fleet.toml:9: model[1].routing.policy:"
     " 'best' is not a valid policy"),
    ('name = "x"\n[model.media]\nallowed_networks = ["10.0.0.0/8", "intranet"]',
     "fleet.toml:9: model[1].media.allowed_networks[2]: 'intranet' is not a network"),
    ('name = "x"\n[model.media]\nmax_images = 0', "fleet.toml:9: model[1].media.max_images:"
     " must be at least 1"),
    ('name = "x"\n[model.media]\nfetch = "yes"', "fleet.toml:9: model[1].media.fetch:"),
])
def test_bad_model_tables_name_line_and_field(table: str, expected: str) -> None:
    text = f'[frontend]\ntokenizer = "t"\n[[engine]]\nurl = "grpc://h:1"\nkind = "vllm"\n' \
           f"[[model]]\n{table}\n"
    found = [p.replace(str(SOURCE), "fleet.toml") for p in problems(text)]
    assert any(p.startswith(expected) for p in found), found


def test_names_are_unique_across_models_aliases_and_adapters() -> None:
    text = TWO_MODELS.replace('name = "coder"', 'name = "coder"\naliases = ["chat-sql"]')
    (problem,) = problems(text)
    assert problem.endswith("model[2].aliases[1]: 'chat-sql' is already used by model[1]")


def test_engine_model_keys_must_name_a_model() -> None:
    text = TWO_MODELS.replace('model = "assistant"', 'model = "writer"')
    (problem,) = problems(text)
    assert "engine[1].model: 'writer' names no [[model]] (models: chat, coder)" in problem


def test_engines_that_cannot_say_their_model_need_the_key() -> None:
    text = TWO_MODELS + '\n[[engine]]\nurl = "grpc://10.0.0.3:1"\nkind = "trtllm"\n' \
        '\n[[engine]]\nurl = "grpc://127.0.0.1:5"\nkind = "vllm"\nsimulate = true\n'
    found = problems(text)
    assert any("engine[3]: trtllm engines do not report their served model" in p for p in found)
    assert any("engine[4]: a simulated engine of a fleet of several models needs model" in p
               for p in found)


def test_a_tokenizer_is_needed_somewhere() -> None:
    text = '[[model]]\nname = "x"\n[[engine]]\nurl = "grpc://h:1"\nkind = "vllm"\n'
    (problem,) = problems(text)
    assert "model[1].tokenizer: required key is missing (there is no frontend.tokenizer" in problem


def test_frontend_served_model_name_must_name_a_model() -> None:
    text = TWO_MODELS.replace('[frontend]\n', '[frontend]\nserved_model_name = "other"\n')
    (problem,) = problems(text)
    assert "frontend.served_model_name: 'other' names no [[model]]" in problem


def test_kv_aware_models_share_one_block_size() -> None:
    text = TWO_MODELS.replace('policy = "least_loaded"',
                              'policy = "kv_aware"\n[model.routing.knobs]\nblock_size = 32')
    text = text.replace('tokenizer = "coder-tok"', 'tokenizer = "coder-tok"\n[model.routing]\n'
                        'policy = "kv_aware"')
    (problem,) = problems(text)
    assert "model[2].routing.knobs.block_size: must be model[1]'s 32" in problem


def test_reload_diff_names_model_changes() -> None:
    old = parse(TWO_MODELS)
    new = parse(TWO_MODELS.replace("temperature = 0.7", "temperature = 0.2")
                + '\n[[model]]\nname = "extra"\n')
    diff = diff_fleets(old, new)
    assert diff.models_added == ("extra",)
    assert [(c.name, c.fields) for c in diff.models_changed] == [
        ("chat", ("sampling.temperature",))
    ]
    assert "+ model extra (serves once an engine of it joins)" in diff.lines()
    assert to_jsonable(new)["models"][2]["name"] == "extra"  # type: ignore[index]


# -- which model a joining engine serves --------------------------------------------------


def info(name: str, known: bool = True) -> EngineInfo:
    return EngineInfo(served_model_name=name, served_name_known=known)


def test_discovery_joins_an_engine_to_the_model_it_reports() -> None:
    fleet = parse(TWO_MODELS)
    chat, coder = fleet.models
    first, second = fleet.engines
    assert engine_model(second, info("coder"), fleet.models) is coder
    assert engine_model(second, info("assistant"), fleet.models) is chat  # an alias
    assert engine_model(first, info("chat"), fleet.models) is chat
    assert engine_model(first, info("/models/x", known=False), fleet.models) is chat


def test_an_engine_disagreeing_with_the_file_is_refused_with_the_reason() -> None:
    fleet = parse(TWO_MODELS)
    first, second = fleet.engines
    assert engine_model(first, info("coder"), fleet.models) == (
        "discovery reports model 'coder' but the fleet file says model = 'assistant'"
    )
    assert engine_model(second, info("writer"), fleet.models) == (
        "serves model 'writer', which no [[model]] of the fleet names (chat, coder)"
    )
    assert "does not report its model" in str(
        engine_model(second, info("/m", known=False), fleet.models)
    )

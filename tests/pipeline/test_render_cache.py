"""A conversation's next turn renders its new messages only, and its prompt is exactly the
whole render's: checked turn after turn (and on a branch, with the tools, the variables and
the generation prompt changing between turns) over real chat templates' shapes, those the
split applies to and those it must leave whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.openai.types import ChatRequest
from direct_frontend.pipeline.render_cache import TurnCache, Turns, render_turns
from direct_frontend.pipeline.tokenizing import function_dict, message_dict
from direct_frontend.text.model_dir import ChatTemplateError, TextModel, _new_environment
from direct_frontend.text.template_split import split_template

from .test_incremental import LLAMA3_LIKE, QWEN3_LIKE, TEXT

# Qwen2.5's tool results: consecutive ones share one user turn, so a result's piece reads
# its neighbours (and the last one's changes once another follows): what an iteration reads
# of the messages is noted, and the next turn takes the text only if those are the same.
QWEN25_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Every loop attribute the split shifts, a variable read in the loop, and a last message
# rendered differently (Mistral's habit of marking the end).
POSITIONS = (
    "{{- bos_token or '' }}{%- if messages[0].role == 'system' %}[SYS]{%- endif %}"
    "{%- for m in messages %}"
    "{{- loop.index ~ '/' ~ loop.index0 ~ (' first' if loop.first else '') }}"
    "{%- if loop.last %}{{- ' LAST' if add_generation_prompt else ' last' }}{%- endif %}"
    "{{- ' [' + m.role + '] ' + (m.content or '') }}"
    "{%- if flag is defined and flag %}{{- ' +flag' }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{- ' call ' ~ loop.index ~ ' ' }}"
    "{{- c.function | tojson }}{%- endfor %}"
    "{%- if tools %}{{- ' (tools)' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt and messages[-1].role != 'assistant' %}[GEN]{%- endif %}"
)
# Mistral's alternation check: the template refuses some conversations.
ALTERNATING = (
    "{%- for m in messages %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 1) %}"
    "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}"
    "{{- '[' + m.role + ']' + (m.content or '') }}{%- endfor %}"
)
# A first line counting the messages: the loop splits, the text before it does not repeat.
COUNTING = (
    "{{- (messages | length | string) + ' messages\\n' }}"
    "{%- for m in messages %}{{- m.role + ': ' + (m.content or '') + '\\n' }}{%- endfor %}"
)
# Names set in an iteration (read before they are set too: each iteration starts afresh).
SETS_IN_LOOP = (
    "{%- for m in messages %}{{- c or '' }}{%- if m.role == 'user' %}"
    "{%- set c = '(after a user) ' %}{%- endif %}{%- set text = m.content or '' %}"
    "{%- for call in m.tool_calls or [] %}{%- set text = text + call.function.name %}"
    "{%- endfor %}{{- m.role + text }}{%- endfor %}"
)
# The number of messages read in the loop: it splits, but nothing is kept (each turn's text
# differs all along).
READS_ALL = (
    "{%- for m in messages %}{{- loop.index ~ '/' ~ (messages | length) ~ ' ' }}"
    "{{- m.role + (m.content or '') + '\\n' }}{%- endfor %}"
)
# Shapes the split must leave whole: a namespace set in the loop, the previous item, and
# Llama 3's own template (its loop goes over a variable set to the messages first).
NAMESPACE = (
    "{%- for m in messages %}{%- set ns = namespace(text=m.content or '') %}"
    "{%- set ns.text = ns.text + '!' %}{{- ns.text }}{%- endfor %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
PREVIOUS = (
    "{%- for m in messages %}{%- if loop.previtem and loop.previtem.role == m.role %}+"
    "{%- endif %}{{- m.role + (m.content or '') }}{%- endfor %}"
)
SPLIT = {"demo": True, "llama3_like": True, "positions": True, "alternating": True,
         "counting": True, "sets_in_loop": True, "qwen25": True, "reads_all": True,
         "llama3": True, "qwen3": False, "namespace": False, "previous": False}
#: the split templates whose next turn takes the last one's text
KEEPS = {name for name, splits in SPLIT.items() if splits} - {"reads_all"}
SOURCES = {"llama3_like": LLAMA3_LIKE, "positions": POSITIONS, "alternating": ALTERNATING,
           "counting": COUNTING, "sets_in_loop": SETS_IN_LOOP, "qwen25": QWEN25_LIKE,
           "reads_all": READS_ALL, "llama3": LLAMA3, "qwen3": QWEN3_LIKE,
           "namespace": NAMESPACE, "previous": PREVIOUS}


@pytest.fixture(scope="module")
def models(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TextModel]:
    out = {"demo": TextModel.load(model_dir)}
    where = tmp_path_factory.mktemp("templates")
    for name, source in SOURCES.items():
        (where / f"{name}.jinja").write_text(source)
        out[name] = TextModel.load(model_dir, chat_template=where / f"{name}.jinja")
    return out


def test_the_templates_that_split_are_those_proven(models: dict[str, TextModel]) -> None:
    assert {name: model.split_template(None) is not None
            for name, model in models.items()} == SPLIT
    demo = models["demo"].split_template(None)
    assert demo is not None and demo.edges_by_first  # messages[0] only, before its loop
    counting = models["counting"].split_template(None)
    assert counting is not None and not counting.edges_by_first


@pytest.mark.parametrize(("source", "splits"), [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", True),
    ("{% set a = messages %}{% for m in a %}{{ m.content }}{% endfor %}", True),
    ("{% for m in a %}{{ m.content }}{% endfor %}{% set a = messages %}", False),  # after
    ("{% set a = messages %}{% for m in a %}{{ m.content }}{% endfor %}{{ a | length }}",
     False),  # the alias read outside the loop
    ("{% set a = messages %}{% set a = messages %}{% for m in a %}{% endfor %}", False),
    ("{% set x = 1 %}{% for m in messages %}{{ x }}{% endfor %}", False),  # a set outside
    ("{% if 1 %}{% set x = 1 %}{% endif %}{% for m in messages %}{% endfor %}", False),
    ("{% for m in messages %}{{ m }}{% endfor %}{% for m in messages %}{% endfor %}", False),
    ("{% for m in messages if m.role != 'system' %}{{ m }}{% endfor %}", False),
    ("{% for m in messages %}{{ m }}{% else %}none{% endfor %}", False),
    ("{% for m in messages %}{% if m %}{% break %}{% endif %}{% endfor %}", False),
    ("{% for m in messages %}{% for c in m.c %}{% break %}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{{ loop.length }}{% endfor %}", False),
    ("{% for m in messages %}{{ loop.nextitem }}{% endfor %}", False),
    ("{% for m in messages %}{{ loop }}{% endfor %}", False),
    ("{% for m in messages %}{{ messages[loop.index0 + 1] }}{% endfor %}", True),  # noted
    ("{% set a = messages %}{% for m in a %}{{ a[loop.index0] }}{% endfor %}", True),
    ("{% for m in messages %}{% set messages = 1 %}{% endfor %}", False),
    ("{% for m in messages %}{{ __df_all }}{% endfor %}", False),  # a name of ours
    ("{% for m in messages %}{% set loop = 1 %}{% endfor %}", False),
    ("{% for m in messages %}{% macro f() %}{% endmacro %}{% endfor %}", False),
    ("{% for m in messages %}{% include 'x' %}{% endfor %}", False),
    ("{% if messages %}{% for m in messages %}{% endfor %}{% endif %}", False),  # not on top
])
def test_which_shapes_split(source: str, splits: bool) -> None:
    env = _new_environment()
    assert (split_template(env, source) is not None) is splits


@st.composite
def conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A system prompt, then users, assistants (some calling a tool) and tool results."""
    out: list[dict[str, Any]] = [{"role": "system", "content": draw(TEXT)}]
    for i in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["user", "assistant", "tool"]))
        message: dict[str, Any] = {"role": kind, "content": draw(TEXT)}
        if kind == "assistant" and draw(st.booleans()):
            message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
                "name": "read", "arguments": json.dumps({"path": draw(TEXT)})}}]
        if kind == "tool":
            message["tool_call_id"] = f"c{i}"
        out.append(message)
    return out


TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]
#: what may change between turns: tools offered, a template variable, the generation prompt
SETTINGS = st.tuples(st.booleans(), st.sampled_from([None, {"flag": True}, {"flag": False}]),
                     st.booleans())


def _request(messages: list[dict[str, Any]], tools: bool, extra: dict[str, Any] | None
             ) -> ChatRequest:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools:
        body["tools"] = TOOLS
    if extra is not None:
        body["chat_template_kwargs"] = extra
    return parse_chat_request(json.dumps(body).encode())


def _both(model: TextModel, cache: TurnCache, request: ChatRequest, generation: bool
          ) -> tuple[str, str]:
    """(the whole render, the incremental one); each a ChatTemplateError's text if it fails."""
    tools = ([{"type": t.type, "function": function_dict(t)} for t in request.tools]
             if request.offers_tools else None)
    out = []
    try:
        out.append(model.render_chat([message_dict(m) for m in request.messages],
                                     add_generation_prompt=generation, tools=tools,
                                     extra=request.chat_template_kwargs))
    except ChatTemplateError as exc:
        out.append(f"error: {exc}")
    split = model.split_template(tools)
    if split is None:
        return out[0], out[0]
    try:
        out.append(render_turns(cache, model, split, request.messages, message_dict, tools,
                                request.tools if tools else (), request.chat_template_kwargs,
                                generation))
    except ChatTemplateError as exc:
        out.append(f"error: {exc}")
    return out[0], out[1]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversation(), branch=conversation(), data=st.data())
def test_every_turn_renders_as_the_whole_template_does(
    models: dict[str, TextModel], messages: list[dict[str, Any]],
    branch: list[dict[str, Any]], data: st.DataObject,
) -> None:
    """Turn after turn, a branch off the middle, the same turns again (from the cache), and
    the last one with another last message: the prompt is the whole render's, or fails with
    the same error."""
    middle = len(messages) // 2 + 1
    steps = [messages[:k] for k in range(1, len(messages) + 1)]
    # a branch, the same turns again, and the last turn's last message replaced (a tool
    # result where there was none, say: the piece before it reads it in some templates)
    steps += [messages[:middle] + branch[1:], *steps, messages[:-1] + branch[-1:]]
    chosen = [data.draw(SETTINGS) for _ in steps]
    for name, model in models.items():
        cache = TurnCache()
        for step, (tools, extra, generation) in zip(steps, chosen, strict=True):
            whole, incremental = _both(model, cache, _request(step, tools, extra), generation)
            assert incremental == whole, name
        whole, incremental = _both(model, cache, _request(messages, *chosen[-1][:2]),
                                   chosen[-1][2])
        assert incremental == whole, name
        kept = not whole.startswith("error: ")
        hits = cache.hits
        tools, extra, generation = chosen[-1]
        nxt = [*messages, {"role": "user", "content": "next"}]
        whole, incremental = _both(model, cache, _request(nxt, tools, extra), generation)
        assert incremental == whole, name
        if name in KEEPS and kept:  # the next turn took the earlier ones' text
            assert cache.hits == hits + 1, name


def test_a_next_turn_renders_only_its_new_messages(models: dict[str, TextModel]) -> None:
    """The earlier messages' views are those kept, not made again; only the new ones are."""
    model = models["demo"]
    cache = TurnCache()
    base = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read."}]
    grown = [*base, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    viewed: list[str] = []

    def view(message: Any) -> dict[str, object]:
        viewed.append(message.role)
        return message_dict(message)

    split = model.split_template(None)
    assert split is not None
    for step in (base, grown):
        request = _request(step, False, None)
        prompt = render_turns(cache, model, split, request.messages, view, None, (), None, True)
        assert prompt == model.render_chat([message_dict(m) for m in request.messages])
    assert viewed == ["system", "user", "user", "assistant", "tool"]
    assert cache.hits == 1 and len(cache) == 1  # the turn it went on from left


def test_the_cache_keeps_its_budget() -> None:
    cache = TurnCache(max_bytes=4000)
    split: Any = object()
    for i in range(20):
        request = _request([{"role": "system", "content": f"s{i % 3}"},
                            {"role": "user", "content": "x" * 300 * (i % 4)},
                            {"role": "user", "content": "y"}], False, None)
        cache.put(Turns((split, (), None, True), request.messages[:2], 2, [],
                        ("t" * 400 * (i % 4),), 400 * (i % 4), "", ""))
        assert cache.size <= 4000
        assert cache.size == sum(e.cost for e in cache.kept())


def test_conversations_sharing_a_system_prompt_keep_their_own_turns(
        models: dict[str, TextModel]) -> None:
    """More conversations than an entry list holds share the system prompt: each one's next
    turn still finds its own (they differ from their first request on)."""
    model = models["demo"]
    split = model.split_template(None)
    assert split is not None
    cache = TurnCache()
    system = {"role": "system", "content": "You are a coding agent. " * 100}
    turns = [[system, {"role": "user", "content": f"Task {i}"}] for i in range(20)]
    for _ in range(3):
        for messages in turns:
            messages += [{"role": "assistant", "content": "Reading."},
                         {"role": "user", "content": "Go on."}]
            request = _request(messages, False, None)
            prompt = render_turns(cache, model, split, request.messages, message_dict, None,
                                  (), None, True)
            assert prompt == model.render_chat([message_dict(m) for m in request.messages])
    assert cache.misses == 20 and cache.hits == 40


@pytest.mark.parametrize("source", [
    # an inner loop's ``else`` and filter read the message loop's ``loop``; a ``break`` in
    # its ``else`` breaks the message loop
    "{% for m in messages %}{% for x in [] %}{% else %}<{{ loop.index0 }}>{% endfor %}"
    "{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% for x in [1, 2] if loop.last %}{{ x }}{% endfor %}|"
    "{% endfor %}",
    "{% for m in messages %}{{ loop.index0 }}{% for x in [] %}{% else %}{% break %}"
    "{% endfor %}{% endfor %}",
    # an alias set after the loop is undefined inside it
    "{% for m in messages %}{{ x }}{{ m.content }}{% endfor %}{% set x = messages %}",
    # a template variable Python calls equal to another (1 == 1.0 == True) renders as itself
    "{{ flag }}{% for m in messages %}{{ m.content }}{% endfor %}{{ flag }}",
])
def test_shapes_the_proof_must_see_render_as_the_whole_template(
    model_dir: Path, tmp_path: Path, source: str,
) -> None:
    (tmp_path / "t.jinja").write_text(source)
    model = TextModel.load(model_dir, chat_template=tmp_path / "t.jinja")
    cache = TurnCache()
    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
             {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
             {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
    for k, flag in zip(range(2, len(turns) + 1), [1, True, 1.0, 1, True], strict=True):
        whole, incremental = _both(model, cache, _request(turns[:k], False, {"flag": flag}),
                                   True)
        assert incremental == whole, (k, flag)


def test_the_same_conversation_again_keeps_as_many_pieces(models: dict[str, TextModel]) -> None:
    """A conversation sent again as it was (a retry, another choice, a count of its tokens)
    renders nothing new: its kept entry stays as it was, not one empty piece longer each
    time (pieces the budget does not count, copied and joined on every later turn)."""
    model = models["demo"]
    split = model.split_template(None)
    assert split is not None
    cache = TurnCache()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read."},
                {"role": "assistant", "content": "Done."}, {"role": "user", "content": "More."}]
    request = _request(messages, False, None)
    for _ in range(50):
        prompt = render_turns(cache, model, split, request.messages, message_dict, None, (),
                              None, True)
        assert prompt == model.render_chat([message_dict(m) for m in request.messages])
    (kept,) = cache.kept()
    assert len(kept.pieces) <= 2, len(kept.pieces)

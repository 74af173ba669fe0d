"""End to end: the Conversations API and ``conversation`` on ``/v1/responses``, official client.

The daemon keeps its state in a SQLite file (``backend = "sqlite"``), and
has two API keys: each key's conversations are its own, and the other's are
OpenAI's 404.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.daemon import Daemon, running_daemon, wait_for
from tests.support.http import http, sdk_http
from tests.support.models import FAST, engine_table, frontend_table

KEYS = ("sk-one", "sk-two")


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    directory = tmp_path_factory.mktemp("conversations")
    extra = textwrap.dedent(f"""\
        [frontend.auth]
        api_keys = ["{KEYS[0]}", "{KEYS[1]}"]

        [frontend.responses]
        backend = "sqlite"
        path = "{directory / 'state' / 'responses.db'}"

        [[model]]
        name = "demo"
        """)
    text = frontend_table(model_dir, extra) + "\n" + engine_table("sim", "vllm", "demo", FAST)
    with running_daemon(directory, text) as daemon:
        daemon.wait_serving(1)
        yield daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEYS[0], max_retries=0,
                       http_client=sdk_http()) as c:
        yield c


@pytest.fixture
def other(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEYS[1], max_retries=0,
                       http_client=sdk_http()) as c:
        yield c


def test_a_conversation_is_created_read_updated_and_deleted(client: openai.OpenAI) -> None:
    made = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello!"}],
        metadata={"topic": "demo"})
    assert made.id.startswith("conv_") and made.object == "conversation"
    assert made.metadata == {"topic": "demo"}
    got = client.conversations.retrieve(made.id)
    assert got.id == made.id and got.created_at == made.created_at
    updated = client.conversations.update(made.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"}
    gone = client.conversations.delete(made.id)
    assert gone.deleted and gone.id == made.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(made.id)


def test_items_are_added_paged_read_and_deleted(client: openai.OpenAI) -> None:
    made = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": f"m{i}"} for i in range(3)])
    added = client.conversations.items.create(
        made.id, items=[{"type": "message", "role": "assistant", "content": "m3"},
                        {"type": "message", "role": "user", "content": "m4"}])
    assert len(added.data) == 2
    first = client.conversations.items.list(made.id, limit=2, order="asc")
    texts = [item.content[0].text for item in first.data]  # type: ignore[union-attr]
    assert texts == ["m0", "m1"] and first.has_more
    every = list(client.conversations.items.list(made.id, limit=2, order="asc"))
    assert [i.content[0].text for i in every] == [f"m{i}" for i in range(5)]  # type: ignore[union-attr]
    newest = client.conversations.items.list(made.id, limit=1)
    assert newest.data[0].content[0].text == "m4"  # type: ignore[union-attr]
    one = client.conversations.items.retrieve(first.data[1].id, conversation_id=made.id)
    assert one.id == first.data[1].id
    after = client.conversations.items.delete(first.data[1].id, conversation_id=made.id)
    assert after.id == made.id and after.object == "conversation"
    left = list(client.conversations.items.list(made.id, order="asc"))
    assert [i.content[0].text for i in left] == ["m0", "m2", "m3", "m4"]  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(first.data[1].id, conversation_id=made.id)


def test_a_response_continues_a_conversation_and_adds_its_turn(client: openai.OpenAI) -> None:
    made = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    first = client.responses.create(model="demo", input="What is my name?",
                                    conversation=made.id, max_output_tokens=4)
    assert first.conversation is not None and first.conversation.id == made.id
    items = list(client.conversations.items.list(made.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "message"]
    assert items[2].id == first.output[0].id  # the response's output, in order
    second = client.responses.create(model="demo", input="Again?", conversation={"id": made.id},
                                     max_output_tokens=4, stream=False, store=False)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # it read the history
    assert len(list(client.conversations.items.list(made.id))) == 5  # store: false adds too


def test_a_streamed_response_adds_its_turn_before_it_ends(client: openai.OpenAI) -> None:
    made = client.conversations.create()
    events = list(client.responses.create(model="demo", input="hi", conversation=made.id,
                                          max_output_tokens=3, stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.store
    items = list(client.conversations.items.list(made.id, order="asc"))
    assert [i.id for i in items][-1] == final.output[0].id and len(items) == 2


def test_a_background_response_adds_its_turn_before_it_is_seen_ended(
        client: openai.OpenAI) -> None:
    made = client.conversations.create()
    started = client.responses.create(model="demo", input="hi", conversation=made.id,
                                      background=True, max_output_tokens=3)
    wait_for(lambda: client.responses.retrieve(started.id).status not in ("queued",
                                                                          "in_progress"),
             10, "the background response to end")
    ended = client.responses.retrieve(started.id)
    items = [i.id for i in client.conversations.items.list(made.id, order="asc")]
    assert items[-1] == ended.output[0].id and len(items) == 2


def test_conversation_and_previous_response_id_do_not_mix(client: openai.OpenAI) -> None:
    made = client.conversations.create()
    first = client.responses.create(model="demo", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="hi", conversation=made.id,
                                previous_response_id=first.id)
    assert caught.value.body["param"] == "conversation"  # type: ignore[index]


def test_another_keys_conversation_is_not_found(client: openai.OpenAI,
                                                other: openai.OpenAI) -> None:
    made = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "secret"}])
    item = next(iter(client.conversations.items.list(made.id)))
    for call in (
        lambda: other.conversations.retrieve(made.id),
        lambda: other.conversations.update(made.id, metadata={"a": "b"}),
        lambda: other.conversations.delete(made.id),
        lambda: other.conversations.items.list(made.id),
        lambda: other.conversations.items.create(
            made.id, items=[{"type": "message", "role": "user", "content": "x"}]),
        lambda: other.conversations.items.retrieve(item.id, conversation_id=made.id),
        lambda: other.conversations.items.delete(item.id, conversation_id=made.id),
        lambda: other.responses.create(model="demo", input="hi", conversation=made.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.conversations.retrieve(made.id).id == made.id  # untouched


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/v1/conversations", {"items": "no"}, "items"),
    ("POST", "/v1/conversations", {"items": [{"type": "message", "role": "x"}]},
     "items[0].role"),
    ("POST", "/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
    ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("GET", "/v1/conversations/{id}/items?limit=0", None, "limit"),
    ("GET", "/v1/conversations/{id}/items?order=up", None, "order"),
    ("GET", "/v1/conversations/{id}/items?after=nope", None, "after"),
    ("POST", "/v1/conversations/{id}", {}, "metadata"),
    ("POST", "/v1/conversations/{id}/items", {}, "items"),
    ("POST", "/v1/conversations/{id}/items",
     {"items": [{"id": "msg_a", "role": "user", "content": "x"}] * 2}, "items"),
    ("POST", "/v1/responses", {"model": "demo", "input": "x", "conversation": 5},
     "conversation"),
])
def test_bad_input_is_a_400_naming_the_field(daemon: Daemon, client: openai.OpenAI,
                                             method: str, path: str, body: object,
                                             param: str) -> None:
    made = client.conversations.create()
    answer = http.request(method, daemon.url + path.replace("{id}", made.id), json=body,
                           headers={"authorization": f"Bearer {KEYS[0]}"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_conversation_nobody_made_is_a_404_everywhere(daemon: Daemon) -> None:
    auth = {"authorization": f"Bearer {KEYS[0]}"}
    for method, path in (("GET", "/v1/conversations/conv_x"),
                         ("GET", "/v1/conversations/conv_x/items"),
                         ("DELETE", "/v1/conversations/conv_x/items/msg_1")):
        assert http.request(method, daemon.url + path, headers=auth).status_code == 404
    answer = http.get(daemon.url + "/v1/conversations/conv_x/nothing", headers=auth)
    assert answer.status_code == 404


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "function_call", "name": "f"}], "items[0].call_id"),
    ([{"type": "web_search_call"}], "items[0].type"),
    ([{"role": "user", "content": [{"type": "input_image"}]}], "items[0].content[0].image_url"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "items[0].content[0].type"),
    ([{"id": "", "role": "user", "content": "x"}], "items"),
])
def test_an_item_a_request_could_not_read_is_refused_when_added(
        daemon: Daemon, client: openai.OpenAI, items: list[object], param: str) -> None:
    made = client.conversations.create()
    answer = http.post(f"{daemon.url}/v1/conversations/{made.id}/items", json={"items": items},
                        headers={"authorization": f"Bearer {KEYS[0]}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param

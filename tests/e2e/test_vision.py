"""Images end to end: the official clients send images to a vision model on simulated vLLM.

The fleet is the shipped example's shape (config/examples/vision.toml): the
demo vision model (Qwen2-VL layout), two simulated vLLM engines that check
the tensors' shapes and key their KV blocks by the images' hashes, KV-aware
routing, and an image server on loopback that the fleet allows.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from direct_frontend.text.demo_vision import BUNDLED_DIR as VISION_DIR
from tests.e2e.test_kv import metric
from tests.support.daemon import Daemon, free_port, running_daemon, wait_for
from tests.support.images import ImageServer, data_url, encoded, image_server, picture
from tests.support.models import openai_client


def vision_fleet(text_dir: Path) -> str:
    engines = "".join(textwrap.dedent(f"""
        [[engine]]
        name = "{name}"
        url = "grpc://127.0.0.1:{free_port()}"
        kind = "vllm"
        model = "{model}"
        simulate = true
        kv_events = ["tcp://127.0.0.1:{free_port()}"]
        kv_replay = ["tcp://127.0.0.1:{free_port()}"]
        block_size = 16
        [engine.simulator]
        decode_us_per_token = 0
        prefill_us_per_token = 0
        eos_probability = 0.0
        """) for name, model in (("v1", "vision"), ("v2", "vision"), ("t1", "text")))
    return textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:0"
        max_body_bytes = 16777216

        [frontend.routing]
        policy = "kv_aware"

        [frontend.routing.knobs]
        block_size = 16

        [frontend.probe]
        interval_s = 0.2
        timeout_s = 1.0

        [[model]]
        name = "vision"
        tokenizer = "{VISION_DIR}"

        [model.media]
        allowed_networks = ["127.0.0.1/32"]
        max_images = 4

        [[model]]
        name = "text"
        tokenizer = "{text_dir}"
        """) + engines


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as server:
        yield server


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("vision"), vision_fleet(model_dir)) as daemon:
        daemon.wait_serving(3)
        wait_for(lambda: len(daemon.supervisor.kv.live) == 3, what="three KV subscriptions")
        yield daemon


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts: dict[str, Any], text: str = "What is in the picture?") -> list[Any]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_the_openai_client_sends_images_streaming_and_not(daemon: Daemon,
                                                          server: ImageServer) -> None:
    png = encoded(picture(64, 48, seed=1))
    url = server.serve("/one.png", png)
    with openai_client(daemon) as client:
        done = client.chat.completions.create(
            model="vision", messages=ask(image_part(data_url(png))), max_tokens=5)
        assert done.choices[0].message.content and done.usage is not None
        # 64×48 → 56×56 (multiples of 28 within [56², 28²·64]) → 4×4 patches → 4 tokens
        text_only = client.chat.completions.create(
            model="vision", messages=ask(), max_tokens=1).usage
        assert text_only is not None
        assert done.usage.prompt_tokens == text_only.prompt_tokens + 2 + 4  # start/end + pads
        chunks = list(client.chat.completions.create(
            model="vision", messages=ask(image_part(url), image_part(data_url(png))),
            max_tokens=5, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == text_only.prompt_tokens + 2 * 6
    assert server.requests.count("/one.png") == 1


def test_the_anthropic_client_sends_images_streaming_and_not(daemon: Daemon,
                                                             server: ImageServer) -> None:
    import base64

    png = encoded(picture(100, 60, seed=2))
    url = server.serve("/two.png", png)
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as client:
        content: list[Any] = [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "image", "source": {"type": "url", "url": url}},
            {"type": "text", "text": "Compare them."},
        ]
        message = client.messages.create(model="vision", max_tokens=5,
                                         messages=[{"role": "user", "content": content}])
        assert message.content and message.usage.input_tokens > 2 * 8
        with client.messages.stream(model="vision", max_tokens=5,
                                    messages=[{"role": "user", "content": content}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.usage.input_tokens + (
            final.usage.cache_read_input_tokens or 0) == message.usage.input_tokens + (
            message.usage.cache_read_input_tokens or 0)
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="vision", max_tokens=5, messages=[{
                "role": "user", "content": [{"type": "image", "source": {
                    "type": "url", "url": "http://10.1.2.3/x.png"}}]}])
        assert "messages.0.content.0" in refused.value.message


def test_responses_take_input_images(daemon: Daemon) -> None:
    png = encoded(picture(30, 30, mode="RGBA", seed=3))
    with openai_client(daemon) as client:
        response = client.responses.create(model="vision", max_output_tokens=5, input=[{
            "role": "user", "content": [
                {"type": "input_image", "image_url": data_url(png), "detail": "low"},
                {"type": "input_text", "text": "Describe it."}]}])
        assert response.output_text
        follow = client.responses.create(model="vision", max_output_tokens=5, input="More.",
                                         previous_response_id=response.id)
        assert follow.usage is not None and response.usage is not None
        assert follow.usage.input_tokens > response.usage.input_tokens  # the image came along


def test_refusals_name_the_part(daemon: Daemon, server: ImageServer) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=30)

    png = encoded(picture(seed=4))
    cases = [
        ({"model": "text", "messages": ask(image_part(data_url(png)))},
         "messages[0].content[0].type", "does not take images"),
        ({"model": "vision", "messages": ask(image_part("http://169.254.169.254/latest"))},
         "messages[0].content[0].image_url", "link-local"),
        ({"model": "vision", "messages": ask(image_part(data_url(b"not an image")))},
         "messages[0].content[0].image_url", "not a PNG"),
        ({"model": "vision", "messages": ask(image_part(server.url("/missing.png")))},
         "messages[0].content[0].image_url", "HTTP 404"),
        ({"model": "vision", "messages": ask(*[image_part(data_url(png))] * 5)},
         "messages[0].content[4].image_url", "At most 4 images"),
        ({"model": "vision", "messages": ask(image_part("file:///etc/passwd"))},
         "messages[0].content[0].image_url", "not 'file:'"),
    ]
    for body, param, words in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_a_repeated_image_prefix_is_predicted_and_routed_like_text(daemon: Daemon) -> None:
    """The image's hash keys the blocks its tokens fill: the same image is a cache hit where
    it lives, predicted as reported; another image of the same size (the same tokens) is not."""
    big = encoded(picture(224, 224, seed=5))  # 64 image tokens: 4 blocks of 16
    other = encoded(picture(224, 224, seed=6))
    sims = daemon.supervisor.simulators
    with openai_client(daemon) as client:
        def send(png: bytes, question: str) -> int:
            usage = client.chat.completions.create(
                model="vision", messages=ask(image_part(data_url(png)), text=question),
                max_tokens=2).usage
            assert usage is not None and usage.prompt_tokens_details is not None
            return usage.prompt_tokens_details.cached_tokens or 0

        before_predicted = metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total")
        before_reported = metric(daemon, "direct_frontend_kv_reported_cached_tokens_total")
        counts = {n: sims[n].stats.requests for n in ("v1", "v2")}
        assert send(big, "First question about it?") == 0
        holder = next(n for n in ("v1", "v2") if sims[n].stats.requests > counts[n])
        counts = {n: sims[n].stats.requests for n in ("v1", "v2")}
        wait_for(lambda: len(daemon.supervisor.kv.index) >= 4, what="the image's blocks")
        cached = send(big, "A second question about it?")
        assert cached >= 64  # the image's blocks (and the turn's opening before it)
        assert sims[holder].stats.requests == counts[holder] + 1
        assert send(other, "A second question about it?") < 16  # same tokens, another image
        predicted = metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total")
        reported = metric(daemon, "direct_frontend_kv_reported_cached_tokens_total")
        assert predicted - before_predicted == reported - before_reported >= 64


def test_a_migrated_stream_carries_its_images(daemon: Daemon) -> None:
    """Each engine fails its next stream after 3 tokens: the stream moves twice, each engine
    getting the image again with the prompt and the tokens so far, and the client sees one
    whole answer. (Last in the module: it leaves the engines' faults used up.)"""
    from grpclib import Status

    from direct_frontend.simulator.faults import FaultPlan

    sims = daemon.supervisor.simulators
    images = sum(sims[n].stats.images for n in ("v1", "v2"))
    for name in ("v1", "v2"):
        sims[name].faults = FaultPlan(status=Status.UNAVAILABLE, status_after_tokens=3,
                                      only_request=1)
    png = encoded(picture(90, 60, seed=11))
    with openai_client(daemon) as client:
        chunks = list(client.chat.completions.create(
            model="vision", messages=ask(image_part(data_url(png))), max_tokens=12,
            stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert sum(sims[n].stats.images for n in ("v1", "v2")) - images == 3


def test_the_shipped_vision_example_answers_both_clients_as_it_is(
        tmp_path: Path, server: ImageServer) -> None:
    """config/examples/vision.toml on free ports, nothing else changed: the official clients
    send an image as a data URL and as a URL of an image server on loopback (which the file
    allows), streaming and not, and get answers."""
    import base64

    example = Path(__file__).resolve().parents[2] / "config" / "examples" / "vision.toml"
    text = example.read_text().replace("127.0.0.1:8000", "127.0.0.1:0")
    model = example.parent.parent / "demo-vision-model"
    text = text.replace('"../demo-vision-model"', f'"{model}"')
    for port in (30081, 30082, 30091, 30092):
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    png = encoded(picture(80, 60, seed=3))
    url = server.serve("/example.png", png)
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(2, timeout=20)
        with openai_client(daemon) as client:
            for part in (image_part(data_url(png)), image_part(url)):
                whole = client.chat.completions.create(model="vision", messages=ask(part),
                                                       max_tokens=4)
                assert whole.choices[0].message.content
                streamed = client.chat.completions.create(model="vision", messages=ask(part),
                                                          max_tokens=4, stream=True)
                assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as sdk:
            for source in ({"type": "base64", "media_type": "image/png",
                            "data": base64.b64encode(png).decode()}, {"type": "url", "url": url}):
                content: list[Any] = [{"type": "image", "source": source},
                                      {"type": "text", "text": "What is it?"}]
                message = sdk.messages.create(model="vision", max_tokens=4,
                                              messages=[{"role": "user", "content": content}])
                assert message.content
                with sdk.messages.stream(model="vision", max_tokens=4, messages=[
                        {"role": "user", "content": content}]) as stream:
                    assert "".join(stream.text_stream)
    assert server.requests.count("/example.png") == 4

"""The real-vLLM vision checks (``scripts/real_vllm.py --vision-only``): docs/real-vllm.md §14.

A tiny random Qwen2-VL (``make_tiny_qwen2_vl.py``, built offline around the demo
vision model's tokenizer and preprocessor config) on the stock engine, started
with the servicer's own media processor on (``SMG_VLLM_MM_PROCESSOR=inprocess``),
so one engine serves both paths:

- **equal outputs**: for images of several sizes and modes, the request the
  router builds (its preprocessing, its expanded prompt, ``MultimodalInputs``
  in the form the engine's discovery asks for) gives the same greedy tokens and
  the same prompt length as the engine's own processing of the same image and
  prompt (``media_refs``: a data URL, the unexpanded prompt);
- **KV with images**: through the frontend (``engine_processing = false``, so the
  router sends tensors and its hashes), the same image and prompt twice: the
  second is a prefix-cache hit, predicted = reported cached tokens, and another
  image of the same size (the same token ids) is not predicted as one.

The peer environment has no torchvision (docs/real-vllm.md §2), which vLLM's
Qwen2-VL module and transformers' video processor import; a ``sitecustomize``
written into the run directory and put on the engine's ``PYTHONPATH`` serves
the PIL image module in place of the torchvision one and a stand-in for the
video processor (the engine takes no video: ``--limit-mm-per-prompt``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # direct_frontend and tests.support of this checkout
BUILDER = Path(__file__).resolve().with_name("make_tiny_qwen2_vl.py")
DEMO = ROOT / "direct_frontend" / "text" / "demo-vision-model"
LIMITS = ("--limit-mm-per-prompt", '{"image": 4, "video": 0}')

SHIM = '''\
"""Written by scripts/real_vllm/vision.py for the engine's processes only (never shipped).

The peer environment has no torchvision. vLLM's Qwen2-VL module imports ``smart_resize`` from
transformers' torchvision image module: served here from the PIL one (the same function; the
PIL processor under the other's name). Qwen2-VL's processor wants a video processor, which
needs torchvision: a stand-in (the engine takes no video)."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _ImageLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        source = importlib.import_module(_PIL)
        module.__dict__.update({k: v for k, v in source.__dict__.items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = source.Qwen2VLImageProcessorPil
        module.__all__ = ["Qwen2VLImageProcessor", "smart_resize"]


class _VideoStub(dict):
    valid_kwargs = type("VideosKwargs", (), {"__annotations__": {}})
    model_input_names = []


def _patch_processing_utils(module):
    mixin = module.ProcessorMixin
    check = mixin.check_argument_for_proper_class

    def checked(self, argument_name, argument):
        if isinstance(argument, _VideoStub):
            return _VideoStub
        return check(self, argument_name, argument)

    mixin.check_argument_for_proper_class = checked


def _patch_video_auto(module):
    class _NoVideo:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return _VideoStub()

    module.AutoVideoProcessor = _NoVideo


_AFTER = {"transformers.processing_utils": _patch_processing_utils,
          "transformers.models.auto.video_processing_auto": _patch_video_auto}


class _Wrapped(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == _IMAGE:
            return importlib.util.spec_from_loader(name, _ImageLoader())
        patch = _AFTER.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Wrapped(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
'''


def _fingerprint() -> str:
    digest = hashlib.sha256(BUILDER.read_bytes())
    for path in sorted(DEMO.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def ensure_model(rv: ModuleType, cache: Path, logs: Path) -> Path:
    """The tiny Qwen2-VL, built once per builder and demo-model content."""
    out = cache / "tiny-qwen2-vl"
    marker = out / ".direct-frontend-model.json"
    want = _fingerprint()
    if marker.is_file() and json.loads(marker.read_text()).get("fingerprint") == want:
        return out
    rv.run_logged([str(rv.peer_python(cache)), str(BUILDER), str(DEMO), str(out)],
                  logs / "make-tiny-qwen2-vl.log")
    marker.write_text(json.dumps({"fingerprint": want}))
    return out


@dataclasses.dataclass
class Prepared:
    ids: tuple[int, ...]
    media: Any


def prepare(model: Path, image: bytes, question: str, *, raw: bool) -> Prepared:
    """The router's own walk for one image and a question: ids and payload."""
    import trio

    from direct_frontend.multimodal.policy import MediaPolicy
    from direct_frontend.multimodal.processors import load_processor
    from direct_frontend.openai.parse import parse_chat_request
    from direct_frontend.pipeline.media import MediaProfile, lists_content, media_prompt
    from direct_frontend.pipeline.preprocess import message_dict
    from direct_frontend.text.model_dir import TextModel
    from tests.support.images import data_url

    text_model = TextModel.load(model)
    processor = load_processor(model, text_model.token_to_id)
    profile = MediaProfile(processor, MediaPolicy(), list_content=lists_content(
        text_model.template_text))
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image, _media_type(image))}},
        {"type": "text", "text": question}]}]}
    request = parse_chat_request(json.dumps(body).encode())

    async def encode(text: str) -> list[int]:
        return text_model.encode(text)

    async def run() -> Any:
        return await media_prompt(request, text_model, profile,
                                  [message_dict(m) for m in request.messages], None, encode)

    _, ids, media = trio.run(run)
    return Prepared(ids, dataclasses.replace(media, raw_pixels=raw))


def _media_type(image: bytes) -> str:
    return "image/jpeg" if image.startswith(b"\xff\xd8") else "image/png"


def generate(client: Any, prepared: Prepared, rid: str, *, by_reference: bool) -> dict[str, Any]:
    """Greedy, 12 tokens, through our vLLM dialect; the reply's tokens and counts."""
    from direct_frontend.engines.dialects.vllm import VllmDialect
    from direct_frontend.engines.neutral import GenerateCall, SamplingOptions

    media = dataclasses.replace(prepared.media, ref_schemes=frozenset({"data"})
                                if by_reference else None)
    call = GenerateCall(rid, prepared.ids, SamplingOptions(max_tokens=12, temperature=0.0,
                                                           ignore_eos=True),
                        stream=False, media=media)
    ours = VllmDialect().generate(call).request
    request = client.pb.GenerateRequest.FromString(ours.SerializeToString())
    out: dict[str, Any] = {}
    for msg in client.stub.Generate(request, timeout=120):
        if msg.WhichOneof("response") == "complete":
            done = msg.complete
            out = {"tokens": list(done.output_ids), "prompt_tokens": done.prompt_tokens,
                   "cached_tokens": done.cached_tokens}
    return out


def images() -> list[tuple[str, bytes]]:
    from tests.support.images import encoded, picture

    return [("rgb 100x60", encoded(picture(100, 60, seed=1))),
            ("rgba 33x77", encoded(picture(33, 77, "RGBA", seed=2))),
            ("grey 224x224", encoded(picture(224, 224, "L", seed=3))),
            ("jpeg 300x200", encoded(picture(300, 200, seed=4), "JPEG"))]


def vision_run(rv: ModuleType, report: Any, cache: Path, run_dir: Path, args: Any) -> Any:
    """Start the engine on the tiny Qwen2-VL and run the checks; returns the engine."""
    t = time.monotonic()
    model = ensure_model(rv, cache, run_dir)
    report.timing("tiny Qwen2-VL", time.monotonic() - t, str(model))
    shim = run_dir / "vision-shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "SMG_VLLM_MM_PROCESSOR")}
    os.environ["PYTHONPATH"] = str(shim)
    os.environ["SMG_VLLM_MM_PROCESSOR"] = "inprocess"
    try:
        t = time.monotonic()
        engine = rv.start_engine(cache, model, run_dir, blocks=args.kv_blocks,
                                 timeout=args.start_timeout, tag="-vision", extra=LIMITS)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    client = rv.EngineClient(engine.address)
    engine.model_info = client.model_info()
    engine.server_info = client.server_info()
    info = engine.server_info
    raw = bool(info.mm_device_do_normalize)
    report.timing("vision engine start (launch -> SERVING)", time.monotonic() - t,
                  f"grpc {engine.address}, mm_processor {info.mm_processor!r}, "
                  f"schemes {info.mm_media_ref_schemes!r}, device normalize {raw}")

    def equal_outputs() -> str:
        rows = []
        for n, (name, png) in enumerate(images()):
            prepared = prepare(model, png, "What is in the picture?", raw=raw)
            ours = generate(client, prepared, f"vision-ours-{n}", by_reference=False)
            theirs = generate(client, prepared, f"vision-engine-{n}", by_reference=True)
            rv.expect(ours["prompt_tokens"] == theirs["prompt_tokens"] == len(prepared.ids),
                      f"{name}: prompt tokens ours {ours['prompt_tokens']}, the engine's "
                      f"{theirs['prompt_tokens']}, our ids {len(prepared.ids)}")
            rv.expect(ours["tokens"] == theirs["tokens"],
                      f"{name}: greedy tokens differ: ours {ours['tokens']}, the engine's "
                      f"{theirs['tokens']}")
            rows.append(f"{name}: {len(prepared.ids)} prompt tokens "
                        f"({prepared.media.placeholders[0][1]} image)")
        return "; ".join(rows) + f"; pixels sent {'raw uint8' if raw else 'normalised'}"

    report.check("vision: our preprocessed request = the engine's own processing (greedy)",
                 equal_outputs)

    served = engine.model_info.served_model_name

    def fleet_text(port: int, engine_processing: bool = False) -> str:
        block = info.block_size or rv.BLOCK_SIZE
        return textwrap.dedent(f"""\
            # Written by scripts/real_vllm.py --vision-only.
            [frontend]
            listen = "127.0.0.1:{port}"
            max_body_bytes = 16777216

            [frontend.routing]
            policy = "kv_aware"

            [frontend.routing.knobs]
            block_size = {block}

            [[model]]
            name = {rv.toml_str(served)}
            tokenizer = {rv.toml_str(str(model))}

            [model.media]
            # false: tensors and the router's hashes (predictable KV); true: references
            engine_processing = {"true" if engine_processing else "false"}

            [[engine]]
            name = "{rv.REAL_NAME}"
            url = "grpc://{engine.address}"
            kind = "vllm"
            kv_events = ["tcp://127.0.0.1:{engine.pub_ports[0]}"]
            kv_replay = ["tcp://127.0.0.1:{engine.replay_ports[0]}"]
            """)

    t = time.monotonic()
    frontend = rv.start_frontend(run_dir, engine, served, args.frontend_timeout, tag="-vision",
                                 fleet_text=fleet_text)
    report.timing("frontend start (run -> /ready)", time.monotonic() - t, str(frontend.fleet))
    try:
        kv_checks(rv, report, frontend, served)
        by_tensors = answer(rv, frontend, served)
    finally:
        report.timing("frontend stop", rv.stop_group(frontend.proc, "frontend", grace=15))
    t = time.monotonic()
    frontend = rv.start_frontend(run_dir, engine, served, args.frontend_timeout,
                                 tag="-vision-refs",
                                 fleet_text=lambda port: fleet_text(port, True))
    report.timing("frontend start, engine_processing = true", time.monotonic() - t,
                  str(frontend.fleet))
    try:
        def by_reference() -> str:
            offset = engine.log_size()
            got = answer(rv, frontend, served)
            log = engine.log_text(offset)
            rv.expect("media_refs=1" in log, "the engine's log shows no request with media_refs")
            rv.expect(got == by_tensors, f"through references {got}, through tensors "
                      f"{by_tensors}")
            return (f"the engine was sent a reference (media_refs=1 in its log); the same "
                    f"answer and prompt tokens ({got[1]}) as the router's tensors")

        report.check("vision: an engine with a media processor is sent references (discovered)",
                     by_reference)
    finally:
        report.timing("frontend stop", rv.stop_group(frontend.proc, "frontend", grace=15))
        client.close()
    return engine


def answer(rv: ModuleType, frontend: Any, served: str) -> tuple[str, int]:
    """A greedy answer about one image through the frontend, and its prompt tokens."""
    from tests.support.images import data_url, encoded, picture

    reply = rv.openai_client(frontend).chat.completions.create(
        model=served, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(encoded(picture(
                140, 112, seed=9)))}},
            {"type": "text", "text": "What is it?"}]}])
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


def kv_checks(rv: ModuleType, report: Any, frontend: Any, served: str) -> None:
    from tests.support.images import data_url, encoded, picture

    big = encoded(picture(224, 224, seed=7))  # 64 image tokens
    other = encoded(picture(224, 224, seed=8))
    client = rv.openai_client(frontend)

    def ask(png: bytes, question: str) -> Any:
        return client.chat.completions.create(
            model=served, max_tokens=4, temperature=0.0, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png)}},
                {"type": "text", "text": question}]}])

    def repeated_prefix() -> str:
        before = rv.kv_metrics(frontend)
        first = ask(big, "Describe the picture in a few words, please.")
        rv.expect(first.usage.prompt_tokens_details.cached_tokens == 0, "first: cached tokens "
                  f"{first.usage.prompt_tokens_details.cached_tokens}, expected 0")
        deadline = time.monotonic() + 30
        while rv.kv_metrics(frontend)["index"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        second = ask(big, "Describe the picture in a few more words, please.")
        cached = second.usage.prompt_tokens_details.cached_tokens
        after = rv.kv_metrics(frontend)
        predicted = after["predicted"] - before["predicted"]
        reported = after["reported"] - before["reported"]
        rv.expect(cached >= 64, f"second: cached {cached}, expected the image's 64 and more")
        rv.expect(predicted == reported == cached,
                  f"predicted {predicted}, reported {reported}, the reply's {cached}")
        third = ask(other, "Describe the picture in a few more words, please.")
        miss = third.usage.prompt_tokens_details.cached_tokens
        again = rv.kv_metrics(frontend)
        rv.expect(again["predicted"] - after["predicted"] == again["reported"] - after[
            "reported"] == miss, f"another image: predicted "
                  f"{again['predicted'] - after['predicted']}, reported {miss}")
        rv.expect(miss < 64, f"another image of the same size: cached {miss}")
        return (f"{second.usage.prompt_tokens} prompt tokens; the repeat: predicted = reported "
                f"= {cached} cached; another image: {miss}")

    report.check("vision: a repeated image prefix is predicted = reported cached tokens",
                 repeated_prefix)


def run_python(rv: ModuleType, cache: Path, code: str) -> str:
    """Run ``code`` with the peer's Python (for diagnostics)."""
    done = subprocess.run([str(rv.peer_python(cache)), "-c", code], capture_output=True,
                          text=True, check=False)
    return done.stdout + done.stderr

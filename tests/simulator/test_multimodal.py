"""The dialects' MultimodalInputs, read back as a stock servicer would: shapes checked.

A request's images go from the router's payload (multimodal/payload.py) through
the vLLM and SGLang dialects onto the wire; the simulator's check
(simulator/multimodal.py) reads them back the way the servicer builds vLLM's
inputs and refuses what would fail there, so a router bug shows in tests.
"""

from __future__ import annotations

import pytest
from grpclib import GRPCError, Status

from direct_frontend.engines.dialects.sglang import SglangDialect
from direct_frontend.engines.dialects.vllm import VllmDialect
from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.multimodal.payload import MediaPayload
from direct_frontend.multimodal.processors import QwenVLProcessor
from direct_frontend.protos import common_pb2
from direct_frontend.simulator.kvcache import SimPrefixCache, StoredRun
from direct_frontend.simulator.multimodal import block_extra_keys, check_inputs
from tests.support.images import picture

PAD = 7


def payload() -> tuple[list[int], MediaPayload]:
    """Two images (4 and 6 tokens) in a prompt of 16."""
    processor = QwenVLProcessor(image_token_id=PAD, max_pixels=28 * 28 * 64)
    first = processor.process(picture(56, 56), "auto")  # 2×2 merged: 4 tokens
    second = processor.process(picture(84, 56), "auto")  # 3×2: 6 tokens
    prompt = [1, 2, *[PAD] * 4, 3, *[PAD] * 6, 4, 5, 6]
    media = MediaPayload(processor.batch([first, second]), PAD, ((2, 4), (7, 6)),
                         ("hash-a", "hash-b"), processor.family)
    return prompt, media


def call(prompt: list[int], media: MediaPayload) -> GenerateCall:
    return GenerateCall("r", tuple(prompt), SamplingOptions(max_tokens=4), media=media)


def test_the_vllm_dialect_sends_what_the_servicer_reads() -> None:
    prompt, media = payload()
    mm = VllmDialect().generate(call(prompt, media)).request.mm_inputs
    assert mm.modality == common_pb2.IMAGE
    assert list(mm.pixel_values.shape) == [4 * 4 + 4 * 6, 1176]
    assert list(mm.model_specific_tensors["image_grid_thw"].shape) == [2, 3]
    assert dict(mm.flat_keys) == {"pixel_values": "patches_per_image"}
    assert set(mm.batched_keys) == {"image_grid_thw", "patches_per_image"}
    assert list(mm.keep_on_cpu_keys) == ["image_grid_thw"]
    assert check_inputs(mm, prompt, inline=True) == (("hash-a", 2, 4), ("hash-b", 7, 6))


def test_the_sglang_dialect_sends_the_tensors_in_its_layout() -> None:
    prompt, media = payload()
    mm = SglangDialect().generate(call(prompt, media)).request.mm_inputs
    assert list(mm.modalities) == ["image"] and mm.im_token_id == PAD
    assert check_inputs(mm, prompt, inline=False) == (("image-0", 2, 4), ("image-1", 7, 6))


@pytest.mark.parametrize(("spoil", "words"), [
    (lambda mm, p: mm.ClearField("mm_hashes"), "0 mm_hashes for 2 images"),
    (lambda mm, p: setattr(mm, "im_token_id", 8), "not a run of token 8"),
    (lambda mm, p: mm.mm_placeholders[1].__setattr__("offset", 3), "overlaps"),
    (lambda mm, p: mm.mm_placeholders[1].__setattr__("length", 40), "leaves the prompt"),
    (lambda mm, p: mm.pixel_values.__setattr__("inline", mm.pixel_values.inline[:-4]),
     "bytes for shape"),
    (lambda mm, p: p.__setitem__(3, 1), "not a run of token 7"),
    (lambda mm, p: mm.model_specific_tensors["image_grid_thw"].shape.__setitem__(0, 1),
     "bytes for shape"),
])
def test_what_would_fail_in_the_engine_is_refused(spoil: object, words: str) -> None:
    prompt, media = payload()
    mm = VllmDialect().generate(call(prompt, media)).request.mm_inputs
    spoil(mm, prompt)  # type: ignore[operator]
    with pytest.raises(GRPCError) as caught:
        check_inputs(mm, prompt, inline=True)
    assert caught.value.status is Status.INVALID_ARGUMENT and words in str(caught.value.message)


def test_image_blocks_are_keyed_and_published_by_their_hash() -> None:
    published: list[object] = []
    cache = SimPrefixCache(64, 4, "vllm", sink=published.extend)
    prompt = [1, 2, 3, *[PAD] * 6, 4, 5, 6]  # blocks: [1 2 3 P] [P P P P] [P 4 5 6]
    media = (("hash-a", 3, 6),)
    first = cache.admit(prompt, media)
    cache.release(first)
    run = published[0]
    assert isinstance(run, StoredRun)
    assert run.extra_keys == [[("hash-a", 3)], [("hash-a", -1)], [("hash-a", -5)]]
    assert run.extra_keys == block_extra_keys(media, 4, 3)
    assert cache.admit(prompt, media).cached_tokens == 8  # the last block is recomputed
    assert cache.admit(prompt, (("hash-b", 3, 6),)).cached_tokens == 0
    assert cache.admit(prompt).cached_tokens == 0  # the same tokens as text: another key


def test_an_engine_with_a_media_processor_is_sent_references() -> None:
    """Discovery says whether a vLLM servicer processes media itself; such an engine gets the
    images as references (a data URL of the bytes the router checked, else the client's URL
    when its scheme is taken) and the prompt with one placeholder per image."""
    import types

    from direct_frontend.engines.neutral import EngineInfo, EngineRole
    from direct_frontend.pipeline.dispatch import by_reference
    from direct_frontend.routing.catalog import EngineHandle

    prompt, media = payload()
    media = MediaPayload(media.batch, PAD, media.placeholders, media.hashes,
                         refs=("https://img.example/a.png", "data:image/png;base64,AAAA"),
                         sources=((b"\x89PNGa", "image/png"), (b"\x89PNGb", "image/png")))
    dialect = VllmDialect()

    def engine(processor: str, schemes: str) -> EngineHandle:
        info = EngineInfo("m", details=(("mm_processor", processor),
                                        ("mm_media_ref_schemes", schemes)))
        return EngineHandle("e", "vllm", "grpc://e:1", 1, EngineRole.BOTH, info, 4096,
                            types.SimpleNamespace(dialect=dialect))

    plain = by_reference(call(prompt, media), engine("", ""))
    assert plain.media is not None and plain.media.ref_schemes is None
    assert dialect.generate(plain).request.HasField("mm_inputs")
    sent = dialect.generate(by_reference(call(prompt, media), engine("inprocess",
                                                                     "http,https,data")))
    request = sent.request
    assert not request.HasField("mm_inputs")
    assert list(request.tokenized.input_ids) == [1, 2, PAD, 3, PAD, 4, 5, 6]
    assert [item.url for item in request.media_refs.items] == [
        "data:image/png;base64,iVBOR2E=", "data:image/png;base64,iVBOR2I="]
    no_data = dialect.generate(by_reference(call(prompt, media), engine("inprocess", "https")))
    assert no_data.request.HasField("mm_inputs")  # the data URL cannot go by reference


def test_an_engine_that_normalises_on_device_gets_raw_pixels() -> None:
    """vLLM 0.32 normalises Qwen-VL pixels on device (``mm_device_do_normalize``): such an
    engine takes the raw 8-bit pixels in the same layout; normalised ones are refused here
    (a real engine would normalise them twice and answer wrongly)."""
    import types

    import numpy as np

    from direct_frontend.engines.neutral import EngineInfo, EngineRole
    from direct_frontend.pipeline.dispatch import by_reference
    from direct_frontend.routing.catalog import EngineHandle

    prompt, media = payload()
    dialect = VllmDialect()
    info = EngineInfo("m", details=(("mm_device_do_normalize", "true"),))
    engine = EngineHandle("e", "vllm", "grpc://e:1", 1, EngineRole.BOTH, info, 4096,
                          types.SimpleNamespace(dialect=dialect))
    mm = dialect.generate(by_reference(call(prompt, media), engine)).request.mm_inputs
    assert mm.pixel_values.dtype == "uint8" and list(mm.pixel_values.shape) == [40, 1176]
    assert check_inputs(mm, prompt, inline=True, raw_pixels=True)
    raw = np.frombuffer(mm.pixel_values.inline, np.uint8).reshape(40, 1176).astype(np.float32)
    normalised = np.frombuffer(media.batch.pixel_values.data, np.float32).reshape(40, 1176)
    # the same pixels: normalising the raw ones gives the normalised ones (first channel)
    mean, std = 0.48145466, 0.26862954
    np.testing.assert_allclose((raw[:, :392] / 255 - mean) / std, normalised[:, :392], atol=1e-5)
    plain = dialect.generate(call(prompt, media)).request.mm_inputs
    with pytest.raises(GRPCError, match="takes raw uint8 pixels"):
        check_inputs(plain, prompt, inline=True, raw_pixels=True)

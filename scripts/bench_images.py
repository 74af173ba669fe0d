#!/usr/bin/env python3
"""Measure image preprocessing: its cost per image, and that it runs off the event loop.

Three figures, each against a baseline measured in the same run:

1. **cost**: milliseconds to decode and preprocess one PNG of a few sizes with
   Qwen2.5-VL's defaults (its images up to 12.8 M pixels) and the demo model's
   small ones, and what share of it is decoding and resizing (Pillow) against
   NumPy's rescale, normalise and patch layout;
2. **threads**: the same batch of images preprocessed on one thread and on two
   at once (the daemon's limiter): the ratio is what releasing the GIL buys on
   this machine (Pillow releases it in decode and resize, NumPy in its array
   arithmetic; 2.0 would be perfect on two idle cores);
3. **loop**: the worst lag of a Trio task ticking every millisecond while the
   batch is preprocessed through ``trio.to_thread`` (as the daemon does) against
   the same batch run on the loop itself.

Usage::

    python scripts/bench_images.py            # figures under the machine's current load
    python scripts/bench_images.py --rounds 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import pathlib
import sys
import time
from collections.abc import Callable

import numpy as np
import trio
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from direct_frontend.multimodal.fetch import open_image  # noqa: E402
from direct_frontend.multimodal.policy import MediaPolicy  # noqa: E402
from direct_frontend.multimodal.processors import QwenVLProcessor  # noqa: E402

QWEN25 = QwenVLProcessor(image_token_id=1, min_pixels=3136, max_pixels=12845056)
DEMO = QwenVLProcessor(image_token_id=1, max_pixels=28 * 28 * 64)
POLICY = MediaPolicy(max_pixels=50_000_000)


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth gradients plus a little noise: compresses like a photo, not like noise
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                     ((x + y) * 255 // max(width + height - 2, 1))], axis=-1)
    noisy = np.clip(base + rng.integers(-8, 9, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy, "RGB").save(out, format="PNG")
    return out.getvalue()


def best_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def cost(rounds: int) -> None:
    print("1. cost per image (best of rounds, ms)")
    print(f"   {'size':>11} {'processor':>10} {'decode':>8} {'process':>8} {'tokens':>7}")
    for width, height in ((224, 224), (1024, 768), (2048, 1536)):
        data = png(width, height)
        decode = best_ms(lambda data=data: open_image(data, "image/png", POLICY, "x"), rounds)
        image = open_image(data, "image/png", POLICY, "x")
        for name, processor in (("qwen2.5", QWEN25), ("demo", DEMO)):
            work = best_ms(lambda p=processor, i=image: p.process(i, "auto"), rounds)
            tokens = processor.process(image, "auto").tokens
            print(f"   {width:>5}x{height:<5} {name:>10} {decode:8.1f} {work:8.1f} {tokens:7}")


def one(data: bytes) -> int:
    return QWEN25.process(open_image(data, "image/png", POLICY, "x"), "auto").tokens


def threads(rounds: int, batch: list[bytes]) -> None:
    def run(workers: int) -> float:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return best_ms(lambda: list(pool.map(one, batch)), rounds)

    single, double = run(1), run(2)
    print(f"2. {len(batch)} images of 1024x768, qwen2.5: one thread {single:.0f} ms, two "
          f"threads {double:.0f} ms: x{single / double:.2f} (2.00 = the GIL never held)")


def loop(batch: list[bytes]) -> None:
    async def measure(offload: bool) -> float:
        worst = 0.0
        done = trio.Event()

        async def ticker() -> None:
            nonlocal worst
            while not done.is_set():
                start = time.perf_counter()
                await trio.sleep(0.001)
                worst = max(worst, time.perf_counter() - start - 0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.01)
            limiter = trio.CapacityLimiter(2)
            if offload:
                async with trio.open_nursery() as inner:
                    for data in batch:
                        inner.start_soon(lambda d=data: trio.to_thread.run_sync(
                            one, d, limiter=limiter))
            else:
                for data in batch:
                    one(data)
                    await trio.lowlevel.checkpoint()
            done.set()
        return worst * 1e3

    on_loop = trio.run(measure, False)
    threaded = trio.run(measure, True)
    print(f"3. worst event-loop lag while preprocessing: on the loop {on_loop:.1f} ms, in "
          f"threads {threaded:.1f} ms: x{on_loop / max(threaded, 1e-3):.1f} less")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cost(args.rounds)
    batch = [png(1024, 768, seed) for seed in range(6)]
    threads(args.rounds, batch)
    loop(batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())

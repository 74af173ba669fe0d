#!/usr/bin/env python3
"""How well the stored-responses budget counts the memory it holds: RSS against the count.

Fills a fresh process's store with N small responses of the shape the API
stores (a Response object, an output message, an input message) and prints
what the store counted beside how much the process's resident memory grew.
The test suite checks the same ratio with tracemalloc; this is the RSS view.

Usage::

    python scripts/store_memory.py               # 20,000 responses
    python scripts/store_memory.py --count 100000 --owners 16
"""

from __future__ import annotations

import argparse
import gc
import secrets

import msgspec

from direct_frontend.openai.response_store import ResponseStore, StoredResponse


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def fill(store: ResponseStore, count: int, owners: int) -> None:
    for n in range(count):
        response_id = store.new_id()
        response = msgspec.json.encode({
            "id": response_id, "object": "response", "created_at": 1_765_000_000 + n,
            "status": "completed", "model": "demo", "usage": {"input_tokens": 5},
            "output": [{"type": "message", "id": f"msg_{secrets.token_hex(8)}",
                        "content": [{"type": "output_text", "text": "hi there"}]}],
        })
        output = (msgspec.json.encode({"type": "message", "id": f"msg_{n}", "content": [
            {"type": "output_text", "text": "hi there"}]}),)
        conversation = (msgspec.json.encode({"type": "message", "role": "user",
                                             "content": f"hello {n}"}),)
        store.put(StoredResponse(response_id, response, output, conversation,
                                 owner=f"k{n % owners:032x}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--owners", type=int, default=1)
    args = parser.parse_args()
    store = ResponseStore(1 << 40, 1e9)
    gc.collect()
    before = rss_bytes()
    fill(store, args.count, args.owners)
    gc.collect()
    grown = rss_bytes() - before
    print(f"{args.count} responses of {args.owners} owner(s): counted {store.bytes / 1e6:.1f} MB, "
          f"RSS grew {grown / 1e6:.1f} MB, counted / RSS = {store.bytes / grown:.2f}")


if __name__ == "__main__":
    main()

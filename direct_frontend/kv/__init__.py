"""KV-cache awareness: engine KV events over ZeroMQ, sequence fencing and the block index.

``events``, ``sequence`` and ``index`` are sans-IO; ``subscriber`` is the thin
Trio shell that connects them to an engine's PUB and replay sockets.
"""

from direct_frontend.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDecodeError,
    KvEvent,
    KvEventBatch,
    decode_message,
    decode_payload,
)
from direct_frontend.kv.index import KvIndex, KvIndexStats, block_content_hash, prefix_hashes
from direct_frontend.kv.sequence import SequenceTracker

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvDecodeError",
    "KvEvent",
    "KvEventBatch",
    "KvIndex",
    "KvIndexStats",
    "SequenceTracker",
    "block_content_hash",
    "decode_message",
    "decode_payload",
    "prefix_hashes",
]

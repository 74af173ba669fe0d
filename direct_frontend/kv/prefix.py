"""Our prefix hash of a chain of KV blocks, for requests and for stored blocks alike (sans-IO).

Engine block hashes differ between engines, configurations and (before 2026)
processes, so prefixes are matched on a hash we compute ourselves from the
token ids, the same way for stored blocks and for requests (docs/kv-events.md §9.4):

- a block's content is its token ids as little-endian u32 bytes;
- a prefix hash chains the blocks: ``h_1 = XXH3_64(block_1, seed=root)``,
  ``h_i = XXH3_64(block_i, seed=h_{i-1})``. The root is 1337 (the seed Dynamo
  and smg use), so ``h_1`` is exactly the doc's block content hash; a LoRA name
  changes the root the way Dynamo does (``1337 + XXH3_64(name)``). One hash
  call per block, and the chain never crosses the wire, so its form is ours;
- extra keys we cannot reproduce from a request (multimodal ids, prompt-embed
  digests) are appended to that block's bytes, which keeps such blocks out of
  plain-text matches while their children still chain and their removals still
  find them. A cache salt is mixed into block 0 the same way on both sides.
"""

from __future__ import annotations

import array
import functools
import struct
from collections.abc import Sequence
from typing import Final

import msgspec
import xxhash

from direct_frontend.kv.events import MASK64, BlockStored
from direct_frontend.text.prompt_ids import PromptIds

__all__ = [
    "ROOT_SEED",
    "MediaKey",
    "block_content_hash",
    "extend_hashes",
    "mm_block_extras",
    "more_hashes",
    "namespace_seed",
    "prefix_hashes",
    "prompt_hashes",
    "stored_hashes",
]

ROOT_SEED: Final = 1337
_xxh3: Final = xxhash.xxh3_64_intdigest
_encode_extra: Final = msgspec.msgpack.encode


def namespace_seed(lora_name: str | None) -> int:
    """The chain root: 1337, or Dynamo's ``1337 + XXH3_64(lora_name)`` for an adapter."""
    if not lora_name:
        return ROOT_SEED
    return (ROOT_SEED + _xxh3(lora_name.encode())) & MASK64


def block_content_hash(token_ids: Sequence[int], seed: int = ROOT_SEED) -> int:
    """XXH3-64 over one block's token ids as LE u32 (docs/kv-events.md §12.4)."""
    return _xxh3(array.array("I", token_ids).tobytes(), seed)


def _salt_bytes(cache_salt: str) -> bytes:
    return _encode_extra([cache_salt])


#: one image of a request: (its hash, the offset of its placeholder run, the run's length)
MediaKey = tuple[str, int, int]


def mm_block_extras(media: Sequence[MediaKey], block_size: int,
                    n_blocks: int) -> list[list[list[object]] | None]:
    """Each block's multimodal extra keys, as vLLM keys the blocks an image's tokens fill.

    vLLM (``_gen_mm_extra_hash_keys``, 0.32) adds to every block that overlaps
    an image's placeholder run the pair (the image's identifier, the run's
    offset relative to the block's start: negative in blocks after the first),
    and publishes those pairs untagged in each ``BlockStored``'s
    ``extra_keys``; the identifier is the hash the router sent. The same pairs,
    encoded as the events' are (:func:`_own_extra`), key a request's blocks, so
    a repeated image prefix matches, and the same tokens of another image do not.
    """
    extras: list[list[list[object]] | None] = [None] * n_blocks
    for identifier, offset, length in media:
        first = offset // block_size
        last = min(n_blocks, -(-(offset + length) // block_size))
        for block in range(first, last):
            keys = extras[block]
            if keys is None:
                keys = extras[block] = []
            keys.append([identifier, offset - block * block_size])
    return extras


def prefix_hashes(
    token_ids: Sequence[int] | array.array[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    media: Sequence[MediaKey] = (),
) -> list[int]:
    """The chained prefix hash of every full block of a request (partial tail dropped).

    ``media``: the request's images (:data:`MediaKey`), whose hashes key the
    blocks their tokens fill (:func:`mm_block_extras`).

    :class:`PromptIds` get the blocks of their known prefix from the prompt they
    share it with, and keep their own chain for the next; other ids are hashed
    whole. Each block is one XXH3 call over a slice of the ids' u32 buffer.
    """
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    if media:  # (images key blocks of their own: hashed whole, never taken from a prefix)
        return _media_prefix_hashes(token_ids, block_size, lora_name, cache_salt, media)
    if isinstance(token_ids, PromptIds):
        return list(_kept_chain(token_ids, block_size, namespace_seed(lora_name), cache_salt))
    return _chain(token_ids, 0, n_blocks, block_size, namespace_seed(lora_name), cache_salt)


def prompt_hashes(token_ids: Sequence[int], block_size: int,
                  media: Sequence[MediaKey] = ()) -> tuple[int, ...]:
    """:func:`prefix_hashes` (no adapter or salt) as a tuple: :class:`PromptIds` give the one
    they keep (asked again, the same tuple), which the prompts built from them start from."""
    if isinstance(token_ids, PromptIds) and not media and len(token_ids) >= block_size:
        return _kept_chain(token_ids, block_size, ROOT_SEED, None)
    return tuple(prefix_hashes(token_ids, block_size, media=media))


def _kept_chain(token_ids: PromptIds, block_size: int, root: int, cache_salt: str | None
                ) -> tuple[int, ...]:
    """``token_ids``' chain, kept in its ``chains``; the blocks within its ``known`` prefix
    taken from its source's, so only the rest is hashed, and the whole is one copy."""
    key = (block_size, root, cache_salt or None)
    have = token_ids.chains.get(key)
    if have is not None:
        return have
    reused: tuple[int, ...] = ()
    source = token_ids.source
    if source is not None:
        reused = source.get(key, ())
        shared = token_ids.known // block_size
        if shared < len(reused):
            reused = reused[:shared]
    new = _chain(token_ids, len(reused), len(token_ids) // block_size, block_size,
                 reused[-1] if reused else root, cache_salt)
    out = reused + tuple(new) if reused else tuple(new)
    token_ids.chains[key] = out
    return out


def _chain(token_ids: Sequence[int] | array.array[int], start: int, end: int, block_size: int,
           h: int, cache_salt: str | None) -> list[int]:
    """The chained hashes of blocks ``start:end`` of ``token_ids``, going on from ``h`` (the
    hash of the block before, or the root); a cache salt is mixed into block 0."""
    data = _u32_bytes(token_ids, start * block_size, end * block_size)
    step = block_size * 4
    out: list[int] = []
    offset = 0
    if start == 0 and cache_salt and data:
        h = _xxh3(bytes(data[:step]) + _salt_bytes(cache_salt), h)
        out.append(h)
        offset = step
    _chain_on(out, data, offset, step, h)
    return out


def extend_hashes(known: tuple[int, ...], rest: Sequence[int], block_size: int
                  ) -> tuple[int, ...]:
    """:func:`prefix_hashes` of some token ids (no adapter, salt or images), given ``known``,
    the hashes of their first blocks (a prompt's, when the ids are it and its answer), and
    ``rest``, the ids after those blocks: only the blocks of ``rest`` are hashed."""
    return known + more_hashes(known, rest, block_size)


def more_hashes(known: Sequence[int], rest: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The hashes :func:`extend_hashes` adds to ``known``: those of ``rest``'s whole blocks,
    chained on from ``known``'s last (none: from the root)."""
    return tuple(_chain(rest, 0, len(rest) // block_size, block_size,
                        known[-1] if known else ROOT_SEED, None))


def _u32_bytes(token_ids: Sequence[int] | array.array[int], start: int, end: int
               ) -> memoryview:
    """Ids ``start:end`` as u32 bytes: :class:`PromptIds`' own, else converted (the slice is
    a plain tuple or list, which ``array`` converts in one C pass)."""
    if isinstance(token_ids, PromptIds):
        return memoryview(token_ids.raw)[4 * start:4 * end]
    return memoryview(array.array("I", token_ids[start:end])).cast("B")


#: blocks :func:`_chain_on` cuts at once (one C call makes this many of them)
_RUN: Final = 64


@functools.cache
def _runs(step: int) -> struct.Struct:
    """The layout of :data:`_RUN` blocks of ``step`` bytes."""
    return struct.Struct(f"{step}s" * _RUN)


def _chain_on(out: list[int], data: bytes | memoryview, offset: int, step: int, h: int) -> None:
    """Append to ``out`` the chained hash of each whole ``step`` bytes of ``data`` from
    ``offset``, the chain going on from ``h``.

    The blocks are cut in C (``struct``: :data:`_RUN` at a time, then the rest
    one by one) and the chain is one comprehension: per block, one XXH3 call
    and no other Python call.
    """
    view = memoryview(data)
    runs = offset + (len(data) - offset) // (step * _RUN) * step * _RUN
    end = offset + (len(data) - offset) // step * step
    if runs > offset:
        out += [h := _xxh3(block, h)
                for run in _runs(step).iter_unpack(view[offset:runs]) for block in run]
    out += [h := _xxh3(block, h) for (block,) in struct.iter_unpack(f"{step}s", view[runs:end])]


def _media_prefix_hashes(
    token_ids: Sequence[int] | array.array[int], block_size: int, lora_name: str | None,
    cache_salt: str | None, media: Sequence[MediaKey],
) -> list[int]:
    n_blocks = len(token_ids) // block_size
    extras = mm_block_extras(media, block_size, n_blocks)
    data = bytes(_u32_bytes(token_ids, 0, n_blocks * block_size))
    step = block_size * 4
    h = namespace_seed(lora_name)
    out = []
    for i in range(n_blocks):
        chunk = data[i * step : (i + 1) * step]
        keys: list[object] = list(extras[i] or ())
        if cache_salt and i == 0:
            keys.append(cache_salt)
        if keys:
            chunk += _encode_extra(keys)
        h = _xxh3(chunk, h)
        out.append(h)
    return out


def stored_hashes(event: BlockStored, block_size: int, seed: int) -> list[int]:
    """Our prefix hash of each block of a store, chained on from ``seed`` (its parent's).

    The event's own extra keys are mixed in where it lists them
    (:func:`_own_extra`); else its cache salt, on the chain's first block.
    """
    data = event.token_ids.tobytes()
    step = block_size * 4
    extras = event.extra_keys
    lora = event.lora_name
    salt = event.cache_salt if event.parent_block_hash is None else None
    h = seed
    out: list[int] = []
    whole = len(event.block_hashes) * step
    if len(data) >= whole and (not salt if extras is None else extras.count(None) == len(extras)):
        _chain_on(out, data[:whole] if len(data) > whole else data, 0, step, h)  # nothing mixed in
        return out
    for i in range(len(event.block_hashes)):
        chunk = data[i * step : (i + 1) * step]
        if extras is not None:
            extra = _own_extra(extras[i] if i < len(extras) else None, lora)
            if extra is not None:
                chunk += extra
        elif salt and i == 0:
            chunk += _salt_bytes(salt)
        h = _xxh3(chunk, h)
        out.append(h)
    return out


def _own_extra(extra: object, lora_name: str | None) -> bytes | None:
    """The part of a block's extra keys a prefix match must respect, as bytes.

    vLLM puts the LoRA name first (already in the chain root) and a cache salt
    last on block 0; what is left is encoded canonically, so a request's salt
    (see :func:`prefix_hashes`) gives the same bytes.
    """
    if extra is None:
        return None
    keys = list(extra) if isinstance(extra, list | tuple) else [extra]
    if lora_name and keys and keys[0] == lora_name:
        keys = keys[1:]
    if not keys:
        return None
    try:
        return _encode_extra(keys)
    except (TypeError, msgspec.EncodeError):
        return repr(keys).encode()

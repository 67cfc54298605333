"""Stable prefix-cache block hashes: the same tokens give the same chain in every process.

A full block's hash chains its parent's hash and its own token ids, so equal hashes mean
equal prefixes. The hash is BLAKE2b (8-byte digest) over the parent's 8 bytes followed by
the block's token ids as little-endian int32 — not Python's `hash()`, which is salted per
process: the Router compares chains computed in its own process with the hashes the
engine replicas report (KV cache events, kv_events.py), so every process must agree.
Hashes are signed 64-bit ints (they live in the block manager's int64 array).

Unkeyed: a collision between two prompts needs about 2**32 tries, which only an attacker
hashing their own prompts could make, and it would serve them their own other prompt's KV;
reaching another tenant's prefix needs a second preimage (about 2**64).
"""

from __future__ import annotations

import struct
from hashlib import blake2b

ROOT_HASH = 0x5EED  # parent hash of a request's first block

_PARENT = struct.Struct("<q")


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """Hash of one full block: chains the parent block's hash with this block's token ids."""
    data = _PARENT.pack(parent_hash) + struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little", signed=True)


def extend_chain(hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int) -> list[int]:
    """Append to `hashes` (the chain of the first len(hashes) blocks of `token_ids`) the hashes
    of the blocks up to `num_blocks`; returns `hashes`. The new blocks' tokens are packed in one
    call and the digests chained as bytes, converted to ints in one call at the end."""
    start = len(hashes)
    count = num_blocks - start
    if count <= 0:
        return hashes
    stride = 4 * block_size
    packed = struct.pack(f"<{count * block_size}i", *token_ids[start * block_size: num_blocks * block_size])
    digest = _PARENT.pack(hashes[-1] if hashes else ROOT_HASH)
    digests = []
    append = digests.append
    for offset in range(0, len(packed), stride):
        digest = blake2b(digest + packed[offset:offset + stride], digest_size=8).digest()
        append(digest)
    hashes += struct.unpack(f"<{count}q", b"".join(digests))
    return hashes


def block_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The chain hashes of every full block of `token_ids` (what a router compares with a
    replica's cached hashes)."""
    return extend_chain([], token_ids, block_size, len(token_ids) // block_size)

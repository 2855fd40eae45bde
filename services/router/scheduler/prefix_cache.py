"""Chain hashes of full KV blocks, the key space of the prefix cache.

A block's key covers its own tokens and, through the parent key, every token before it:
the same 128 tokens after a different prefix produce a different key (their compressed
rows differ, since attention state depends on the whole prefix). Keys are 16-byte BLAKE2b
digests, stable across processes (Python's `hash()` is salted per process and is not used).

Only confirmed tokens (prompt and accepted output) are ever hashed: draft tokens are
hashed by nobody, so speculation cannot poison the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_DIGEST_BYTES = 16
# Parent of the first block: a fixed namespace so keys of other schemes never collide.
ROOT_PARENT_HASH = hashlib.blake2b(b"moemesh.prefix_cache.v1", digest_size=HASH_DIGEST_BYTES).digest()


def hash_block_tokens(parent_hash: bytes, block_token_ids: Sequence[int]) -> bytes:
    """Key of one full block given the key of the block before it (ROOT_PARENT_HASH first)."""
    digest = hashlib.blake2b(parent_hash, digest_size=HASH_DIGEST_BYTES)
    digest.update(array("q", block_token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    num_hashable_tokens: int,
    block_size_tokens: int,
) -> None:
    """Append keys for every full block inside token_ids[:num_hashable_tokens] not yet hashed.

    block_hashes is a request's list (index i = block i) and grows in place; token_ids are
    the request's confirmed tokens from position 0.
    """
    num_full_blocks = num_hashable_tokens // block_size_tokens
    parent = block_hashes[-1] if block_hashes else ROOT_PARENT_HASH
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size_tokens
        parent = hash_block_tokens(parent, token_ids[start : start + block_size_tokens])
        block_hashes.append(parent)

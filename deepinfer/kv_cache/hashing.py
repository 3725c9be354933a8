"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its tokens and any extra keys
(a cache salt), so equal hashes mean equal whole prefixes, not just equal
blocks. Python's tuple hash is 64-bit; a collision would silently share a
wrong block, which at 2**-64 per pair we accept, as the reference engines do
with their default hash.
"""

from __future__ import annotations

from deepinfer.request import Request

ROOT_HASH = 0x9E3779B97F4A7C15  # parent of a sequence's first block


def update_block_hashes(request: Request, block_size: int) -> list[int]:
    """Extend `request.block_hashes` to cover every full block of its known tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        parent = hashes[-1] if hashes else ROOT_HASH
        extra, append = request.cache_salt, hashes.append
        for key in request.block_keys(len(hashes), num_full, block_size):
            # a block's hash: (its parent's hash, its tokens, the request's extra keys)
            parent = hash((parent, key, extra))
            append(parent)
    return hashes

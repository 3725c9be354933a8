"""Synthetic prompt content for trace requests, for the simulator's prefix cache.

A trace gives sizes and, at best, prefix-block ids; the prefix cache needs
content. Token p of a prompt is a pure function of
  - (prefix_blocks[p // bs], p % bs) while p lies in the prefix blocks, so
    equal block ids give equal content in every request, and
  - (salt, p) after them, where the caller gives each request its own salt,
    so distinct requests never share that tail.
Content is never materialised to hash it: `content_key` describes a span as
segments, `(block_id, off_start, off_end)` or `("u", salt, start, end)`. A key
determines the ids exactly, and equal ids come from equal keys except by a
64-bit hash collision (the same odds real token ids give a chained hash).
Keys compare only between prompts of the same vocab_size.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from sim.traces.model import TraceRequest

_M64 = (1 << 64) - 1
# Separate the seeds of block content and unique tails, so block id 5 and salt 5
# do not produce the same token stream.
_BLOCK_TAG = 0xB10C_B10C_B10C_B10C
_UNIQUE_TAG = 0x5A17_5A17_5A17_5A17


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int: a bijection of 64-bit words."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """The same finaliser over uint64 arrays (array arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SyntheticPrompt:
    """A prompt of `prompt_len` tokens, content derived from prefix blocks and a salt.

    Implements deepinfer.request.PromptTokens. Immutable after construction.
    """

    __slots__ = ("_blocks", "_bs", "_len", "_prefix_end", "_salt", "_vocab")

    def __init__(
        self,
        prompt_len: int,
        prefix_blocks: Sequence[int] = (),
        prefix_block_size: int = 0,
        *,
        salt: int,
        vocab_size: int = 32000,
    ) -> None:
        if prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
        if prefix_blocks and prefix_block_size < 1:
            raise ValueError("prefix_blocks need a prefix_block_size >= 1")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self._len = prompt_len
        self._blocks = tuple(prefix_blocks)
        self._bs = prefix_block_size if self._blocks else 1
        # Blocks past the prompt's end are unused; the last one may be partial.
        self._prefix_end = min(len(self._blocks) * self._bs, prompt_len)
        self._salt = salt
        self._vocab = vocab_size

    @classmethod
    def for_request(cls, req: TraceRequest, salt: int, vocab_size: int = 32000) -> SyntheticPrompt:
        """The prompt of a trace request; `salt` must differ between requests."""
        return cls(
            req.prompt_len,
            req.prefix_blocks,
            req.prefix_block_size,
            salt=salt,
            vocab_size=vocab_size,
        )

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (
            f"SyntheticPrompt(len={self._len}, blocks={len(self._blocks)}x{self._bs}, "
            f"salt={self._salt})"
        )

    def content_key(self, start: int, end: int) -> Hashable:
        """A tuple of segments describing positions [start, end); cheap, no token lists."""
        if not 0 <= start <= end <= self._len:
            raise IndexError(f"span [{start}, {end}) outside prompt of {self._len} tokens")
        pe = self._prefix_end
        # Fast paths: the hot caller asks for one KV block, which almost always
        # lies inside one prefix block or wholly in the unique tail.
        if end <= pe and start < end:
            bs = self._bs
            i = start // bs
            if (end - 1) // bs == i:
                base = i * bs
                return ((self._blocks[i], start - base, end - base),)
        elif start >= pe:
            return (("u", self._salt, start, end),) if start < end else ()
        return tuple(self._segments(start, end))

    def block_keys(self, first: int, stop: int, block_size: int) -> list[Hashable]:
        """`content_key` of each span of `block_size` tokens from the `first` to the `stop`
        such span (the prefix cache's KV blocks), in one call."""
        size, pe = block_size, self._prefix_end
        if not 0 <= first <= stop or stop * size > self._len:
            raise IndexError(
                f"blocks [{first}, {stop}) of {size} tokens outside prompt of {self._len} tokens"
            )
        head = max(first, min(stop, pe // size))  # spans wholly in prefix blocks end here
        tail = max(head, min(stop, -(-pe // size)))  # spans wholly in the unique tail
        blocks, bs = self._blocks, self._bs
        if bs % size == 0:  # each span lies in one prefix block (content_key's fast path)
            keys = [
                ((blocks[s // bs], s % bs, s % bs + size),)
                for s in range(first * size, head * size, size)
            ]
        else:
            keys = [self.content_key(s, s + size) for s in range(first * size, head * size, size)]
        keys += [self.content_key(s, s + size) for s in range(head * size, tail * size, size)]
        salt = self._salt
        keys += [(("u", salt, s, s + size),) for s in range(tail * size, stop * size, size)]
        return keys

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end), each in [0, vocab_size)."""
        if not 0 <= start <= end <= self._len:
            raise IndexError(f"span [{start}, {end}) outside prompt of {self._len} tokens")
        parts = []
        for seg in self._segments(start, end):
            if len(seg) == 4:  # ("u", salt, start, end)
                _, salt, a, b = seg
                seed = _mix64(_mix64(salt & _M64) ^ _UNIQUE_TAG)
            else:
                block, a, b = seg
                seed = _mix64(_mix64(block & _M64) ^ _BLOCK_TAG)
            parts.append(np.uint64(seed) + np.arange(a, b, dtype=np.uint64))
        if not parts:
            return []
        ids = _mix64_array(np.concatenate(parts)) % np.uint64(self._vocab)
        return ids.tolist()

    def _segments(self, start: int, end: int) -> list[tuple]:
        # One segment per prefix block touched, then at most one unique tail;
        # the fast paths in content_key and block_keys must build the same tuples.
        segs: list[tuple] = []
        p, bs, pe = start, self._bs, self._prefix_end
        while p < end and p < pe:
            i = p // bs
            base = i * bs
            q = min(end, pe, base + bs)
            segs.append((self._blocks[i], p - base, q - base))
            p = q
        if p < end:
            segs.append(("u", self._salt, p, end))
        return segs

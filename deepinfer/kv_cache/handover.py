"""KVHandover: a request's prompt KV on its way from a prefill engine to a decode engine.

A prefill engine finishes a request at its first token; its executor exports the KV of
the prompt's first `num_tokens` positions (all but the last token: the decode engine
computes that one again, which samples the first output token, as vLLM's disaggregation
does) and the decode engine's executor imports it into the blocks its scheduler gives
the request (docs/design.md, "Roles" and "Clusters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVHandover:
    """req_id: the request, by id (the decode engine schedules it under the same id).
    num_tokens: positions [0, num_tokens) of its prompt whose KV `kv` holds.
    block_size, block_hashes: the chain hashes of the full blocks among them
    (deepinfer/kv_cache/hashing.py), so the receiver can check the KV is its prompt's.
    kv: the executor's buffer, contiguous; the torch executor's is a tensor
    [num_tokens, layers (the MTP layers' last), kv_lora_rank + qk_rope_head_dim].
    num_bytes: the size of `kv`, what crosses the link."""

    req_id: str
    num_tokens: int
    block_size: int
    block_hashes: tuple[int, ...]
    kv: Any
    num_bytes: int

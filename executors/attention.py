"""Paged MLA attention metadata: slots, block tables and the prefill key gather.

The batch is one flattened varlen sequence of T new tokens. Requests are ordered
decode-first: the first `num_decode_reqs` requests (short queries over a long
context) use the absorbed form over the latent cache; the rest (prefill chunks)
decompress the gathered latent into full K/V. The attention itself is
`kernels.ops.mla_decode_attention` / `kernels.ops.mla_prefill_attention`, called by
executors.models.mla (kernels.ops chooses Triton or the torch twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executors.host_copy import to_device_async


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (all tensors on the model's device)."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64: offsets of each request's tokens in the batch
    context_lens: torch.Tensor  # [B] int64: tokens already cached before this step
    seq_lens: torch.Tensor  # [B] int64: context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    num_decode_reqs: int  # requests [0, num_decode_reqs) take the absorbed path
    num_decode_tokens: int  # their tokens come first in the batch
    # Prefill part, relative to the prefill tokens (batch tokens [num_decode_tokens, T)).
    prefill_cu_seqlens_q: torch.Tensor  # [Bp + 1] int64
    prefill_cu_seqlens_k: torch.Tensor  # [Bp + 1] int64: every cached + new token per request
    prefill_kv_slots: torch.Tensor  # [Sp] int64: cache slots of those keys, request by request
    prefill_max_query_len: int  # longest prefill query (host int: the prefill kernel's grid)

    def to(self, device: torch.device) -> AttentionMetadata:
        """On `device`, copied without waiting for its queued work (executors/host_copy)."""
        moved = {
            k: to_device_async(v, device) if isinstance(v, torch.Tensor) else v
            for k, v in vars(self).items()
        }
        return AttentionMetadata(**moved)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decode_reqs: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the metadata on the CPU, then move it. Requests must be ordered decode-first."""
    max_blocks = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    seq = ctx + q_lens
    slots, kv_slots = [], []
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        slots.append(_slots(table[i], torch.arange(c, c + q), block_size))
        if i >= num_decode_reqs:
            kv_slots.append(_slots(table[i], torch.arange(c + q), block_size))
    q_start = F.pad(torch.cumsum(q_lens, 0), (1, 0))
    prefill = slice(num_decode_reqs, None)
    empty = torch.zeros(0, dtype=torch.int64)
    md = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.cat(slots) if slots else empty,
        query_start_loc=q_start,
        context_lens=ctx,
        seq_lens=seq,
        block_tables=table,
        num_decode_reqs=num_decode_reqs,
        num_decode_tokens=int(q_lens[:num_decode_reqs].sum()),
        prefill_cu_seqlens_q=F.pad(torch.cumsum(q_lens[prefill], 0), (1, 0)),
        prefill_cu_seqlens_k=F.pad(torch.cumsum(seq[prefill], 0), (1, 0)),
        prefill_kv_slots=torch.cat(kv_slots) if kv_slots else empty,
        prefill_max_query_len=max(query_lens[num_decode_reqs:], default=0),
    )
    return md.to(device)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """slot = block_table[pos // block_size] * block_size + pos % block_size."""
    return block_table[positions // block_size] * block_size + positions % block_size


def gather_latent_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """-> [len(slots), D]."""
    return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots)

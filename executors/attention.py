"""Paged MLA attention metadata: slots, block tables and the prefill key gather.

The batch is one flattened varlen sequence of T new tokens. Requests are ordered
decode-first: the first `num_decode_reqs` requests (short queries over a long
context) use the absorbed form over the latent cache; the rest (prefill chunks)
decompress the gathered latent into full K/V. The attention itself is
`kernels.ops.mla_decode_attention` / `kernels.ops.mla_prefill_attention`, called by
executors.models.mla (kernels.ops chooses Triton or the torch twin).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from executors.host_copy import packed_to_device


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
        return self.moved_with(device, [])[0]

    def moved_with(
        self, device: torch.device, extra: list[torch.Tensor]
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """This and `extra` (host int64 tensors: a step's ids, positions, ...) on
        `device` in one copy (`packed_to_device`); tensors already there stay."""
        fields = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        tensors = [*fields.values(), *extra]
        moved = [t.to(device) if t.device.type != "cpu" else t for t in tensors]
        if device.type != "cpu":
            host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
            for i, t in zip(host, packed_to_device([tensors[i] for i in host], device)):
                moved[i] = t
        md = AttentionMetadata(**{**vars(self), **dict(zip(fields, moved))})
        return md, moved[len(fields) :]


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decode_reqs: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the metadata on the CPU, then move it. Requests must be ordered decode-first.

    Vectorised over the batch (numpy): a per-request loop of small tensor ops costs host
    time that grows with the batch, on the path of every eager or piecewise step."""
    b = len(block_tables)
    lens = np.fromiter(map(len, block_tables), np.int64, b)  # [B] blocks a request
    table = np.zeros((b, int(lens.max(initial=0)) or 1), dtype=np.int64)  # padded with 0
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int64, int(lens.sum()))
    table[_owner(lens), _offsets(lens)] = flat
    q = np.array(query_lens, dtype=np.int64)  # [B] (copies: the tensors are written in place)
    ctx = np.array(context_lens, dtype=np.int64)  # [B]
    seq = ctx + q
    # Each new token's slot, at its position (`token_positions`).
    slots = _slots(table, _owner(q), _positions(q, ctx), block_size)
    # Each prefill request's keys: all its positions 0 .. seq_i - 1, request by request.
    nd = num_decode_reqs
    kv_owner = nd + _owner(seq[nd:])  # [Sp]
    kv_slots = _slots(table, kv_owner, _offsets(seq[nd:]), block_size)
    md = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.from_numpy(slots),
        query_start_loc=torch.from_numpy(_cumsum0(q)),
        context_lens=torch.from_numpy(ctx),
        seq_lens=torch.from_numpy(seq),
        block_tables=torch.from_numpy(table),
        num_decode_reqs=nd,
        num_decode_tokens=int(q[:nd].sum()),
        prefill_cu_seqlens_q=torch.from_numpy(_cumsum0(q[nd:])),
        prefill_cu_seqlens_k=torch.from_numpy(_cumsum0(seq[nd:])),
        prefill_kv_slots=torch.from_numpy(kv_slots),
        prefill_max_query_len=int(q[nd:].max(initial=0)),
    )
    return md.to(device)


def token_positions(query_lens: list[int], context_lens: list[int]) -> np.ndarray:
    """[T] int64: request i's positions context_i .. context_i + query_i - 1, in order."""
    q = np.array(query_lens, dtype=np.int64)
    return _positions(q, np.array(context_lens, dtype=np.int64))


def _positions(q: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    return np.repeat(ctx, q) + _offsets(q)


def _cumsum0(x: np.ndarray) -> np.ndarray:
    """[n] -> [n + 1]: 0, then the running sums."""
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _owner(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: the index of the run each element belongs to."""
    return np.repeat(np.arange(len(counts)), counts)


def _offsets(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: each element's offset within its run (0, 1, .., counts[i] - 1)."""
    starts = _cumsum0(counts)[:-1]
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


def _slots(
    table: np.ndarray, owner: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """slot = table[owner, pos // block_size] * block_size + pos % block_size."""
    return table[owner, positions // block_size] * block_size + positions % block_size


def gather_latent_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """-> [len(slots), D]."""
    return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots)

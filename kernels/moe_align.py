"""Token-to-expert alignment for the fused MoE GEMMs, in one small Triton program.

The T * k (token, expert) pairs are sorted by expert (stably, so pair order is kept
within an expert) and each expert's run is padded to a multiple of BLOCK_M; every
BLOCK_M-row block of the result then belongs to one expert. No host sync: the
outputs are sized by an upper bound and the padded total is returned on device.

    sorted_pairs [max_padded]   pair id (t * k + j) per row; padding rows hold T * k
    block_expert [max_blocks]   expert of each row block; -1 past the padded total
    num_padded   [1]            rows actually used (sum of padded runs)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor  # [max_padded] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    max_blocks: int


def max_blocks_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """sum_e ceil(c_e / BM) <= ceil(num_pairs / BM) + (experts with c_e > 0)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


# Per-step sizes are runtime arguments Triton must not specialise on (value 1, divisible
# by 16), or a new value would compile a new kernel in the middle of serving.
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_align_kernel(
    ids_ptr,  # [num_pairs] expert id of each pair
    sorted_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    offs_e = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], tl.int32)
    for c in tl.range(0, num_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M  # [E_POW2]
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    # Expert of each row block: the number of experts whose padded run ends at or before it.
    for c in tl.range(0, max_blocks, CHUNK):
        blk = c + tl.arange(0, CHUNK)
        row0 = blk * BLOCK_M
        e = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        tl.store(block_expert_ptr + blk, tl.where(row0 < total, e, -1), mask=blk < max_blocks)

    # Padding rows point past the last pair; real rows are overwritten below.
    for c in tl.range(0, max_blocks * BLOCK_M, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, num_pairs, mask=offs < max_blocks * BLOCK_M)
    tl.debug_barrier()

    # Scatter: row = start of the expert's run + rank of the pair among that expert's pairs.
    next_row = ends - padded  # [E_POW2] next free row per expert
    for c in tl.range(0, num_pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_POW2]
        rank = tl.cumsum(onehot, axis=0) - 1 + next_row[None, :]
        row = tl.sum(onehot * rank, axis=1)  # [CHUNK]
        tl.store(sorted_ptr + row, offs.to(tl.int32), mask=offs < num_pairs)
        next_row += tl.sum(onehot, axis=0)


# Above this many pairs the one-program kernel's serial loops cost more (1.9 ms at 98k
# pairs on the H200) than the twin's few parallel torch ops (a sort, a scatter-add).
MAX_PAIRS_ONE_PROGRAM = 8192


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids: [T, k] -> Alignment (see the module docstring)."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    if num_pairs > MAX_PAIRS_ONE_PROGRAM:
        return moe_align_ref(topk_ids, num_experts, block_m)
    max_blocks = max_blocks_bound(num_pairs, num_experts, block_m)
    dev = ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(num_experts)
    # The [CHUNK, E] one-hot tile stays within 16k elements, and no wider than the pairs
    # need: a decode step has a handful, and the kernel's time is then its tile work.
    chunk = max(16, min(256, 16384 // e_pow2, triton.next_power_of_2(num_pairs)))
    _moe_align_kernel[(1,)](
        ids, sorted_pairs, block_expert, num_padded, num_pairs, max_blocks,
        BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, num_warps=8 if chunk >= 128 else 4,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_expert, num_padded, max_blocks)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Torch twin of `moe_align` (same outputs, element for element); no host sync, so
    `moe_align` takes it for large batches, also inside a CUDA graph capture."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    max_blocks = max_blocks_bound(num_pairs, num_experts, block_m)
    # Not bincount: on CUDA it reads the largest id back to the host (a sync), which a
    # CUDA graph capture (the piecewise graphs' large token buckets) refuses.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(ids, stable=True)
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    pos = torch.arange(num_pairs, device=ids.device)
    rows = ends[ids[order]] - padded[ids[order]] + pos - first[ids[order]]
    sorted_pairs = torch.full(
        (max_blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device
    )
    sorted_pairs[rows] = order.to(torch.int32)
    row0 = torch.arange(max_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, row0, right=True)
    total = ends[-1]
    block_expert = torch.where(row0 < total, block_expert, -1).to(torch.int32)
    return Alignment(sorted_pairs, block_expert, total.reshape(1).to(torch.int32), max_blocks)

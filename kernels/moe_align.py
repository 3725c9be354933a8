"""Token-to-expert alignment for the fused MoE GEMMs: one small Triton program for a few
pairs, three kernels (count, offsets, scatter) for many.

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


@triton.jit
def _store_runs(
    counts, num_padded_ptr, block_expert_ptr, max_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr
):
    """counts [E_POW2] pairs per expert -> (padded run lengths, run ends), both [E_POW2];
    stores the padded total and the expert of every row block (-1 past the total)."""
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # Expert of each row block: the number of experts whose padded run ends at or before it.
    for c in tl.range(0, max_blocks, CHUNK):
        blk = c + tl.arange(0, CHUNK)
        row0 = blk * BLOCK_M
        e = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        tl.store(block_expert_ptr + blk, tl.where(row0 < total, e, -1), mask=blk < max_blocks)
    return padded, ends


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
    padded, ends = _store_runs(
        counts, num_padded_ptr, block_expert_ptr, max_blocks, BLOCK_M, CHUNK
    )  # [E_POW2] x 2

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


# The same alignment as three kernels, for many pairs: the one-program kernel's loops
# are serial, so its time grows with the pairs (a batch-256 verify step of Moonlight,
# 64 + 2 shared experts and 8 pairs a token, has 8,192), while here each CHUNK of pairs
# is one program and only the per-expert prefix sums over the chunks run in one.
@triton.jit(do_not_specialize=["num_pairs", "max_padded", "fill_per_program"])
def _moe_count_kernel(
    ids_ptr,  # [num_pairs]
    partial_ptr,  # [num_groups, E_POW2] int32 out: pairs of each expert in each chunk
    sorted_ptr,  # [max_padded] int32 out: every row set to the padding value num_pairs
    num_pairs,
    max_padded,
    fill_per_program,  # a multiple of CHUNK; num_groups * fill_per_program >= max_padded
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    g = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    offs = g * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    counts = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(partial_ptr + g * E_POW2 + offs_e, counts)
    # The scatter kernel, launched after this one, overwrites the real rows.
    for c in tl.range(0, fill_per_program, CHUNK):
        rows = g * fill_per_program + c + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < max_padded)


@triton.jit(do_not_specialize=["num_groups", "max_blocks"])
def _moe_offsets_kernel(
    partial_ptr,  # [num_groups, E_POW2] int32 in: counts; out: first row of each chunk's run
    block_expert_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_groups,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    G_CHUNK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    offs_e = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], tl.int32)
    for gc in tl.range(0, num_groups, G_CHUNK):
        gs = gc + tl.arange(0, G_CHUNK)
        tile_ptr = partial_ptr + gs[:, None] * E_POW2 + offs_e[None, :]
        counts += tl.sum(tl.load(tile_ptr, mask=gs[:, None] < num_groups, other=0), axis=0)
    padded, ends = _store_runs(
        counts, num_padded_ptr, block_expert_ptr, max_blocks, BLOCK_M, CHUNK
    )  # [E_POW2] x 2

    # A chunk's pairs of expert e start after the expert's earlier chunks' pairs.
    run = ends - padded  # [E_POW2]
    for gc in tl.range(0, num_groups, G_CHUNK):
        gs = gc + tl.arange(0, G_CHUNK)
        tile_ptr = partial_ptr + gs[:, None] * E_POW2 + offs_e[None, :]
        tile = tl.load(tile_ptr, mask=gs[:, None] < num_groups, other=0)
        first = run[None, :] + tl.cumsum(tile, axis=0) - tile
        tl.store(tile_ptr, first, mask=gs[:, None] < num_groups)
        run += tl.sum(tile, axis=0)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(
    ids_ptr,  # [num_pairs]
    first_ptr,  # [num_groups, E_POW2] int32: first row of each chunk's run of each expert
    sorted_ptr,  # [max_padded] int32 out
    num_pairs,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    g = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    offs = g * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, E_POW2]
    first = tl.load(first_ptr + g * E_POW2 + offs_e)
    rank = tl.cumsum(onehot, axis=0) - 1 + first[None, :]
    row = tl.sum(onehot * rank, axis=1)  # [CHUNK]
    tl.store(sorted_ptr + row, offs.to(tl.int32), mask=offs < num_pairs)


# Up to this many pairs one program (one launch) is faster than three: its serial loop
# costs less than two more launches while the pairs are few. Set where the two cross in
# `benchmarks/kernels_bench.py --only align` (Moonlight's 66 ids, 8 pairs a token).
MAX_PAIRS_ONE_PROGRAM = 160
ALIGN_METHODS = ("one_program", "grid", "torch")


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, method: str | None = None
) -> Alignment:
    """topk_ids: [T, k] -> Alignment (see the module docstring). `method` (one of
    ALIGN_METHODS) overrides the choice by size, for tests and the kernel benchmark."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    if method is None:
        method = "one_program" if num_pairs <= MAX_PAIRS_ONE_PROGRAM else "grid"
    if method == "grid" and num_pairs == 0:  # (the grid needs at least one chunk)
        method = "one_program"
    if method == "torch":
        return moe_align_ref(topk_ids, num_experts, block_m)
    if method not in ALIGN_METHODS:
        raise ValueError(f"moe_align: method must be one of {ALIGN_METHODS}, got {method!r}")
    max_blocks = max_blocks_bound(num_pairs, num_experts, block_m)
    dev = ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(num_experts)
    # A [CHUNK, E] one-hot tile stays within 16k elements.
    widest = max(16, min(256, 16384 // e_pow2))
    if method == "one_program":
        # No wider than the pairs need: a decode step has a handful, and the kernel's time
        # is then its tile work.
        chunk = min(widest, max(16, triton.next_power_of_2(num_pairs)))
        _moe_align_kernel[(1,)](
            ids, sorted_pairs, block_expert, num_padded, num_pairs, max_blocks,
            BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, num_warps=8 if chunk >= 128 else 4,
        )  # fmt: skip
        return Alignment(sorted_pairs, block_expert, num_padded, max_blocks)
    chunk = widest
    num_groups = triton.cdiv(num_pairs, chunk)
    partial = torch.empty(num_groups, e_pow2, dtype=torch.int32, device=dev)
    fill = triton.cdiv(triton.cdiv(max_blocks * block_m, num_groups), chunk) * chunk
    warps = 8 if chunk >= 128 else 4
    _moe_count_kernel[(num_groups,)](
        ids, partial, sorted_pairs, num_pairs, max_blocks * block_m, fill,
        E_POW2=e_pow2, CHUNK=chunk, num_warps=warps,
    )  # fmt: skip
    g_chunk = min(16384 // e_pow2, triton.next_power_of_2(num_groups))
    _moe_offsets_kernel[(1,)](
        partial, block_expert, num_padded, num_groups, max_blocks,
        BLOCK_M=block_m, E_POW2=e_pow2, G_CHUNK=max(2, g_chunk), CHUNK=chunk, num_warps=8,
    )  # fmt: skip
    _moe_scatter_kernel[(num_groups,)](
        ids, partial, sorted_pairs, num_pairs, E_POW2=e_pow2, CHUNK=chunk, num_warps=warps
    )
    return Alignment(sorted_pairs, block_expert, num_padded, max_blocks)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Torch twin of `moe_align` (same outputs, element for element); no host sync, so
    it can run inside a CUDA graph capture."""
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

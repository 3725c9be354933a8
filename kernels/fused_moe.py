"""Fused MoE in Triton: align pairs by expert, grouped gate/up GEMM with SiLU-and-mul in
its epilogue, grouped down GEMM scaled by the routing weight, then the sum over top-k.

Weights use the executor's (transformers') fused layout, so no repacking:
w13 = gate_up_proj [E, 2I, H] (gate rows first), w2 = down_proj [E, H, I].
Each BLOCK_M-row block of the aligned pairs belongs to one expert, so a program
streams that expert's weight tile once for up to BLOCK_M tokens.

Shared experts can ride along (`shared`): their gate/up rows [2 * S * I, H] and down
columns [H, S * I] are cut into S experts of the routed size I, numbered E .. E + S - 1,
which every token picks with weight 1 (`moe_router(num_shared=S)`). At decode this
replaces the shared MLP's three GEMVs, its activation and the add with nothing: its
weights stream through the same launches as the routed experts'.

FP8 experts (`fp8`: DeepSeek's block-scaled e4m3 weights) take the same launches: each
K step rounds the activation tile to e4m3 per row in registers and scales the e4m3
product by the row's and the weight block's scales (kernels/fp8_linear.py's scheme).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear import act_quant, quantize_group
from kernels.moe_align import moe_align
from kernels.reference import Fp8Scales

# (max T, config): block shapes by batch size; small T -> BLOCK_M 16 (decode: few rows per
# expert, the GEMMs stream weights); large T -> bigger tiles (tensor-core bound). Each
# BLOCK_M-row block streams its expert's weights once, so BLOCK_M grows with the pairs an
# expert gets (6T/64 for Moonlight and DeepSeek-V2-Lite): a block smaller than an
# expert's share streams its weights twice. The rows come from a sweep of configs around
# them by T (`benchmarks/kernels_bench.py --only moe_sweep`).
CONFIGS: tuple[tuple[int, dict[str, int]], ...] = (
    (32, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}),
    (128, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}),
    (256, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
    (640, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
    (1 << 62, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
)  # fmt: skip


# Batch-invariant mode uses the same table: a token's rows are reduced over K in one
# order whatever the tile (MMA k-steps in order into one float32 accumulator), so the tile
# may follow T: 16..128-row, 16..256-column tiles and 64..256 K-slices give the same bits
# (benchmarks/investigations/binv_matmul.py, and the GPU invariance tests whose batches cross every row
# of the table).
def moe_config(num_tokens: int) -> dict[str, int]:
    return next(dict(cfg) for max_t, cfg in CONFIGS if num_tokens <= max_t)


# FP8 experts: BLOCK_K is the scale group (128 for DeepSeek's checkpoints), and A_FP8 = 1
# rounds each GEMM's input rows to e4m3 once before its launch (act_quant) rather than in
# every program's K loop, where each of the N tiles rounds the same rows again and the
# rounding's registers sit beside the accumulators. Past a few tokens that repeated work
# dominates; at a few tokens the two extra launches cost more than they save. Narrower
# column tiles than bf16's: each K step's rescale holds a second [BLOCK_M, BLOCK_N]
# float32 tile. The rows come from `benchmarks/investigations/fp8_moe_sweep.py`.
FP8_CONFIGS: tuple[tuple[int, dict[str, int]], ...] = (
    (4, {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4, "A_FP8": 0}),
    (32, {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4, "A_FP8": 1}),
    (128, {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "A_FP8": 1}),
    (256, {"BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "A_FP8": 1}),
    (1 << 62, {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "A_FP8": 1}),
)  # fmt: skip


def fp8_moe_config(num_tokens: int) -> dict[str, int]:
    return next(dict(cfg) for max_t, cfg in FP8_CONFIGS if num_tokens <= max_t)


@triton.jit
def _block_ids(num_blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks sweep the N blocks together (L2 reuse)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


# Per-step sizes are runtime arguments Triton must not specialise on (value 1, divisible
# by 16), or a new value would compile a new kernel in the middle of serving: the pair
# counts, and the scale strides of A_FP8's inputs (T and T * top-k).
@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m", "stride_xsg"])
def _moe_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]
    sw_ptr,  # [2 * NUM_SHARED * N, K]: shared gate rows, then shared up rows
    act_ptr,  # [num_pairs, N]: silu(gate) * up per pair
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 pair ids
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    num_pairs,
    num_blocks_m,
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_act,
    num_routed,
    stride_swn,
    s_ptr,  # FP8: [E, 2 * up_scale_row, ceil(K / BLOCK_K)] float32, gate's blocks then up's
    stride_se,
    stride_sn,
    up_scale_row,  # FP8: the first scale row of the up half (ceil(N / BLOCK_SN))
    xs_ptr,  # A_FP8: x's scales, [T, ceil(K / BLOCK_K)] float32 at these strides
    stride_xsr,
    stride_xsg,
    NUM_SHARED: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    BLOCK_SN: tl.constexpr,
):
    pid_m, pid_n = _block_ids(num_blocks_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_mask = pairs < num_pairs
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn  # up rows follow the N gate rows
    if NUM_SHARED > 0:  # noqa: SIM102 (a constexpr test: no code without shared experts)
        if expert >= num_routed:  # slice (expert - E) of the shared MLP's rows
            rows = (expert - num_routed) * N + offs_n
            g_ptrs = sw_ptr + rows[None, :] * stride_swn + offs_k[:, None]
            u_ptrs = g_ptrs + NUM_SHARED * N * stride_swn
    sg_ptrs = s_ptr + expert * stride_se + (offs_n // BLOCK_SN) * stride_sn  # FP8 only
    su_ptrs = sg_ptrs + up_scale_row * stride_sn
    xs_ptrs = xs_ptr + tok * stride_xsr  # A_FP8 only
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if FP8:  # e4m3 x e4m3, each K step scaled by its row's and columns' scales
            if A_FP8:  # rounded once before the launch (act_quant)
                a_q = a
                a_s = tl.load(xs_ptrs + (k0 // BLOCK_K) * stride_xsg, mask=row_mask, other=0.0)
            else:
                a_q, a_s = quantize_group(a)
            sg = tl.load(sg_ptrs + k0 // BLOCK_K, mask=n_mask, other=0.0)
            su = tl.load(su_ptrs + k0 // BLOCK_K, mask=n_mask, other=0.0)
            acc_g += tl.dot(a_q, wg) * (a_s[:, None] * sg[None, :])
            acc_u += tl.dot(a_q, wu) * (a_s[:, None] * su[None, :])
        else:
            acc_g = tl.dot(a, wg, acc=acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu, acc=acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = act_ptr + pairs[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m", "stride_asg"])
def _moe_down_kernel(
    act_ptr,  # [num_pairs, K]
    w_ptr,  # [E, N, K]
    sw_ptr,  # [N, NUM_SHARED * K]: the shared MLP's down projection
    topk_w_ptr,  # [num_pairs] float32
    out_ptr,  # [num_pairs, N] float32: weighted expert output per pair
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks_m,
    N,
    K,
    stride_act,
    stride_we,
    stride_wn,
    num_routed,
    stride_swn,
    s_ptr,  # FP8: [E, ceil(N / BLOCK_SN), ceil(K / BLOCK_K)] float32
    stride_se,
    stride_sn,
    as_ptr,  # A_FP8: act's scales, [num_pairs, ceil(K / BLOCK_K)] float32 at these strides
    stride_asr,
    stride_asg,
    NUM_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    BLOCK_SN: tl.constexpr,
):
    pid_m, pid_n = _block_ids(num_blocks_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_act + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if NUM_SHARED > 0:  # noqa: SIM102 (a constexpr test: no code without shared experts)
        if expert >= num_routed:  # columns (expert - E) * K .. of the shared down weight
            cols = (expert - num_routed) * K + offs_k
            w_ptrs = sw_ptr + offs_n[None, :].to(tl.int64) * stride_swn + cols[:, None]
    s_ptrs = s_ptr + expert * stride_se + (offs_n // BLOCK_SN) * stride_sn  # FP8 only
    as_ptrs = as_ptr + rows * stride_asr  # A_FP8 only
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            if A_FP8:
                a_q = a
                a_s = tl.load(as_ptrs + (k0 // BLOCK_K) * stride_asg, mask=row_mask, other=0.0)
            else:
                a_q, a_s = quantize_group(a)
            w_s = tl.load(s_ptrs + k0 // BLOCK_K, mask=n_mask, other=0.0)
            acc += tl.dot(a_q, w) * (a_s[:, None] * w_s[None, :])
        else:
            acc = tl.dot(a, w, acc=acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(topk_w_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    part_ptr, out_ptr, N, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):  # part: [T, TOP_K, N] float32 -> out: [T, N]
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(TOP_K):
        acc += tl.load(part_ptr + (t * TOP_K + j) * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.fused_moe_ref`: x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] -> [T, H] in x.dtype.
    Weights must be contiguous in their last dim; no host synchronisation. `config`
    overrides the table's launch settings; `out` [T, H] receives the result. `shared`
    = (gate/up [2SI, H], down [H, SI]): ids E + s pick slice s of the shared MLP.
    fp8: w13 and w2 are e4m3 with these block scales; both GEMMs round their input
    rows to e4m3 per group of bk (as kernels/fp8_linear.py: in the K loop, or once
    before the launch where the config's A_FP8 says), and BLOCK_K is bk."""
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert w2.shape == (num_experts, hidden, inter)
    num_shared = 0
    sw13, sw2 = w13, w2  # unread unless shared
    if shared is not None:
        sw13, sw2 = shared
        num_shared = sw13.shape[0] // two_i
        assert sw13.shape == (num_shared * two_i, hidden) and sw13.stride(1) == 1
        assert sw2.shape == (hidden, num_shared * inter) and sw2.stride(1) == 1
    if fp8 is None and (config or {}).get("A_FP8"):
        raise ValueError("fused_moe: A_FP8 rounds the inputs of FP8 experts; these are not")
    out = torch.empty_like(x) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1
    if t == 0:
        return out
    table = moe_config(t) if fp8 is None else fp8_moe_config(t)
    cfg = dict(table, **(config or {}))
    s13, s2, block_sn = w13, w2, 1  # unread unless fp8
    a_fp8 = bool(cfg.get("A_FP8", 0))
    if fp8 is not None:
        assert shared is None, "shared experts do not ride with FP8 experts"
        s13, s2 = fp8.w13_scale, fp8.w2_scale
        block_sn, cfg["BLOCK_K"] = fp8.block
        assert s13.stride(2) == 1 and s2.stride(2) == 1 and s13.shape[1] % 2 == 0
    bm, bn, bk, gm = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    num_pairs = t * k
    al = moe_align(topk_ids, num_experts + num_shared, bm)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    # A_FP8: each GEMM's input rows rounded to e4m3 once (act_quant) instead of in every
    # program that reads them (each of the N tiles), the same rounding either way.
    xa, xs = act_quant(x, bk) if a_fp8 else (x, s13)
    _moe_gate_up_kernel[(al.max_blocks * triton.cdiv(inter, bn),)](
        xa, w13, sw13, act, al.sorted_pairs, al.block_expert, al.num_padded,
        num_pairs, al.max_blocks, inter, hidden,
        xa.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        num_experts, sw13.stride(0), s13, s13.stride(0), s13.stride(1), s13.shape[1] // 2,
        xs, xs.stride(0), xs.stride(1),
        NUM_SHARED=num_shared, TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
        PRECISION=precision, FP8=fp8 is not None, A_FP8=a_fp8, BLOCK_SN=block_sn, **launch,
    )  # fmt: skip
    part = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [T*k, H]
    weights = topk_weights.reshape(-1).float()
    aa, as_ = act_quant(act, bk) if a_fp8 else (act, s2)
    _moe_down_kernel[(al.max_blocks * triton.cdiv(hidden, bn),)](
        aa, w2, sw2, weights, part, al.sorted_pairs, al.block_expert, al.num_padded,
        num_pairs, al.max_blocks, hidden, inter,
        aa.stride(0), w2.stride(0), w2.stride(1),
        num_experts, sw2.stride(0), s2, s2.stride(0), s2.stride(1),
        as_, as_.stride(0), as_.stride(1), NUM_SHARED=num_shared,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, PRECISION=precision,
        FP8=fp8 is not None, A_FP8=a_fp8, BLOCK_SN=block_sn, **launch,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(t, triton.cdiv(hidden, block))](
        part, out, hidden, out.stride(0), TOP_K=k, BLOCK=block, num_warps=4
    )
    return out

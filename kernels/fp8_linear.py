"""FP8 block-scaled GEMM in Triton: y = x @ dequant(w).T, DeepSeek's W8A8 scheme.

The weight is float8_e4m3fn [N, K] with a float32 scale per (bn x bk) block,
`scale_inv` [ceil(N / bn), ceil(K / bk)] (DeepSeek's `weight_scale_inv`). The
activations are quantized on the fly, per row and group of bk columns (DeepSeek's
act_quant: the group's largest magnitude maps to e4m3's 448): each program loads an
x tile [BLOCK_M, bk] in its own dtype, rounds it to e4m3 in registers, and the
matrix units multiply e4m3 by e4m3 into float32; each K step's partial product is
scaled by the row's activation scale and the column's weight scale before it joins
the accumulator. So no quantized copy of x ever reaches memory, and a step reads
each weight byte once: half the bytes of a bf16 GEMM.

BLOCK_K is the scale group bk, so one K step meets one weight scale per column; the
column's scale row is n // bn, so any BLOCK_N works with any bn.

Past a few rows, where cuBLAS has a block-scaled FP8 GEMM (Hopper: 1 x 128 activation
groups, 128 x 128 weight blocks, torch._scaled_mm), x is quantized once by a small
kernel with the same rounding (`act_quant`) and cuBLAS multiplies: the per-K-step
rescale of the fused kernel above runs on the CUDA cores, cuBLAS's on the matrix
pipeline's side. A few rows stream the weight, where the fused kernel's narrow tiles do
better. Up to GEMV_MAX_ROWS rows (decode at small batches) the matrix units have little
to do: the weight must stream at memory speed, and the fused kernel's 16-row tiles and
serial K loop (one memory latency a group) leave it latency-bound. There a GEMV-shaped
kernel gives each program a few weight rows and loads many groups of K at once, each
chunk serving every row before the next is loaded: the same rounding of x per group,
the e4m3 products summed in float32 on the CUDA cores, scaled per group as above. A
row's result then depends on how many rows share the GEMM (which
kernel ran): batch-invariant callers keep the fused kernel (`allow_cublas=False`). Some
cuBLAS builds refuse a row count that is not a multiple of 16
(CUBLAS_STATUS_NOT_SUPPORTED from the heuristic); there the quantized rows are padded
with zero rows up to one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (max M, config): tiles by the number of rows. Few rows (decode): the GEMM streams
# the weight, so narrow column tiles give more programs to spread the bytes over the
# SMs; many rows: larger tiles for the matrix units.
CONFIGS: tuple[tuple[int, dict[str, int]], ...] = (
    (16, {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}),
    (64, {"BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}),
    (256, {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}),
    (1 << 62, {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}),
)  # fmt: skip


def fp8_linear_config(num_rows: int) -> dict[str, int]:
    return next(dict(cfg) for max_m, cfg in CONFIGS if num_rows <= max_m)


# Rows up to which the GEMV-shaped kernel runs (decode at batches 1-2, a batch-1 verify
# of one draft): it streams the weight once for all of them, but each row adds its
# products on the CUDA cores and requantizes x per program, so from three rows on the
# kernel is bound by instruction issue and the fused kernel's matrix units win
# (benchmarks/investigations/fp8_gemv.py measures both at each row count).
GEMV_MAX_ROWS = 2
# A GEMV program's tile: weight rows, and groups of K loaded at once (enough programs
# to spread a narrow projection's weight over the SMs, and a chunk's bytes in flight).
GEMV_BLOCK_N = 4
GEMV_GROUPS = 16
GEMV_WARPS = 4
# Rows from which cuBLAS's block-scaled GEMM takes over (where the device has it).
CUBLAS_MIN_ROWS = 17
# The row multiple that builds refusing odd row counts take.
CUBLAS_PADDED_ROWS = 16
# Per device index: the row multiple cuBLAS's block-scaled GEMM takes there (1: any
# count; CUBLAS_PADDED_ROWS: padded), or 0 where it refuses both.
_cublas_row_multiple: dict[int, int] = {}


@triton.jit
def quantize_group(a):
    """a [BLOCK_M, group] float -> (e4m3 [BLOCK_M, group], scale [BLOCK_M] float32):
    a ~= e4m3 * scale, each row's largest magnitude mapped to 448, e4m3's largest (an
    all-zero row, such as a masked one, gets scale 1)."""
    a32 = a.to(tl.float32)
    amax = tl.max(tl.abs(a32), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    return (a32 / scale[:, None]).to(tl.float8e4nv), scale


# M changes every step: Triton must not specialise on it (value 1, divisible by 16), or
# a new batch size would compile a new kernel in the middle of serving.
@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [ceil(N / BLOCK_SN), ceil(K / BLOCK_K)] float32
    b_ptr,  # [N] or unread
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    s_ptrs = s_ptr + (offs_n // BLOCK_SN) * stride_sn  # [BN]: the K step added in the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_q, a_s = quantize_group(a)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w_s = tl.load(s_ptrs + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a_q, w) * (a_s[:, None] * w_s[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [ceil(N / BLOCK_SN), ceil(K / BLOCK_K)] float32
    b_ptr,  # [N] or unread
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    M: tl.constexpr,  # the rows, at most GEMV_MAX_ROWS: one compiled kernel per count
    M_POW2: tl.constexpr,  # M rounded up to a power of two (the accumulator's rows)
    HAS_BIAS: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale group bk
    GROUPS: tl.constexpr,  # groups of K a chunk: one load of [BLOCK_N, GROUPS, BLOCK_K]
):
    """out[m, n] for BLOCK_N weight rows n and every row m. A chunk of GROUPS groups of K
    is loaded at once (all its bytes in flight together: a serial K loop of one group a
    step waits out the memory latency each step) and serves every row m before the next
    chunk, so the weight streams once whatever M; x's groups are rounded as the fused
    kernel rounds them, the e4m3 products summed per group in float32 on the CUDA cores,
    then scaled by the group's two scales."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, M_POW2)  # [MP]
    offs_g = tl.arange(0, GROUPS)  # [G]
    cols = offs_g[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [G, BK]
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + cols[None, :, :]
    s_rows = s_ptr + (offs_n // BLOCK_SN)[:, None] * stride_sn + offs_g[None, :]  # [BN, G]
    chunk = GROUPS * BLOCK_K
    acc = tl.zeros([M_POW2, BLOCK_N], tl.float32)
    for c in range(0, tl.cdiv(K, chunk)):
        k_mask = cols < K - c * chunk  # [G, BK]
        g_mask = offs_g * BLOCK_K < K - c * chunk  # [G]
        w = tl.load(
            w_rows + c * chunk, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0
        ).to(tl.float32)  # [BN, G, BK]
        w_s = tl.load(s_rows + c * GROUPS, mask=n_mask[:, None] & g_mask[None, :], other=0.0)
        for m in tl.static_range(M):
            a = tl.load(x_ptr + m * stride_xm + c * chunk + cols, mask=k_mask, other=0.0)
            a_q, a_s = quantize_group(a)  # [G, BK], [G]
            part = tl.sum(w * a_q.to(tl.float32)[None, :, :], axis=2)  # [BN, G]
            row = tl.sum(part * (w_s * a_s[None, :]), axis=1)  # [BN]
            acc = tl.where(offs_m[:, None] == m, acc + row[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] e4m3
    s_ptr,  # [ceil(K / GROUP), stride_sg] float32: the scales M-major, as cuBLAS reads 1 x GROUP
    M,
    K,
    stride_xm,
    stride_sg,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = g * GROUP + tl.arange(0, GROUP)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]  # a last group may be partial
    a = tl.load(
        x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask, other=0.0
    )
    q, scale = quantize_group(a)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + g * stride_sg + offs_m, scale, mask=offs_m < M)


def act_quant(
    x: torch.Tensor, group: int, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [R, K], scales [R, ceil(K / group)] float32, stored M-major):
    the fused kernels' rounding of each row and group (a partial last group's missing
    columns count as zeros, as the fused kernels' masked loads read them), once.
    R = rows (default M): rows past M are zeros with scale 1, for a GEMM that takes
    only some row counts."""
    m, k = x.shape
    r = m if rows is None else rows
    assert r >= m
    groups = -(-k // group)
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(groups, r, dtype=torch.float32, device=x.device)
    if r > m:
        q[m:].zero_()
        s[:, m:].fill_(1.0)
    if m:
        grid = (triton.cdiv(m, 32), groups)
        _act_quant_kernel[grid](
            x, q, s, m, k, x.stride(0), s.stride(0), BLOCK_M=32, GROUP=group, num_warps=4
        )  # fmt: skip
    return q, s.t()


def _cublas_takes(x: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> int:
    """The row multiple at which cuBLAS's block-scaled GEMM takes these shapes on x's
    device, or 0 where it does not: 128 x 128 blocks, whole blocks, a bf16 / fp16 x, and
    a device where it ran once (checked at the first call outside a CUDA graph capture:
    until then the fused kernel runs)."""
    if block != (128, 128) or n % 128 or k % 128 or x.dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return 0
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _cublas_row_multiple:
        if torch.cuda.is_current_stream_capturing():
            return 0
        _cublas_row_multiple[index] = _cublas_row_multiple_on(x.device, x.dtype)
    return _cublas_row_multiple[index]


def _cublas_row_multiple_on(device: torch.device, dtype: torch.dtype) -> int:
    """Run one small block-scaled GEMM of an odd row count, then padded: the first row
    multiple cuBLAS takes (1 or CUBLAS_PADDED_ROWS), or 0 if it refuses both."""
    x = torch.ones(CUBLAS_MIN_ROWS, 128, dtype=dtype, device=device)
    w = torch.ones(128, 128, dtype=torch.float8_e4m3fn, device=device)
    s = torch.ones(1, 1, dtype=torch.float32, device=device)
    for multiple in (1, CUBLAS_PADDED_ROWS):
        try:
            _cublas_fp8_linear(x, w, s, None, multiple)
        except (RuntimeError, TypeError, ValueError):
            continue
        return multiple
    return 0


def _cublas_fp8_linear(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    row_multiple: int,
) -> torch.Tensor:
    """x2 [M, K] -> [M, N] by torch._scaled_mm: x quantized per 1 x 128 (act_quant, its
    rows padded up to a multiple of row_multiple), the weight's 128 x 128 scales read as
    its transpose's (the weight [N, K] row-major is the column-major [K, N] operand)."""
    m = x2.shape[0]
    q, s = act_quant(x2, 128, -(-m // row_multiple) * row_multiple)
    out = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale_inv.t(), out_dtype=x2.dtype)
    out = out[:m]
    return out if bias is None else out + bias


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
    config: dict[str, int] | None = None,
    allow_cublas: bool = True,
) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32), weight [N, K] e4m3 (contiguous rows), scale_inv
    [ceil(N / bn), ceil(K / bk)] float32, bias [N] or None -> [..., N] in x.dtype.
    block = (bn, bk); bk must be a power of two >= 16 (it is the K tile). No host
    synchronisation. `config` overrides the table's tiles (benchmarks, tests; it also
    keeps the fused kernel). allow_cublas: up to GEMV_MAX_ROWS rows the GEMV-shaped
    kernel, from CUBLAS_MIN_ROWS rows on cuBLAS's block-scaled GEMM where it takes the
    shapes (`_cublas_takes`); False: the fused kernel at every row count."""
    n, k = weight.shape
    bn, bk = block
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert scale_inv.dtype == torch.float32 and scale_inv.stride(1) == 1
    assert x.shape[-1] == k and scale_inv.shape == (-(-n // bn), -(-k // bk))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if allow_cublas and config is None and m >= CUBLAS_MIN_ROWS:
        multiple = _cublas_takes(x2, n, k, block)
        if multiple:
            return _cublas_fp8_linear(x2, weight, scale_inv, bias, multiple).view(*lead, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    if allow_cublas and config is None and m <= GEMV_MAX_ROWS:
        _fp8_gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N),)](
            x2, weight, scale_inv, bias if bias is not None else scale_inv, out,
            n, k, x2.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
            M=m, M_POW2=triton.next_power_of_2(m), HAS_BIAS=bias is not None, BLOCK_SN=bn,
            BLOCK_N=GEMV_BLOCK_N, BLOCK_K=bk,
            GROUPS=GEMV_GROUPS, num_warps=GEMV_WARPS, num_stages=2,
        )  # fmt: skip
        return out.view(*lead, n)
    cfg = dict(fp8_linear_config(m), **(config or {}))
    bm, bnn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bnn),)
    _fp8_linear_kernel[grid](
        x2, weight, scale_inv, bias if bias is not None else scale_inv, out,
        m, n, k, x2.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_SN=bn, BLOCK_M=bm, BLOCK_N=bnn, BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out.view(*lead, n)

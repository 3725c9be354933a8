"""Batch-invariant matmul and log-softmax in Triton (EngineConfig.batch_invariant).

A row's result must not depend on how many other rows share the call. cuBLAS picks its
kernel (tile shape, split-K, stream-K) from M, so a token's projections change with the
batch; a Triton GEMM with ONE launch config for every M, reducing over K in a single
program in one fixed order (no split-K), computes every output element the same way
whatever M is: rows meet only in the tile, and a tensor-core MMA computes each output
element from its own row and column alone. The same holds for a row-wise log-softmax
whose chunking depends only on the row length. (Thinking Machines' batch_invariant_ops
take this route; here the ops are called explicitly, not patched into aten.)

The configs are fixed per dtype, never per shape: changing one changes every result in
this mode (and the profile measured with it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 16-bit inputs: 64 x 64 tiles give small-M (decode) GEMMs enough programs to stream the
# weights from many SMs, without split-K; K in 64-wide slices, one warpgroup (wgmma).
MATMUL_CONFIG_16BIT = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 4, "num_stages": 4}  # fmt: skip
# float32 (router logits, float32 models): IEEE dots on the CUDA cores.
MATMUL_CONFIG_FP32 = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8,
                      "num_warps": 4, "num_stages": 2}  # fmt: skip
LOG_SOFTMAX_BLOCK = 4096  # columns per chunk of a row (fixed: the sum order depends on it)


def matmul_config(dtype: torch.dtype) -> dict[str, int]:
    return dict(MATMUL_CONFIG_16BIT if dtype.itemsize <= 2 else MATMUL_CONFIG_FP32)


# M, the batch count and the batch strides (M * K for a Linear) change every step: no
# specialisation on them (a value of 1 or a multiple of 16 would otherwise compile
# another variant mid-serving, maybe inside a graph capture).
@triton.jit(do_not_specialize=["M", "NUM_BATCH", "stride_ab", "stride_bb", "stride_cb"])
def _matmul_kernel(
    a_ptr,  # [NUM_BATCH, M, K] any strides
    b_ptr,  # [NUM_BATCH, K, N] any strides
    c_ptr,  # [NUM_BATCH, M, N] any strides
    bias_ptr,  # [N] (read when HAS_BIAS)
    M,
    N,
    K,
    NUM_BATCH,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n  # grouped order: GROUP_M row tiles share B in L2
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K in this program, in order: no split-K
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N] (any strides: views of permuted tensors
    work without copies); float32 accumulation, rounded to a's dtype. `out` [B, M, N]
    (any strides) receives the result."""
    nb, m, k = a.shape
    assert b.shape[0] == nb and b.shape[1] == k, (a.shape, b.shape)
    n = b.shape[2]
    if out is None:
        out = torch.empty(nb, m, n, dtype=a.dtype, device=a.device)
    assert out.shape == (nb, m, n)
    _launch(a, b, out, None)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariantly: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k, (x.shape, weight.shape)
    x2 = x.reshape(-1, k)  # [M, K]
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    # b[k, n] = weight[n, k]: the transpose is a view.
    _launch(x2.unsqueeze(0), weight.t().unsqueeze(0), out.unsqueeze(0), bias)
    return out.view(*x.shape[:-1], n)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> None:
    nb, m, k = a.shape
    n = b.shape[2]
    if m == 0 or n == 0 or nb == 0:
        return
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1
    cfg = matmul_config(a.dtype)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), nb)
    _matmul_kernel[grid](
        a, b, c, bias if bias is not None else a, m, n, k, nb,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    """One program per row: a running max and sum per lane over BLOCK-wide chunks (the
    order fixed by N alone), combined once, then x - max - log(sum)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for c in range(0, N, BLOCK):
        x = tl.load(x_ptr + row * stride_x + c + offs, mask=c + offs < N, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    lse = row_max + tl.log(total)
    for c in range(0, N, BLOCK):
        mask = c + offs < N
        x = tl.load(x_ptr + row * stride_x + c + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c + offs, x - lse, mask=mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, N] (last dim contiguous) -> float32 log_softmax over the last dim, each row
    computed alone (the same bits whatever other rows are present)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] and x.shape[1]:
        block = min(LOG_SOFTMAX_BLOCK, triton.next_power_of_2(x.shape[1]))
        _log_softmax_kernel[(x.shape[0],)](
            x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=block, num_warps=8
        )
    return out

"""MLA prefill / chunked-context attention in Triton: varlen causal flash attention.

Each query head attends with a [Dn nope | R rope] key whose rope part is one vector per
token shared by all heads (k_pe [Tk, R], never expanded), and a Dv-wide value. The
scores are two dots accumulated into one tile: q_nope k_nope^T + q_pe k_pe^T.

One program computes BLOCK_M queries of one request and one head (FA2: online softmax
over key tiles, fp32 accumulation, base-2 exponentials with the scale folded into
log2(e)). Causality is bottom-right aligned: query i of a request with len_q queries
and len_k keys sees keys [0, len_k - len_q + i]. Key tiles that every row of the
program sees whole take no mask; the one or two tiles crossing the diagonal are masked
(a uniform branch inside the single key loop); tiles past the last row's diagonal are
never visited.

Grid: (query tile, request, head), query tiles fastest and heaviest (last) first, so
the programs of one (request, head) run together, share its K/V in L2, and the long
tiles are not left for the tail. Programs past a request's queries return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import check_prefill_bound

LOG2E = 1.4426950408889634


@triton.jit
def _mla_prefill_kernel(
    qn_ptr,  # [Tq, H, Dn]
    qp_ptr,  # [Tq, H, R]
    kn_ptr,  # [Tk, H, Dn]
    kp_ptr,  # [Tk, R]
    v_ptr,  # [Tk, H, Dv]
    out_ptr,  # [Tq, H, Dv]
    cu_q_ptr,  # [B + 1]
    cu_k_ptr,  # [B + 1]
    qk_scale,  # softmax scale * log2(e)
    stride_qnt,
    stride_qnh,
    stride_qpt,
    stride_qph,
    stride_knt,
    stride_knh,
    stride_kpt,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    Dn: tl.constexpr,
    R: tl.constexpr,
    Dv: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest query tiles first
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    len_q = (tl.load(cu_q_ptr + b + 1) - q_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= len_q:
        return
    k_start = tl.load(cu_k_ptr + b)
    len_k = (tl.load(cu_k_ptr + b + 1) - k_start).to(tl.int32)
    first_visible = len_k - len_q  # keys before the request's first query (cached context)

    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    offs_dn = tl.arange(0, Dn)
    offs_r = tl.arange(0, R)
    offs_dv = tl.arange(0, Dv)
    row_ok = (m0 + offs_m < len_q)[:, None]
    tok0 = (q_start + m0).to(tl.int64)  # token offsets can pass 2^31 elements
    qn_ptrs = qn_ptr + tok0 * stride_qnt + h * stride_qnh + offs_m[:, None] * stride_qnt
    qp_ptrs = qp_ptr + tok0 * stride_qpt + h * stride_qph + offs_m[:, None] * stride_qpt
    q_nope = tl.load(qn_ptrs + offs_dn[None, :], mask=row_ok, other=0.0)  # [BLOCK_M, Dn]
    q_pe = tl.load(qp_ptrs + offs_r[None, :], mask=row_ok, other=0.0)  # [BLOCK_M, R]

    # Row i sees keys <= first_visible + m0 + i (rows past len_q: all keys, never stored).
    last_key = tl.minimum(first_visible + m0 + offs_m, len_k - 1)  # [BLOCK_M]
    diag = first_visible + m0  # tiles wholly at or before this key need no mask
    end = tl.minimum(first_visible + m0 + BLOCK_M, len_k)  # past the last row's diagonal
    k0 = k_start.to(tl.int64)
    kn_base = kn_ptr + h * stride_knh
    v_base = v_ptr + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running maxima (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # softmax denominators
    acc = tl.zeros([BLOCK_M, Dv], tl.float32)
    for n0 in tl.range(0, end, BLOCK_N, num_stages=NUM_STAGES):
        tok = k0 + n0  # int64
        n_ok = (n0 + offs_j < end)[:, None]
        kn_ptrs = kn_base + tok * stride_knt + offs_j[:, None] * stride_knt + offs_dn[None, :]
        kp_ptrs = kp_ptr + tok * stride_kpt + offs_j[:, None] * stride_kpt + offs_r[None, :]
        k_nope = tl.load(kn_ptrs, mask=n_ok, other=0.0)  # [BLOCK_N, Dn]
        k_pe = tl.load(kp_ptrs, mask=n_ok, other=0.0)  # [BLOCK_N, R]
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
        s = s * qk_scale
        # A uniform branch, not a second loop: ptxas serialises the wgmmas of a kernel
        # whose accumulator flows from one dot loop into another (C7515).
        if n0 + BLOCK_N - 1 > diag:  # a tile crossing the diagonal
            s = tl.where((n0 + offs_j)[None, :] <= last_key[:, None], s, float("-inf"))
        # Every row sees key 0 (first tile), so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_base + tok * stride_vt + offs_j[:, None] * stride_vt + offs_dv[None, :]
        vv = tl.load(v_ptrs, mask=n_ok, other=0.0)  # [BLOCK_N, Dv]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(vv.dtype), vv, acc=acc, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    o_ptrs = out_ptr + tok0 * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot
    tl.store(o_ptrs + offs_dv[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok)


def default_config(dtype: torch.dtype) -> dict[str, int]:
    """Launch settings for an H200 at Dn=128, R=64, Dv=128, chosen from ptxas's resource
    report for sm_90a rather than by a timing sweep. 16-bit: 128-row tiles over two
    warpgroups (wgmma), 64-key tiles, three K/V buffers: 168 KB of shared memory, ~190
    registers, no spills. float32 (ieee dots, no wgmma; tests and CPU-equivalent runs):
    64 x 32 tiles over 8 warps, two buffers."""
    if dtype.itemsize <= 2:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.mla_prefill_ref`: q_nope [Tq, H, Dn],
    q_pe [Tq, H, R], k_nope [Tk, H, Dn], k_pe [Tk, R] (one rope key per token, all
    heads), v [Tk, H, Dv], cu_seqlens_q/k [B + 1] -> [Tq, H, Dv]. Every tensor's last
    dim must be contiguous (other strides are free); Dn, R, Dv powers of two >= 16.
    max_query_len: the longest request's query count (a host int: no synchronisation
    here). With queries it must be positive (ValueError otherwise, as in the twin: see
    `check_prefill_bound`); a positive value below the true maximum leaves rows
    unwritten. `config` overrides `default_config`; `out` [Tq, H, Dv] receives the result."""
    tq, h, dn = q_nope.shape
    rope, dv = q_pe.shape[-1], v.shape[-1]
    assert q_pe.shape == (tq, h, rope) and k_nope.shape[1:] == (h, dn)
    assert k_pe.shape == (k_nope.shape[0], rope) and v.shape == (k_nope.shape[0], h, dv)
    for t in (q_nope, q_pe, k_nope, k_pe, v):
        assert t.stride(-1) == 1, "last dims must be contiguous"
    for d in (dn, rope, dv):
        assert d >= 16 and d & (d - 1) == 0, "head dims must be powers of two >= 16"
    if out is None:
        out = torch.empty(tq, h, dv, dtype=q_nope.dtype, device=q_nope.device)
    assert out.shape == (tq, h, dv) and out.stride(2) == 1
    num_reqs = cu_seqlens_q.shape[0] - 1
    check_prefill_bound(tq, num_reqs, max_query_len)
    if tq == 0:
        return out
    cfg = dict(default_config(q_nope.dtype), **(config or {}))
    precision = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_M"]), num_reqs, h)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        Dn=dn, R=rope, Dv=dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        PRECISION=precision, NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out

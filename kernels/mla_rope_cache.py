"""MLA's per-token prologue in one Triton program per token: RoPE on the query's rope
part (in place, every head), RMSNorm of the compressed KV, RoPE on the shared rope
key, and the write of [normed c_kv | rotated k_pe] into the paged latent cache.

In torch these are some 25 small kernels per layer (casts, strided slices, products,
a stack, a cat, an index_copy): at decode batch sizes, where every one costs a
launch even under CUDA graphs, they add up to about a quarter of the step.
Rounding follows the torch twin (`kernels.reference.mla_rope_cache_ref`): RoPE in
float32 rounded to the activation dtype; RMSNorm as executors.models.layers.RMSNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, c, s):
    """One RoPE rotation of the pairs (x1, x2) by cos c, sin s, all float32."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _mla_rope_cache_kernel(
    q_ptr,  # [T, H, R] view: the query's rope part, rotated in place
    kv_ptr,  # [T, L + R]: c_kv then k_pe (kv_a_proj_with_mqa's output)
    w_ptr,  # [L] kv_a_layernorm weight
    cos_ptr,  # [T, R / 2] float32
    sin_ptr,  # [T, R / 2] float32
    cache_ptr,  # [N * PAGE, L + R] contiguous
    slot_ptr,  # [T] int64
    num_heads,
    eps,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_cs,
    L: tl.constexpr,
    R: tl.constexpr,
    H_POW2: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, R // 2)
    c = tl.load(cos_ptr + t * (R // 2) + half)
    s = tl.load(sin_ptr + t * (R // 2) + half)
    # Pair i is (2i, 2i + 1) interleaved, else (i, i + R / 2).
    if INTERLEAVE:
        first, second = 2 * half, 2 * half + 1
    else:
        first, second = half, half + R // 2
    dst = cache_ptr + tl.load(slot_ptr + t) * stride_cs

    # Compressed KV: RMSNorm in float32, rounded, then the weight (a product in dtype).
    offs_l = tl.arange(0, L)
    x = tl.load(kv_ptr + t * stride_kvt + offs_l).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / L + eps)
    y = (x * rstd).to(kv_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.load(w_ptr + offs_l).to(tl.float32)
    tl.store(dst + offs_l, y.to(kv_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))

    # Shared rope key.
    k_row = kv_ptr + t * stride_kvt + L
    k1, k2 = _rotate(
        tl.load(k_row + first).to(tl.float32), tl.load(k_row + second).to(tl.float32), c, s
    )
    tl.store(dst + L + first, k1.to(kv_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))
    tl.store(dst + L + second, k2.to(kv_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))

    # Query rope parts of every head, in place: [H_POW2, R / 2] tiles.
    heads = tl.arange(0, H_POW2)
    h_ok = (heads < num_heads)[:, None]
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q1 = tl.load(q_row + first[None, :], mask=h_ok, other=0.0)
    q2 = tl.load(q_row + second[None, :], mask=h_ok, other=0.0)
    r1, r2 = _rotate(q1.to(tl.float32), q2.to(tl.float32), c[None, :], s[None, :])
    tl.store(q_row + first[None, :], r1.to(q1.dtype), mask=h_ok)
    tl.store(q_row + second[None, :], r2.to(q1.dtype), mask=h_ok)


def mla_rope_cache(
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleave: bool,
) -> None:
    """Same contract as `kernels.reference.mla_rope_cache_ref`: q_pe [T, H, R] (a view,
    rotated in place), kv [T, L + R], cos/sin [T, R / 2] float32, kv_cache
    [N, block_size, L + R] (contiguous; written at slot_mapping [T]). L and R must be
    powers of two. No host synchronisation."""
    t, h, rope = q_pe.shape
    lat = kv.shape[1] - rope
    assert kv_cache.is_contiguous() and kv_cache.shape[-1] == lat + rope
    assert q_pe.stride(2) == 1 and kv.stride(1) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (t, rope // 2)
    if t == 0:
        return
    _mla_rope_cache_kernel[(t,)](
        q_pe, kv, norm_weight, cos, sin, kv_cache, slot_mapping,
        h, eps, q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv_cache.shape[-1],
        L=lat, R=rope, H_POW2=triton.next_power_of_2(h), INTERLEAVE=interleave,
        num_warps=4 if h * rope <= 4096 else 8,
    )  # fmt: skip

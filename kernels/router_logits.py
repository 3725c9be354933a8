"""The MoE router's float32 logits: the tile products the router kernel runs inside it
(`logits_dot` on the tensor cores for 16-token tiles, `logits_fma` on the CUDA cores
for a few tokens), and, for decode-sized steps, a kernel that computes them over many
SMs at once (`router_logits`), ahead of the selection kernel of kernels/moe_router.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Up to this many tokens float32 logits come from `_router_logits_kernel` (a program per
# SPLIT_LOGITS_BLOCK_E experts: 32 programs for Moonlight's 64, 128 for V3's 256).
SPLIT_LOGITS_MAX_TOKENS = 8
SPLIT_LOGITS_BLOCK_E = 2


@triton.jit
def logits_dot(x_ptrs, w_ptrs, t_mask, e_mask, H, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
                E_POW2: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """logits [BLOCK_T, E_POW2] = x . w^T over H in BLOCK_H slices, float32 accumulation."""
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_T, E_POW2], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_mask = offs_h < H - h0
        a = tl.load(x_ptrs, mask=t_mask[:, None] & h_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=e_mask[:, None] & h_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc=acc, input_precision="ieee")
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit
def logits_fma(x_ptrs, w_ptrs, t_mask, e_mask, H, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr,
                BLOCK_H: tl.constexpr):  # fmt: skip
    """The same for a few tokens on the CUDA cores: exact float32 products accumulated per
    hidden lane, [BLOCK_T, E_POW2, BLOCK_H], summed over the lanes once at the end. The
    tiles are loaded as 3-D slices of that shape, so loads and products share a layout."""
    offs_h = tl.arange(0, BLOCK_H)[None, None, :]
    x3 = x_ptrs[:, None, :]  # [BLOCK_T, 1, BLOCK_H]
    w3 = w_ptrs[None, :, :]  # [1, E_POW2, BLOCK_H]
    x_mask = t_mask[:, None, None]
    w_mask = e_mask[None, :, None]
    acc = tl.zeros([BLOCK_T, E_POW2, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_mask = offs_h < H - h0
        a = tl.load(x3, mask=x_mask & h_mask, other=0.0).to(tl.float32)
        w = tl.load(w3, mask=w_mask & h_mask, other=0.0).to(tl.float32)
        acc += a * w
        x3 += BLOCK_H
        w3 += BLOCK_H
    return tl.sum(acc, axis=2)


@triton.jit(do_not_specialize=["T"])
def _router_logits_kernel(
    x_ptr,  # [T, H], T <= BLOCK_T
    w_ptr,  # [E, H] gate weight
    out_ptr,  # [T, E] float32 logits
    T,
    E,
    H,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Float32 logits of a few tokens, BLOCK_E experts a program: the gate weight streams
    through E / BLOCK_E SMs at once. The products are the fused path's (`logits_fma`)."""
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :]  # [BLOCK_T, BLOCK_H]
    rows = offs_e[:, None].to(tl.int64) * stride_we
    w_ptrs = w_ptr + rows + offs_h[None, :]  # [BLOCK_E, BLOCK_H]
    acc = logits_fma(x_ptrs, w_ptrs, t_mask, e_mask, H, BLOCK_T, BLOCK_E, BLOCK_H)
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_e[None, :]
    tl.store(out_ptrs, acc, mask=t_mask[:, None] & e_mask[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (T <= SPLIT_LOGITS_MAX_TOKENS, any float dtype), weight [E, H] -> float32
    logits [T, E]: x and weight upcast, exact float32 products summed per hidden lane."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    assert t <= SPLIT_LOGITS_MAX_TOKENS and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
    block_t = triton.next_power_of_2(max(t, 1))
    block_e = SPLIT_LOGITS_BLOCK_E
    # A [BLOCK_T, BLOCK_E, BLOCK_H] accumulator of at most 4k elements (32 a thread).
    block_h = max(16, min(triton.next_power_of_2(hidden), 4096 // (block_t * block_e)))
    _router_logits_kernel[(triton.cdiv(num_experts, block_e),)](
        x, weight, out, t, num_experts, hidden, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out

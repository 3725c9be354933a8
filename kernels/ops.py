"""The kernels' public entry points: the Triton kernel on CUDA, the torch twin elsewhere.

The `backend=` argument chooses: `auto` (default: Triton for CUDA tensors), `torch`
(always the twin) or `triton` (always the kernel; on the CPU only under
TRITON_INTERPRET=1). The executor passes DEEPINFER_KERNEL_BACKEND, read by
deepinfer.envs. Triton modules are imported on first use, so the CPU path never
compiles anything.
"""

from __future__ import annotations

import torch

from kernels.reference import (
    fused_add_rmsnorm_ref,
    fused_moe_ref,
    mla_decode_ref,
    rmsnorm_ref,
)

BACKENDS = ("auto", "torch", "triton")


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on `tensor` takes the Triton kernel."""
    choice = backend or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return tensor.is_cuda
    return choice == "triton"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """q: [T, H, L + R], kv_cache: [N, block_size, L + R] -> [T, H, L] (absorbed MLA)."""
    rope = q.shape[-1] - kv_lora_rank
    shapes_ok = _is_pow2(kv_lora_rank) and _is_pow2(rope) and _is_pow2(kv_cache.shape[1])
    if shapes_ok and use_triton(q, backend):
        from kernels.mla_decode import mla_decode

        return mla_decode(q, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank, scale)
    return mla_decode_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank, scale)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """x: [T, H], w13: [E, 2I, H], w2: [E, H, I], topk_*: [T, k] -> [T, H]."""
    if use_triton(x, backend):
        from kernels.fused_moe import fused_moe as triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str | None = None
) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H]."""
    if use_triton(x, backend):
        from kernels.rmsnorm import rmsnorm as triton_rmsnorm

        return triton_rmsnorm(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(x + residual), x + residual); x, residual: [..., H]."""
    if use_triton(x, backend):
        from kernels.rmsnorm import fused_add_rmsnorm as triton_fused_add_rmsnorm

        return triton_fused_add_rmsnorm(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)

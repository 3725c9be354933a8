"""The kernels' public entry points: the Triton kernel on CUDA, the torch twin elsewhere.

The one place where a kernel is chosen: the models and the attention code call these
ops and nothing else. The `backend=` argument chooses: `auto` (Triton for CUDA
tensors), `torch` (always the twin) or `triton` (always the kernel; on the CPU only
under TRITON_INTERPRET=1). Left at None (what the executor does), it is
DEEPINFER_KERNEL_BACKEND, read here through deepinfer.envs on every call (default
`auto`). An op whose shapes the kernel cannot take falls back to the twin, except in
batch-invariant mode (`batch_invariant=` / `keys_per_split=`): the twins are not
batch-invariant, so there it is a ValueError (`_require_triton`). Triton
modules are imported on first use, so the CPU path never compiles anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import envs
from kernels.reference import (
    Fp8Scales,
    apply_token_bitmask_ref,
    fp8_linear_ref,
    fused_add_rmsnorm_ref,
    fused_moe_ref,
    mla_decode_ref,
    mla_prefill_ref,
    mla_rope_cache_ref,
    moe_router_ref,
    rmsnorm_ref,
)

# FP8 weights' block layout, which the models fill and read (no kernel choice in them).
from kernels.reference import dequantize_blocks as dequantize_blocks  # noqa: E402
from kernels.reference import quantize_blocks as quantize_blocks  # noqa: E402

BACKENDS = ("auto", "torch", "triton")


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on `tensor` takes the Triton kernel. backend=None reads
    DEEPINFER_KERNEL_BACKEND (deepinfer.envs.kernel_backend)."""
    choice = envs.kernel_backend() if backend is None else backend
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return tensor.is_cuda
    return choice == "triton"


def warmup_token_counts(max_tokens: int) -> list[int]:
    """Token counts whose steps, run once each, compile every kernel variant a step of up
    to `max_tokens` tokens can need: launch settings are step functions of the token
    count (powers of two, and the thresholds of the kernels' config tables), so each
    interval between thresholds is visited. Only meaningful on CUDA (imports Triton)."""
    from kernels.fp8_linear import CONFIGS as FP8_CONFIGS
    from kernels.fp8_linear import CUBLAS_MIN_ROWS, GEMV_MAX_ROWS
    from kernels.fused_moe import CONFIGS
    from kernels.moe_router import ROUTER_THRESHOLDS

    edges = {1 << i for i in range(max_tokens.bit_length() + 1)}
    edges |= {max_t for max_t, _ in CONFIGS} | set(ROUTER_THRESHOLDS)
    edges |= {max_m for max_m, _ in FP8_CONFIGS} | {CUBLAS_MIN_ROWS}
    edges |= set(range(1, GEMV_MAX_ROWS + 1))  # (the GEMV compiles once per row count)
    counts = {n for e in edges for n in (e, e + 1)}
    return sorted(n for n in counts if 1 <= n <= max_tokens)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _require_triton(op: str, tensor: torch.Tensor, backend: str | None, shapes_ok: bool) -> None:
    """Batch-invariant mode has no fallback: the torch twins are not batch-invariant."""
    if not use_triton(tensor, backend):
        raise ValueError(
            f"batch-invariant {op}: needs the Triton kernels (CUDA tensors, "
            f"DEEPINFER_KERNEL_BACKEND auto or triton); got a {tensor.device.type} tensor "
            f"with backend {backend or envs.kernel_backend()!r}"
        )
    if not shapes_ok:
        raise ValueError(f"batch-invariant {op}: the Triton kernel cannot take these shapes")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """F.linear: x [..., K], weight [N, K] -> [..., N]. batch_invariant: a Triton GEMM
    whose K reduction order is fixed by K alone (kernels.batch_invariant), so a row's
    result never depends on the other rows; otherwise cuBLAS."""
    if not batch_invariant:
        return F.linear(x, weight, bias)
    _require_triton("linear", x, backend, True)
    from kernels.batch_invariant import linear as bi_linear

    return bi_linear(x, weight, bias)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
    backend: str | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [..., K] @ a block-scaled e4m3 weight [N, K] (scale_inv [ceil(N / bn),
    ceil(K / bk)], block = (bn, bk)) -> [..., N] in x.dtype. The kernel
    (kernels/fp8_linear.py) rounds x to e4m3 per row and group of bk on the fly (past a
    few rows, cuBLAS's block-scaled GEMM on the same rounding, unless batch_invariant:
    the fused kernel's K order is fixed by K alone); the twin dequantizes the weight and
    multiplies in float32. The kernel needs bk a power of two >= 32 (its K tile; e4m3
    matrix instructions take K in steps of 32)."""
    shapes_ok = _is_pow2(block[1]) and block[1] >= 32
    if batch_invariant:
        _require_triton("fp8 linear", x, backend, shapes_ok)
    if shapes_ok and use_triton(x, backend):
        from kernels.fp8_linear import fp8_linear as triton_fp8_linear

        return triton_fp8_linear(
            x, weight, scale_inv, bias, block, allow_cublas=not batch_invariant
        )
    return fp8_linear_ref(x, weight, scale_inv, bias, block)


def bmm(
    a: torch.Tensor, b: torch.Tensor, batch_invariant: bool = False, backend: str | None = None
) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]; batch_invariant as in `linear`."""
    if not batch_invariant:
        return torch.bmm(a, b)
    _require_triton("bmm", a, backend, True)
    from kernels.batch_invariant import bmm as bi_bmm

    return bi_bmm(a, b)


def log_softmax(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [R, N] -> float32 log_softmax over N; batch_invariant: one Triton program per
    row, a fixed chunking (kernels.batch_invariant)."""
    if not batch_invariant:
        return x.float().log_softmax(dim=-1)
    _require_triton("log_softmax", x, None, True)
    from kernels.batch_invariant import log_softmax as bi_log_softmax

    return bi_log_softmax(x.contiguous())


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    backend: str | None = None,
    keys_per_split: int | None = None,
    q_pe: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache (the FlashMLA interface).

    q: [T, H, L + R] (W_UK folded into the nope part), or [T, H, L] with the rope part
    q_pe [T, H, R] given apart (the kernel reads both, no join), kv_cache: [N, block_size, L + R],
    block_tables: [B, max_blocks], seq_lens: [B], query_start_loc: [B + 1] -> [T, H, L]
    (still latent: the caller applies W_UV). Keys are whole cache entries, values their
    first L dims; query i of a request with q_len queries sees keys up to
    seq_len - q_len + i. The kernel needs L, R and block_size powers of two.
    keys_per_split (batch-invariant mode): every query reduces over its keys in pieces
    of this many, merged in order, whatever the batch (`mla_decode`); the kernel only."""
    rope = q.shape[-1] - kv_lora_rank if q_pe is None else q_pe.shape[-1]
    shapes_ok = _is_pow2(kv_lora_rank) and _is_pow2(rope) and _is_pow2(kv_cache.shape[1])
    if keys_per_split is not None:
        _require_triton("mla_decode_attention", q, backend, shapes_ok)
    if shapes_ok and use_triton(q, backend):
        from kernels.mla_decode import mla_decode

        return mla_decode(
            q, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank, scale,
            keys_per_split=keys_per_split, q_pe=q_pe,
        )  # fmt: skip
    if q_pe is not None:
        q = torch.cat([q, q_pe], dim=-1)
    return mla_decode_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank, scale)


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
    backend: str | None = None,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_nope [Tq, H, Dn], q_pe [Tq, H, R], k_nope [Tk, H, Dn], k_pe [Tk, R],
    v [Tk, H, Dv] -> [Tq, H, Dv] (varlen causal, bottom-right aligned), written into
    `out` [Tq, H, Dv] (last dim contiguous) where given. The kernel needs
    Dn, R, Dv powers of two >= 16 (tl.dot's smallest K) and contiguous last dims.
    max_query_len: the longest request's query count, a host int (the kernel's grid; it
    is never derived from cu_seqlens_q, which would be a host sync). With Tq > 0 it must
    be positive: both backends raise ValueError otherwise (`check_prefill_bound`).
    batch_invariant: the kernel only (its key tiles start at each request's key 0, so a
    query reduces over the same tiles in the same order however its prompt was chunked)."""
    args = (q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_query_len, scale)
    dims = (q_nope.shape[-1], q_pe.shape[-1], v.shape[-1])
    shapes_ok = all(_is_pow2(d) and d >= 16 for d in dims)
    if batch_invariant:
        _require_triton("mla_prefill_attention", q_nope, backend, shapes_ok)
    if shapes_ok and use_triton(q_nope, backend):
        from kernels.mla_prefill import mla_prefill

        return mla_prefill(*args, out=out)
    if out is None:
        return mla_prefill_ref(*args)
    return out.copy_(mla_prefill_ref(*args))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
    batch_invariant: bool = False,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: Fp8Scales | None = None,
) -> torch.Tensor:
    """x: [T, H], w13: [E, 2I, H], w2: [E, H, I], topk_*: [T, k] -> [T, H].
    batch_invariant: the Triton kernel (its rows never depend on T: kernels/fused_moe.py).
    shared = (gate/up [2SI, H], down [H, SI]) of a shared MLP: ids E .. E + S - 1 stand
    for its S slices of I features (`moe_router(num_shared=S)` adds them).
    fp8: w13 and w2 are block-scaled e4m3 (the kernel needs bk a power of two >= 32, as
    `fp8_linear`'s; with FP8 experts no shared MLP rides along)."""
    if batch_invariant:
        _require_triton("fused_moe", x, backend, fp8 is None)
    shapes_ok = fp8 is None or (_is_pow2(fp8.block[1]) and fp8.block[1] >= 32)
    if shapes_ok and use_triton(x, backend):
        from kernels.fused_moe import fused_moe as triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids, shared=shared, fp8=fp8)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared, fp8)


def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    normalise: bool,
    scale_after_norm: bool,
    routed_scaling_factor: float,
    backend: str | None = None,
    batch_invariant: bool = False,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H], weight: [E, H], bias: [E] or None -> (weights [T, k] float32, ids [T, k]
    int64); see `kernels.reference.moe_router_ref`. The kernel holds up to 256 experts.
    batch_invariant: float32 logits from the batch-invariant GEMM, fixed token tiles.
    num_shared: S columns more, ids E .. E + S - 1 of weight 1 (`fused_moe`'s `shared`)."""
    args = (x, weight, bias, top_k, scoring, topk_method, n_group, topk_group, normalise,
            scale_after_norm, routed_scaling_factor)  # fmt: skip
    if batch_invariant:
        _require_triton("moe_router", x, backend, weight.shape[0] <= 256)
    if weight.shape[0] <= 256 and use_triton(x, backend):
        from kernels.moe_router import moe_router as triton_moe_router

        return triton_moe_router(*args, batch_invariant=batch_invariant, num_shared=num_shared)
    weights, ids = moe_router_ref(*args)
    if num_shared:
        t, e = x.shape[0], weight.shape[0]
        ids = torch.cat([ids, torch.arange(e, e + num_shared, device=x.device).expand(t, -1)], 1)
        weights = torch.cat([weights, weights.new_ones(t, num_shared)], 1)
    return weights, ids


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
    backend: str | None = None,
) -> None:
    """q_pe [T, H, R] rotated in place; RMSNorm(c_kv) | RoPE(k_pe) of kv [T, L + R]
    written into kv_cache [N, block_size, L + R] at slot_mapping [T]."""
    rope = q_pe.shape[-1]
    lat = kv.shape[-1] - rope
    shapes_ok = _is_pow2(lat) and _is_pow2(rope) and kv_cache.is_contiguous()
    args = (q_pe, kv, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave)
    if shapes_ok and use_triton(kv, backend):
        from kernels.mla_rope_cache import mla_rope_cache as triton_mla_rope_cache

        return triton_mla_rope_cache(*args)
    return mla_rope_cache_ref(*args)


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor,
    vocab_size: int,
    backend: str | None = None,
) -> None:
    """In place: the tokens bitmask[r] does not allow get -inf in logits[r], for each r in
    rows. logits: [N, >= vocab_size] float; bitmask: [N, ceil(vocab_size / 32)] int32
    (xgrammar's layout); rows: [R] int64; all on logits' device."""
    if use_triton(logits, backend):
        from kernels.token_mask import apply_token_bitmask as triton_apply_token_bitmask

        triton_apply_token_bitmask(logits, bitmask, rows, vocab_size)
        return
    apply_token_bitmask_ref(logits, bitmask, rows, vocab_size)

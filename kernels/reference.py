"""Torch reference twins of the Triton kernels: same signatures, same semantics.

Each twin computes in float32 (float64 when given float64 inputs, which is how the
tests build their high-precision references) and returns the input dtype. They are
the CPU path of `kernels.ops` and the baseline the benchmarks compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache (MQA: one latent KV for all heads).

    q: [T, H, L + R], kv_cache: [N, block_size, L + R], block_tables: [B, max_blocks],
    seq_lens: [B], query_start_loc: [B + 1] -> [T, H, L]. Query i of a request with
    q_len queries sees keys [0, seq_len - q_len + i].
    """
    t, h, d = q.shape
    b = block_tables.shape[0]
    block_size = kv_cache.shape[1]
    acc = _acc_dtype(q.dtype)
    max_blocks = block_tables.shape[1]
    # Every request's pages, flattened: [B, max_blocks * block_size, D]
    kv = kv_cache[block_tables.long()].reshape(b, max_blocks * block_size, d).to(acc)
    req_of = torch.searchsorted(
        query_start_loc[1:].long(), torch.arange(t, device=q.device), right=True
    )  # [T]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [B]
    row = torch.arange(t, device=q.device) - query_start_loc[req_of].long()  # [T]
    last_visible = seq_lens.long()[req_of] - q_lens[req_of] + row  # [T]
    kv_t = kv[req_of]  # [T, S, D]
    scores = torch.einsum("thd,tsd->ths", q.to(acc), kv_t) * scale  # [T, H, S]
    key_pos = torch.arange(kv.shape[1], device=q.device)
    visible = key_pos[None, :] <= last_visible[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("ths,tsl->thl", probs, kv_t[..., :kv_lora_rank])  # [T, H, L]
    return out.to(q.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].

    x: [T, H], w13: [E, 2I, H] (gate rows first), w2: [E, H, I], topk_weights: [T, k],
    topk_ids: [T, k] -> [T, H] in x.dtype (accumulated in float32).
    """
    t, k = topk_ids.shape
    acc = _acc_dtype(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_w = topk_weights.reshape(-1).to(acc)
    out = torch.zeros(t, x.shape[1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tok = pairs // k
        gate, up = F.linear(x[tok].to(acc), w13[e].to(acc)).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[e].to(acc))  # [n, H]
        out.index_add_(0, tok, y * flat_w[pairs, None])
        start += n
    return out.to(x.dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) with the norm in float32, cast back before
    scaling (transformers' order, as executors.models.layers.RMSNorm). x: [..., H]."""
    xf = x.to(_acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x.dtype); returns (rmsnorm(new_residual), new_residual)."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual

"""Multi-head Latent Attention over a paged latent KV cache.

Per token the cache holds `kv_lora_rank + qk_rope_head_dim` values: the
normalised compressed KV `c_kv` and the rotated shared key `k_pe`. Decode
requests attend in the absorbed form (W_UK folded into q, W_UV applied to the
latent output); prefill chunks decompress the gathered latent with kv_b_proj
and attend with full per-head K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_config import ModelConfig
from executors.attention import AttentionMetadata, gather_latent_cache
from executors.models.layers import Linear, RMSNorm, fuse_linears, linear
from executors.models.rope import softmax_scale
from kernels import ops as kernel_ops


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.num_heads = h
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.kv_entry_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(h * self.v_dim, hidden, bias=bias)
        # fuse(): one GEMM for the projections of x (q or q_a, and kv_a): [Nq + L + R, hidden]
        # (non-persistent buffers: not in the checkpoint, but moved with the model)
        self.in_proj_weight: torch.Tensor | None
        self.in_proj_bias: torch.Tensor | None
        self.in_proj_scale: torch.Tensor | None  # FP8: the two linears' block scales
        self.register_buffer("in_proj_weight", None, persistent=False)
        self.register_buffer("in_proj_bias", None, persistent=False)
        self.register_buffer("in_proj_scale", None, persistent=False)
        # Batch-invariant mode (executors/batch_invariant.py): the absorbed products run on
        # the fixed-config GEMM and decode attention cuts keys at multiples of this.
        self.batch_invariant = False
        self.decode_keys_per_split: int | None = None

    def fuse(self) -> None:
        """Make the two projections of x (q_proj or q_a_proj, and kv_a_proj_with_mqa) views
        of one weight, computed by one GEMM (layers.fuse_linears). Left apart when only
        one has a bias (attention_bias without q LoRA: q_proj never has one), or where
        fuse_linears cannot hold them (FP8 scale blocks that would straddle the two)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if (first.bias is None) != (self.kv_a_proj_with_mqa.bias is None):
            return
        fused = fuse_linears([first, self.kv_a_proj_with_mqa])
        if fused is not None:
            self.in_proj_weight, self.in_proj_bias = fused.weight, fused.bias
            self.in_proj_scale = fused.scale_inv

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, hidden]; kv_cache: [num_blocks, block_size, L + R] (written) -> [T, hidden]."""
        q = self.project(x, cos_sin, md.slot_mapping, kv_cache)
        return self.o_proj(self.attend(q, md, kv_cache).flatten(1))

    def project(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Everything before attention proper, none of it data-dependent in shape (so a
        piecewise graph holds it): x [T, hidden] -> q [T, H, dn + R] with q_pe rotated;
        [RMSNorm(c_kv) | RoPE(k_pe)] written to the cache at `slot_mapping` [T]."""
        t = x.shape[0]
        cos, sin = cos_sin
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if self.in_proj_weight is None:
            q, kv = first(x), self.kv_a_proj_with_mqa(x)
        else:  # [T, Nq + L + R] -> views [T, Nq], [T, L + R] (rows strided)
            w, b, s = self.in_proj_weight, self.in_proj_bias, self.in_proj_scale
            both = linear(x, w, b, s, first.fp8_block, first.batch_invariant)
            q, kv = both.split([first.out_features, self.kv_a_proj_with_mqa.out_features], -1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, dn + R]
        # One op: q_pe rotated in place; [RMSNorm(c_kv) | RoPE(k_pe)] into the cache.
        kernel_ops.mla_rope_cache(
            q[..., self.nope_dim :], kv, self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps, cos, sin, kv_cache, slot_mapping, self.interleave,
        )  # fmt: skip
        return q

    def attend(
        self,
        q: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over the paged cache, shaped by the step's requests (run eagerly):
        q [T, H, dn + R] -> [T, H, dv]; decode requests first, then prefill chunks, each
        half written into its rows of `out` (contiguous [T, H, dv], e.g. the piecewise
        graphs' buffer: no join, no copy) or of a new tensor."""
        t = q.shape[0]
        if out is None:
            out = q.new_empty(t, self.num_heads, self.v_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        td = md.num_decode_tokens
        if md.num_decode_reqs > 0:
            self._decode(q_nope[:td], q_pe[:td], md, kv_cache, out[:td])
        if td < t:
            self._prefill(q_nope[td:], q_pe[td:], md, kv_cache, out[td:])
        return out

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, dn, L], W_UV [H, dv, L] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Absorbed: q_nope [Td, H, dn], q_pe [Td, H, R] -> out [Td, H, dv] (contiguous)."""
        w_uk, w_uv = self._w_uk_uv()
        if self.batch_invariant:  # per head: [H, Td, dn] @ [H, dn, L]
            q_lat = kernel_ops.bmm(q_nope.transpose(0, 1), w_uk, True).transpose(0, 1)
        else:
            # per head, written through a transposed view: [Td, H, L] comes out contiguous
            q_lat = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.kv_lora_rank)
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
        n = md.num_decode_reqs
        o_lat = kernel_ops.mla_decode_attention(
            q_lat,  # [Td, H, L], and q_pe [Td, H, R] read where it lies
            kv_cache,
            md.block_tables[:n],
            md.seq_lens[:n],
            md.query_start_loc[: n + 1],
            self.kv_lora_rank,
            self.scale,
            keys_per_split=self.decode_keys_per_split,
            q_pe=q_pe,
        )  # [Td, H, L]
        if self.batch_invariant:  # per head: [H, Td, L] @ [H, L, dv]
            o = kernel_ops.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), True)
            out.copy_(o.transpose(0, 1))
            return
        # Written through a transposed view, so [Td, H, dv] lands contiguous and o_proj
        # reads it without a copy.
        torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Full MLA: q_nope [Tp, H, dn], q_pe [Tp, H, R] -> out [Tp, H, dv] (contiguous)."""
        latent = gather_latent_cache(kv_cache, md.prefill_kv_slots)  # [S, L + R]
        s = latent.shape[0]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [S, H, dn], [S, H, dv]
        kernel_ops.mla_prefill_attention(
            q_nope, q_pe, k_nope, k_pe, v,  # k_pe: [S, R], shared by all heads
            md.prefill_cu_seqlens_q, md.prefill_cu_seqlens_k, md.prefill_max_query_len,
            self.scale, batch_invariant=self.batch_invariant, out=out,
        )  # fmt: skip

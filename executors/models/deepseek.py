"""DeepSeek V2 / V3 causal LM over one flattened varlen batch and a paged latent KV cache.

Parameter names equal the checkpoint's (transformers' fused-expert layout), so
`state_dict()` keys are what the loader fills. MTP layers (checkpoint layers
`num_hidden_layers + k`) live in `DeepseekMTP` (executors/models/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_config import ModelConfig
from executors.attention import AttentionMetadata
from executors.models.layers import GatedMLP, Linear, RMSNorm
from executors.models.mla import MLAttention
from executors.models.moe import MoE
from executors.models.rope import RotaryEmbedding
from kernels import ops as kernel_ops


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        q = self.attn_in(x, cos_sin, md.slot_mapping, kv_cache)
        return self.attn_out(self.self_attn.attend(q, md, kv_cache), x)

    def attn_in(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The layer up to attention: x [T, hidden] -> q [T, H, dn + R] (cache written)."""
        return self.self_attn.project(self.input_layernorm(x), cos_sin, slot_mapping, kv_cache)

    def attn_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o [T, H, dv], residual x [T, hidden] -> [T, hidden]."""
        h = self.self_attn.o_proj(o.flatten(1))
        norm = self.post_attention_layernorm  # with the residual add: one op (one pass)
        normed, x = kernel_ops.fused_add_rmsnorm(h, x, norm.weight, norm.eps)  # [T, hidden] x 2
        return x + self.mlp(normed)


def fuse_projections(model: nn.Module) -> None:
    """One GEMM where the checkpoint has several over one input (layers.fuse_linears): the
    MLA projections of x, and gate/up of every gated MLP (dense layers, shared experts,
    which the MoE then also runs inside its fused kernel at decode). Parameter names and
    shapes stay the checkpoint's; call after the parameters are allocated."""
    for module in model.modules():
        if isinstance(module, MLAttention | GatedMLP):
            module.fuse()


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], md, kv_caches) -> final-normed hidden [T, hidden]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.mtp: nn.Module | None = None  # set by the loader when MTP weights exist

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: per layer [num_blocks, block_size, L + R]."""
        cos_sin = self.rotary.cos_sin(positions)  # 2 x [T, R / 2]
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer, cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, md, cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

"""DeepSeek multi-token prediction (MTP) layers, for speculative decoding.

Layer k predicts one token further than layer k - 1: at position t it combines
the previous hidden state h_t (the main model's final-normed output for k = 0)
with the embedding of token t + 1 + k and runs one decoder layer:

    h' = block(eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]))    (chained as the next h)
    logits(t + 2) = head(shared_head.norm(h'))

The embedding and the output head are the main model's (the checkpoint's
per-layer copies are identical; transformers shares them the same way). Each
MTP layer attends over its own latent KV cache.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from deepinfer.model_config import ModelConfig
from executors.attention import AttentionMetadata
from executors.models.deepseek import DecoderLayer, DeepseekForCausalLM
from executors.models.layers import Linear, RMSNorm


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        # MTP blocks are MoE whenever the model has routed experts (checkpoint index >= dense).
        self.block = DecoderLayer(cfg, layer_idx)
        self.shared_head = SharedHead(cfg)


class DeepseekMTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.num_nextn_predict_layers
        self.layers = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + k) for k in range(n))

    def drafting_mlp(self) -> nn.Module:
        """The MLP of layer 0, the one the drafter chains: a MoE where the model has
        routed experts (expert parallelism exchanges its tokens in every pass)."""
        return cast(MTPLayer, self.layers[0]).block.mlp

    def forward(
        self,
        main: DeepseekForCausalLM,
        hidden: torch.Tensor,
        next_input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_cache: torch.Tensor,
        layer: int = 0,
    ) -> torch.Tensor:
        """One MTP step through layer `layer`.

        hidden: [T, hidden], the previous hidden state at positions t (the main model's
        final-normed output for the first step); next_input_ids: [T], tokens t + 1;
        positions: [T], the positions t (rotary is relative: only differences matter);
        md and kv_cache: this layer's paged latent cache. Returns the block output
        [T, hidden] (before shared_head.norm): `compute_logits` of it gives the logits
        for tokens t + 2, and it is the `hidden` of the next drafting step.
        """
        mtp = self.layers[layer]
        e = mtp.enorm(main.model.embed_tokens(next_input_ids))  # [T, hidden]
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))  # [T, hidden]
        return mtp.block(x, main.rotary.cos_sin(positions), md, kv_cache)

    def compute_logits(
        self, main: DeepseekForCausalLM, hidden: torch.Tensor, layer: int = 0
    ) -> torch.Tensor:
        """hidden: [N, hidden] from `forward` -> logits [N, vocab] float32."""
        return main.compute_logits(self.layers[layer].shared_head.norm(hidden))

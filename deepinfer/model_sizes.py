"""ModelSizes: what a DeepSeek-architecture model's shapes imply, derived once.

Parameter counts per layer and in total, weight and KV-cache bytes: what cost
models price and what sizes the KV cache. A base of `ModelConfig`; these are
cached properties, so reading them on the hot path is free.
"""

from __future__ import annotations

from functools import cached_property


class ModelSizes:
    """Derived sizes; the fields they read are ModelConfig's."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    dtype_bytes: int
    embed_dtype_bytes: int
    kv_dtype_bytes: int

    # --- layer layout -------------------------------------------------------

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` is MoE (same rule as the HF DeepseekV3 model; MTP
        layers, indexed from num_hidden_layers, follow it too)."""
        return (
            self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @cached_property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @cached_property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim  # 192

    @property
    def kv_entry_dim(self) -> int:
        """Width of one cached token per layer: compressed KV plus the shared rope key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # --- parameter counts (one layer) -----------------------------------------

    @cached_property
    def q_proj_params(self) -> int:
        """q_proj, or q_a_proj + q_a_layernorm + q_b_proj with q LoRA."""
        out = self.num_attention_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            return self.hidden_size * out
        return self.hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * out

    @cached_property
    def kv_a_params(self) -> int:
        """kv_a_proj_with_mqa [hidden -> 512 + 64] + kv_a_layernorm."""
        return self.hidden_size * self.kv_entry_dim + self.kv_lora_rank

    @cached_property
    def kv_b_params(self) -> int:
        """kv_b_proj [512 -> heads * (nope + v)]; absorbed into q / o in the decode form."""
        return (
            self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim)
        )

    @cached_property
    def o_proj_params(self) -> int:
        return self.num_attention_heads * self.v_head_dim * self.hidden_size

    @cached_property
    def attn_params(self) -> int:
        """All attention weights of one layer, plus its two RMSNorms."""
        return (
            self.q_proj_params
            + self.kv_a_params
            + self.kv_b_params
            + self.o_proj_params
            + 2 * self.hidden_size
        )

    @cached_property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @cached_property
    def expert_params(self) -> int:
        """One routed (or shared) expert: gate, up, down of width moe_intermediate_size."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @cached_property
    def router_params(self) -> int:
        return self.n_routed_experts * self.hidden_size

    @cached_property
    def moe_layer_params(self) -> int:
        return (
            self.n_routed_experts + self.n_shared_experts
        ) * self.expert_params + self.router_params

    @cached_property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @cached_property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    # --- totals -------------------------------------------------------------------

    @cached_property
    def total_params(self) -> int:
        """Parameters of the served model (MTP layers excluded, as published totals are)."""
        layers = (
            self.num_hidden_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * self.moe_layer_params
        )
        return layers + self.embed_params + self.lm_head_params + self.hidden_size

    @cached_property
    def active_params(self) -> int:
        """Parameters one token multiplies through: top-k + shared experts, lm_head included.

        The embedding table is left out: a lookup reads one row, not the matrix
        (the convention of DeepSeek's "activated parameters" figures).
        """
        moe_active = (
            self.num_experts_per_tok + self.n_shared_experts
        ) * self.expert_params + self.router_params
        return (
            self.num_hidden_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * moe_active
            + self.lm_head_params
            + self.hidden_size
        )

    @cached_property
    def mtp_params(self) -> int:
        """MTP modules as checkpoints ship them: an MoE layer, eh_proj, 3 norms, embed and head."""
        per_layer = (
            self.attn_params
            + (self.moe_layer_params if self.n_routed_experts else self.dense_mlp_params)
            + 2 * self.hidden_size * self.hidden_size  # eh_proj [2*hidden -> hidden]
            + 3 * self.hidden_size  # enorm, hnorm, shared_head.norm
            + self.embed_params
            + self.vocab_size * self.hidden_size
        )
        return self.num_nextn_predict_layers * per_layer

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes of the served weights (MTP excluded); embed and lm_head at embed_dtype_bytes."""
        table = self.embed_params + self.lm_head_params
        return (self.total_params - table) * self.dtype_bytes + table * self.embed_dtype_bytes

    @cached_property
    def mtp_weight_bytes(self) -> int:
        """Bytes the MTP layers add when they are loaded for speculative decoding."""
        table = 2 * self.embed_params * self.num_nextn_predict_layers
        return (self.mtp_params - table) * self.dtype_bytes + table * self.embed_dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """Latent KV cache of one token across all decoder layers: (512 + 64) * layers * bytes."""
        return self.kv_entry_dim * self.num_hidden_layers * self.kv_dtype_bytes

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

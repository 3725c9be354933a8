"""The demo model for training: transformers' DeepseekV3ForCausalLM plus one MTP module.

The MTP module follows the DeepSeek-V3 report (section 2.2) and the checkpoint
layout our loader and vLLM read (layer `num_hidden_layers`):

    h'_i   = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])    h_i: main model's final-normed output
    h''_i  = block(h'_i)                                       one MoE decoder layer, causal over i
    logits = head(shared_head.norm(h''_i))                     predicts t_{i+2}

The embedding and the output head are the main model's (shared, as in the report
and as executors/models/mtp.py computes it); the checkpoint still carries a copy
of the head as `shared_head.head.weight`, the way DeepSeek ships it. The block plus
`shared_head.norm` is built as a one-layer transformers `DeepseekV3Model` (its
final norm is `shared_head.norm`), so masking and rotary come from transformers'
public forward in any 5.x version; its own 1-row embedding is unused.
"""

from __future__ import annotations

import torch
from torch import nn

# The shipped architecture. Sizes keep the bf16 checkpoint (with the MTP layer and
# its head copy) under 20 MB; see README.md in the checkpoint for the counts.
MODEL_CONFIG: dict = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=512,  # the dense first layer
    moe_intermediate_size=80,  # each routed and the shared expert
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rope_interleave=True,
    rms_norm_eps=1e-6,
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    num_nextn_predict_layers=1,
)


def hf_config(attn: str = "sdpa", **overrides):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**{**MODEL_CONFIG, **overrides}, experts_implementation="eager")
    cfg._attn_implementation = attn
    return cfg


class MTPModule(nn.Module):
    """Checkpoint layer num_hidden_layers (see the module docstring)."""

    def __init__(self, attn: str = "sdpa") -> None:
        super().__init__()
        from transformers import DeepseekV3Model
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        h, eps = MODEL_CONFIG["hidden_size"], MODEL_CONFIG["rms_norm_eps"]
        self.enorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # One MoE layer (the MTP layer's index is past first_k_dense_replace); the
        # vocabulary only sizes the unused embedding.
        block = hf_config(
            attn,
            num_hidden_layers=1,
            first_k_dense_replace=0,
            vocab_size=1,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            num_nextn_predict_layers=0,
        )
        self.body = DeepseekV3Model(block)

    def forward(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [B, T, H] main final-normed states at i; next_embeds: [B, T, H] embeddings
        of t_{i+1}; position_ids: [B, T] -> [B, T, H] after shared_head.norm."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        out = self.body(inputs_embeds=x, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state


def build_models(seed: int, attn: str = "sdpa") -> tuple[nn.Module, MTPModule]:
    """Freshly initialised (transformers' init, seeded) main model and MTP module."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(attn))
    mtp = MTPModule(attn)
    mtp.body.embed_tokens.weight.requires_grad_(False)  # never used: the block gets embeds
    return model, mtp


def forward_losses(
    model: nn.Module, mtp: MTPModule, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens: [B, T + 1] -> (main loss, MTP loss, main logits [B, T, V], MTP logits
    [B, T - 1, V]). Main: position i predicts t_{i+1}; MTP: position i < T - 1, fed h_i
    and t_{i+1}, predicts t_{i+2}."""
    x, y = tokens[:, :-1], tokens[:, 1:]  # [B, T] each
    b, t = x.shape
    pos = torch.arange(t, device=x.device)[None].expand(b, t)
    h = model.model(input_ids=x, position_ids=pos, use_cache=False).last_hidden_state  # [B, T, H]
    logits = model.lm_head(h)  # [B, T, V]
    vocab = logits.shape[-1]
    ce = nn.functional.cross_entropy
    loss = ce(logits.float().reshape(-1, vocab), y.reshape(-1))
    next_embeds = model.model.embed_tokens(x[:, 1:])  # [B, T - 1, H]: t_{i+1}
    h_mtp = mtp(h[:, :-1], next_embeds, pos[:, :-1])  # [B, T - 1, H]
    mtp_logits = model.lm_head(h_mtp)  # shared head
    mtp_loss = ce(mtp_logits.float().reshape(-1, vocab), y[:, 1:].reshape(-1))
    return loss, mtp_loss, logits, mtp_logits


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing (report, section 2.1.2).

    transformers keeps `e_score_correction_bias` as a buffer that only shifts which
    experts are chosen (not their weights) and gets no gradient. After every
    optimizer step each router's bias moves by `rate` towards balance:
    b_e += rate * sign(mean load - load_e), loads counted over the step's tokens.
    """

    def __init__(self, modules: list[nn.Module], rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in modules if _is_router(m)]
        self.counts = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: nn.Module, args, output) -> None:
            if not module.training:
                return
            ids = next(o for o in output if not torch.is_floating_point(o))  # [T, k] expert ids
            n = self.counts[i].numel()
            self.counts[i] += torch.bincount(ids.reshape(-1), minlength=n)[:n].float()

        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; returns the worst max/mean load ratio of the step."""
        worst = 0.0
        for router, counts in zip(self.routers, self.counts):
            mean = counts.mean()
            router.e_score_correction_bias += self.rate * torch.sign(mean - counts)
            worst = max(worst, float(counts.max() / mean.clamp(min=1.0)))
            counts.zero_()
        return worst


def _is_router(m: nn.Module) -> bool:
    return type(m).__name__.endswith("TopkRouter") and hasattr(m, "e_score_correction_bias")

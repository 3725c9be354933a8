"""Tiny random-weight DeepSeek V2/V3 checkpoints made with transformers (the reference).

Each spec builds a seeded HF model (eager attention), randomises every weight
(norm gains and V3's e_score_correction_bias too, so none is trivially 1 or 0)
and saves it with `save_pretrained` (the original per-expert names). The V3
spec with MTP also gets transformers' MtpModel on the same main model, whose
weights are appended under `model.layers.{num_hidden_layers}.*` as DeepSeek
ships them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
YARN_V3 = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=0.8,
)
YARN_V2 = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)

SPECS: dict[str, dict[str, Any]] = {
    # V3: q LoRA, YaRN, grouped noaux_tc routing, a dense first layer, one MTP layer.
    "v3_mtp": dict(
        arch="v3",
        num_hidden_layers=3,
        q_lora_rank=48,
        rope_parameters=YARN_V3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        num_nextn_predict_layers=1,
        mtp=True,
    ),
    # V3: no q LoRA, plain RoPE in the half-split layout, one group, all layers MoE.
    "v3_plain": dict(
        arch="v3",
        num_hidden_layers=2,
        q_lora_rank=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rope_interleave=False,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=1.7,
        n_shared_experts=2,
        num_nextn_predict_layers=0,
    ),
    # V2-Lite-like: no q LoRA, YaRN with mscale, softmax greedy routing; config.json
    # rewritten in the original DeepSeek spelling (rope_theta + rope_scaling, torch_dtype).
    "v2_lite": dict(
        arch="v2",
        num_hidden_layers=2,
        q_lora_rank=None,
        rope_parameters=YARN_V2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="greedy",
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        n_shared_experts=2,
        original_style_config=True,
    ),
    # V2: q LoRA, group-limited greedy routing; saved as a sharded checkpoint.
    "v2_group": dict(
        arch="v2",
        num_hidden_layers=3,
        q_lora_rank=48,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        n_routed_experts=8,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        n_shared_experts=1,
        shard=True,
    ),
}
_TEST_KEYS = ("arch", "mtp", "shard", "original_style_config")


@dataclass
class TinyModel:
    name: str
    path: Path
    hf: torch.nn.Module  # DeepseekV{2,3}ForCausalLM, eval mode, float32
    mtp: torch.nn.Module | None  # transformers' MtpModel sharing hf's embedding and head


def build_hf(
    name: str, seed: int = 0, spec: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """spec: a model outside SPECS (COMMON's keys it names are replaced)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    spec = SPECS[name] if spec is None else spec
    kwargs = {**COMMON, **{k: v for k, v in spec.items() if k not in _TEST_KEYS}}
    v3 = spec["arch"] == "v3"
    cfg = (DeepseekV3Config if v3 else DeepseekV2Config)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = (DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM)(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomise(hf, gen)
    mtp = None
    if spec.get("mtp"):
        from transformers.modeling_layers import MtpModel

        mtp = MtpModel(hf, cfg.num_nextn_predict_layers).eval()
        _randomise(mtp.layers, gen)
    return hf, mtp


@torch.no_grad()
def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.05 * noise)
        else:
            p.copy_(0.08 * noise)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def save_tiny(
    name: str, root: Path, seed: int = 0, spec: dict[str, Any] | None = None
) -> TinyModel:
    spec = SPECS[name] if spec is None else spec
    hf, mtp = build_hf(name, seed, spec)
    path = root / name
    hf.save_pretrained(path, max_shard_size="60KB" if spec.get("shard") else "1GB")
    if mtp is not None:
        _append_mtp(path, hf, mtp)
    if spec.get("original_style_config"):
        _rewrite_original_style(path / "config.json")
    return TinyModel(name, path, hf, mtp)


def _append_mtp(path: Path, hf: torch.nn.Module, mtp: torch.nn.Module) -> None:
    """MtpModel's layer k -> model.layers.{N + k}.*, experts unfused like DeepSeek's files."""
    n = hf.config.num_hidden_layers
    tensors = load_file(path / "model.safetensors")
    for key, value in mtp.layers.state_dict().items():
        k, rest = key.split(".", 1)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        prefix = f"model.layers.{n + int(k)}."
        if rest.endswith("experts.gate_up_proj"):
            base = prefix + rest.removesuffix("gate_up_proj")
            for e, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                tensors[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{base}{e}.up_proj.weight"] = up.contiguous()
        elif rest.endswith("experts.down_proj"):
            base = prefix + rest.removesuffix("down_proj")
            for e, w in enumerate(value):
                tensors[f"{base}{e}.down_proj.weight"] = w.contiguous()
        else:
            tensors[prefix + rest] = value.contiguous()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _rewrite_original_style(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.update(scoring_func="softmax", moe_layer_freq=1, aux_loss_alpha=0.001)
    config_path.write_text(json.dumps(cfg, indent=2))


def save_fused(tiny: TinyModel, root: Path) -> Path:
    """The same weights with transformers' fused expert tensors (its in-memory names)."""
    path = root / f"{tiny.name}_fused"
    path.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in tiny.hf.state_dict().items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text((tiny.path / "config.json").read_text())
    return path

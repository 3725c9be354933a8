"""A tiny DeepSeek-V3 checkpoint laid out as DeepSeek publishes FP8 (README_WEIGHTS.md).

A seeded random transformers DeepseekV3 model (with an MTP layer) is saved with the
original per-expert names; then every linear weight DeepSeek quantizes (every 2-D
`*.weight` but the embedding, the LM head and the router gate, MTP's eh_proj included)
becomes float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block, and
config.json gets DeepSeek's quantization_config. The reference is transformers'
model on the dequantized weights (e4m3 * scale, what an FP8 checkpoint means).

The widths make the blocks matter: 256-wide rows span two K blocks, kv_a_proj
(128 + 32 = 160 rows) and q_b_proj (2 x 96 = 192 rows) end in partial blocks, and the
fused projections (q_a + kv_a, gate + up) meet at block boundaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.reference import dequantize_blocks, quantize_blocks
from tests.executors.tiny_models import YARN_V3, save_tiny

BLOCK = (128, 128)
FP8_SPEC: dict[str, Any] = dict(
    arch="v3",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    num_hidden_layers=2,
    rope_parameters=YARN_V3,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    num_nextn_predict_layers=1,
    mtp=True,
)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}
_KEPT = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "mlp.gate.weight")


@dataclass
class TinyFp8:
    path: Path  # the FP8 checkpoint
    bf16_path: Path  # the same model before quantization (float32 weights)
    hf: torch.nn.Module  # transformers' DeepseekV3ForCausalLM on the dequantized weights


def quantized_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        n for n, t in tensors.items() if t.dim() == 2 and n.endswith(".weight")
        and not n.endswith(_KEPT)
    )  # fmt: skip


def save_tiny_fp8(root: Path, seed: int = 0) -> TinyFp8:
    from transformers import DeepseekV3ForCausalLM

    tiny = save_tiny("fp8_source", root, seed, spec=FP8_SPEC)
    tensors = load_file(tiny.path / "model.safetensors")
    fp8, dequantized = dict(tensors), dict(tensors)
    for name in quantized_names(tensors):
        q, scale = quantize_blocks(tensors[name], BLOCK)
        fp8[name], fp8[f"{name}_scale_inv"] = q, scale
        dequantized[name] = dequantize_blocks(q, scale, BLOCK, torch.float32)
    config = json.loads((tiny.path / "config.json").read_text())
    path = root / "fp8"
    path.mkdir()
    save_file(fp8, path / "model.safetensors", metadata={"format": "pt"})
    fp8_config = {**config, "quantization_config": QUANTIZATION_CONFIG}
    (path / "config.json").write_text(json.dumps(fp8_config, indent=2))
    ref_dir = root / "fp8_dequantized"
    ref_dir.mkdir()
    save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps(config, indent=2))
    hf = DeepseekV3ForCausalLM.from_pretrained(ref_dir, attn_implementation="eager").eval()
    return TinyFp8(path, tiny.path, hf)

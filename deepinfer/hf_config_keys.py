"""What the keys of a DeepSeek V2/V3 Hugging Face `config.json` mean before they become
a `ModelConfig` (deepinfer/model_config.py, the one parser): the architectures and model
types known, each type's defaults for optional keys, the keys required, and readers of
the model type, the weight dtype, RoPE (both spellings: transformers 5.x
`rope_parameters`, 4.x / DeepSeek `rope_theta` + `rope_scaling`) and the keys this
engine refuses. Errors name the file and the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_ROPE_TYPES = ("default", "yarn")
_V3_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
}
# Optional keys and their transformers defaults, per model type (Kimi K2 is V3's layout).
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        "q_lora_rank": 1536,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0,
        "n_shared_experts": 2,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
    },
    "deepseek_v3": _V3_DEFAULTS,
    "kimi_k2": _V3_DEFAULTS,
}
NULLABLE_KEYS = (
    "q_lora_rank",
    "n_group",
    "topk_group",
)  # null is meaningful, not "use the default"
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def model_type_of(raw: dict[str, Any], source: str) -> str:
    """The model type, from `model_type` or else the architecture; unknown ones refused."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if archs and not known:
        raise ValueError(
            f"{source}: unknown architecture(s) {archs} (model_type {model_type!r}); "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    if model_type is None and known:
        model_type = known[0]
    if model_type not in MODEL_TYPE_DEFAULTS:
        raise ValueError(
            f"{source}: unknown model_type {model_type!r} (architectures {archs}); "
            f"supported: {sorted(MODEL_TYPE_DEFAULTS)}"
        )
    return str(model_type)


def reject_unsupported(raw: dict[str, Any], source: str) -> None:
    """Keys whose presence changes the math in ways this engine does not model."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r}: only 'silu' is supported")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=True is not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported")


def dtype_bytes(raw: dict[str, Any]) -> int:
    """Bytes of a weight in the config's dtype (either spelling; bf16 when unstated)."""
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return _DTYPE_BYTES.get(dtype, 2)


def rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    """RoPE's base and scaling (default or YaRN) from either spelling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported; expected {_ROPE_TYPES}")
    if kind == "default":
        return RopeConfig(theta=theta, type="default")
    max_pos = int(raw["max_position_embeddings"])
    orig = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_pos
    )
    factor = params.get("factor")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(factor) if factor is not None else max_pos / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )

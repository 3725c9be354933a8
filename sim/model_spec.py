"""Model shapes for the simulator, parsed from a Hugging Face `config.json`.

Presets are the published configs, verbatim, under `sim/data/models/`
(`moonlight-16b-a3b`, `deepseek-v2-lite`, `deepseek-v3`); any DeepSeek-V2/V3
style config.json works too. Derived sizes (parameter counts, weight and KV
bytes) are cached properties, so the cost model reads them for free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).parent / "data" / "models"
DEFAULT_MODEL = "moonlight-16b-a3b"
# All share the DeepseekV3/V2 layer layout (MLA + MoE with shared experts).
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
_REQUIRED = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a DeepSeek-architecture model (one decoder layer type, MLA attention)."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int  # decoder layers served (MTP layers excluded)
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int  # dense MLP width (the first `first_k_dense_replace` layers)
    kv_lora_rank: int  # latent KV width (512): what the cache stores, plus the rope key
    q_lora_rank: int | None  # None: a plain q_proj (Moonlight, V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int = 0  # 0: a dense model
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers shipped after the decoder layers
    max_position_embeddings: int = 4096
    dtype_bytes: int = 2  # linear-layer weights: 2 for bf16, 1 for fp8 checkpoints
    embed_dtype_bytes: int = 2  # embedding / lm_head stay bf16 even in fp8 checkpoints
    kv_dtype_bytes: int = 2  # KV cache entries (bf16 unless an fp8 cache is configured)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str, source: str | None = None) -> ModelSpec:
        """Parse an HF config dict. `source` (the file) is named in errors, else `name`."""
        where = source or name
        for key in _REQUIRED:
            if d.get(key) is None:
                raise ValueError(f"{where}: model config lacks required key {key!r}")
        if d["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{where}: unsupported model_type {d['model_type']!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        n_routed = int(d.get("n_routed_experts") or 0)
        if n_routed:
            for key in ("num_experts_per_tok", "moe_intermediate_size"):
                if d.get(key) is None:
                    raise ValueError(f"{where}: MoE model config lacks required key {key!r}")
        q_lora = d.get("q_lora_rank")
        return cls(
            name=name,
            model_type=str(d["model_type"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            vocab_size=int(d["vocab_size"]),
            intermediate_size=int(d["intermediate_size"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=int(q_lora) if q_lora else None,
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            n_routed_experts=n_routed,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            dtype_bytes=_weight_dtype_bytes(d),
        )

    # --- layer layout -------------------------------------------------------

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` is MoE (same rule as the HF DeepseekV3 model)."""
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

    @cached_property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim  # 192

    @cached_property
    def kv_latent_dim(self) -> int:
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
        return self.hidden_size * self.kv_latent_dim + self.kv_lora_rank

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
        return self.kv_latent_dim * self.num_hidden_layers * self.kv_dtype_bytes

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers


def _weight_dtype_bytes(d: dict[str, Any]) -> int:
    """1 for an fp8 checkpoint (DeepSeek-V3 ships `quantization_config.quant_method: fp8`)."""
    quant = d.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return 1
    dtype = str(d.get("torch_dtype") or d.get("dtype") or "bfloat16")
    return _DTYPE_BYTES.get(dtype, 2)


def known_models() -> list[str]:
    """Preset names `load_model_spec` accepts, sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model_spec(name_or_path: str | Path, dtype_bytes: int | None = None) -> ModelSpec:
    """A preset by name ("moonlight-16b-a3b"), or a config.json (or a folder holding one).

    `dtype_bytes` overrides the weight dtype read from the config (2: bf16, 1: fp8).
    """
    text = str(name_or_path)
    preset = MODELS_DIR / f"{text.lower()}.json"
    path = Path(text).expanduser()
    if preset.is_file():
        name = text.lower()
        path = preset
    elif path.is_dir() and (path / "config.json").is_file():
        name = path.resolve().name
        path = path / "config.json"
    elif path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    else:
        raise ValueError(
            f"unknown model {text!r}: not a preset ({', '.join(known_models())}) "
            f"nor a config.json path"
        )
    try:
        with path.open() as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object")
    spec = ModelSpec.from_hf_config(d, name=name, source=str(path))
    if dtype_bytes is not None:
        spec = replace(spec, dtype_bytes=dtype_bytes)
    return spec

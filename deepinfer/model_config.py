"""ModelConfig: the one parser of a DeepSeek V2/V3 Hugging Face `config.json`.

The simulator's cost models and the real executor's model read the same object.
Both spellings found in the wild are accepted: transformers 5.x
(`rope_parameters`, `dtype`) and the original DeepSeek / transformers 4.x
(`rope_theta` + `rope_scaling`, `torch_dtype`). Keys the model's math depends on
are validated, and an error names the file and the key. What each raw key means
(defaults per model type, the required keys, RoPE, the dtype) is
deepinfer/hf_config_keys.py; parameter counts and byte sizes (what cost models
price, what sizes the KV cache) are cached properties of the config; presets by name are loaded at the end of this file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.hf_config_keys import (
    MODEL_TYPE_DEFAULTS,
    NULLABLE_KEYS,
    REQUIRED_KEYS,
    RopeConfig,
    dtype_bytes,
    model_type_of,
    reject_unsupported,
    rope_config,
)

logger = logging.getLogger(__name__)

_SCORING = ("softmax", "sigmoid")
QUANTIZATIONS = ("fp8",)  # what `quantization=` accepts (EngineConfig, both executors)
FP8_DEFAULT_BLOCK = (128, 128)  # DeepSeek's weight_block_size
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and math of a DeepSeek-architecture model (MLA attention, MoE, MTP)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (the first `first_k_dense_replace` layers)
    num_hidden_layers: int  # decoder layers served (MTP layers excluded)
    num_attention_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (Moonlight, V2-Lite)
    kv_lora_rank: int  # latent KV width (512): what the cache stores, plus the rope key
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    n_routed_experts: int  # 0: every layer is dense
    n_shared_experts: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int  # MTP layers shipped after the decoder layers
    dtype: str | None  # "bfloat16", "float32", ... as the checkpoint states it
    eos_token_id: int | list[int] | None
    quant_method: str | None = None  # "fp8" for DeepSeek-V3's published checkpoint
    dtype_bytes: int = 2  # linear-layer weights: 2 for bf16, 1 for fp8 checkpoints
    embed_dtype_bytes: int = 2  # embedding / lm_head stay bf16 even in fp8 checkpoints
    kv_dtype_bytes: int = 2  # KV cache entries: the checkpoint's dtype, as the executor's
    # FP8 (quant_method "fp8"): the weights' scale blocks (output rows, input columns),
    # quantization_config.weight_block_size, and the modules it leaves unquantized.
    weight_block_size: tuple[int, int] | None = None
    fp8_skip_modules: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, source: str = "config.json", name: str | None = None
    ) -> ModelConfig:
        """Parse and validate; errors name `source` and the offending key."""
        model_type = model_type_of(raw, source)
        missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        d = {
            k: raw[k] if k in raw and (raw[k] is not None or k in NULLABLE_KEYS) else default
            for k, default in MODEL_TYPE_DEFAULTS[model_type].items()
        }
        reject_unsupported(raw, source)
        quant = raw.get("quantization_config") or None
        quant_method = str(quant.get("quant_method", "?")).lower() if quant else None
        try:
            cfg = cls(
                name=name or Path(source).parent.name or source,
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                q_lora_rank=int(d["q_lora_rank"]) if d["q_lora_rank"] else None,
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                rope=rope_config(raw, source),
                rope_interleave=bool(d["rope_interleave"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(raw.get("attention_bias", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                n_routed_experts=int(raw.get("n_routed_experts") or 0),
                n_shared_experts=int(d["n_shared_experts"] or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                first_k_dense_replace=int(d["first_k_dense_replace"]),
                moe_layer_freq=int(raw.get("moe_layer_freq", 1)),
                scoring_func=str(d["scoring_func"]),
                topk_method=str(d["topk_method"]),
                n_group=int(d["n_group"] or 1),
                topk_group=int(d["topk_group"] or 1),
                norm_topk_prob=bool(d["norm_topk_prob"]),
                routed_scaling_factor=float(d["routed_scaling_factor"]),
                num_nextn_predict_layers=int(d["num_nextn_predict_layers"] or 0),
                dtype=raw.get("dtype") or raw.get("torch_dtype"),
                eos_token_id=raw.get("eos_token_id"),
                quant_method=quant_method,
                dtype_bytes=1 if quant_method == "fp8" else dtype_bytes(raw),
                # The real executor caches KV in the checkpoint's dtype (bf16 beside fp8
                # weights, whose config states bf16).
                kv_dtype_bytes=2 if quant_method == "fp8" else dtype_bytes(raw),
                weight_block_size=_block_size(quant) if quant and quant_method == "fp8" else None,
                fp8_skip_modules=tuple(quant.get("modules_to_not_convert") or ()) if quant else (),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
        cfg._validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path, *, name: str | None = None) -> ModelConfig:
        """A config.json (or a folder holding one); errors name the file."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such model config file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read model config ({e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path), name=name)

    def check_max_model_len(self, requested: int | None) -> None:
        """Refuse a max_model_len beyond the positions the model was trained on, unless the
        user insists (DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1) and its RoPE is scaled (YaRN)."""
        limit = self.max_position_embeddings
        if requested is None or requested <= limit:
            return
        if not envs.allow_long_max_model_len():
            raise ValueError(
                f"max_model_len={requested} exceeds {self.name}'s max_position_embeddings="
                f"{limit}; positions past it were never trained (set "
                f"DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1 to insist, with a RoPE-scaled model)"
            )
        if self.rope.type == "default":
            raise ValueError(
                f"max_model_len={requested} exceeds max_position_embeddings={limit} and "
                f"{self.name} has no RoPE scaling to extend it"
            )
        logger.warning(
            "max_model_len=%d exceeds max_position_embeddings=%d (allowed by "
            "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN)",
            requested,
            limit,
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def with_quantization(self, method: str | None) -> ModelConfig:
        """The model as an engine with `quantization=method` serves it: "fp8" quantizes
        a bf16 checkpoint's linear weights at load time in 128 x 128 blocks (an FP8
        checkpoint stays as it is); None changes nothing. Anything else is refused."""
        if method is None or self.quant_method == method:
            return self
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization={method!r}: expected one of {QUANTIZATIONS} or None")
        if self.quant_method is not None:
            raise ValueError(
                f"quantization={method!r}: {self.name} is already quantized "
                f"({self.quant_method}); drop the option"
            )
        return replace(
            self, quant_method=method, dtype_bytes=1, weight_block_size=FP8_DEFAULT_BLOCK
        )

    def _validate(self, source: str) -> None:
        def bad(key: str, value: Any, why: str) -> ValueError:
            return ValueError(f"{source}: {key}={value!r}: {why}")

        for key in REQUIRED_KEYS:
            if key != "max_position_embeddings" and getattr(self, key) <= 0:
                raise bad(key, getattr(self, key), "must be positive")
        if self.scoring_func not in _SCORING:
            raise bad("scoring_func", self.scoring_func, f"expected one of {_SCORING}")
        if self.topk_method not in _TOPK_METHODS:
            raise bad("topk_method", self.topk_method, f"expected one of {_TOPK_METHODS}")
        if self.moe_layer_freq < 1:
            raise bad("moe_layer_freq", self.moe_layer_freq, "must be >= 1")
        if not self.is_moe:
            return
        e = self.n_routed_experts
        if self.moe_intermediate_size <= 0 or not 0 < self.num_experts_per_tok <= e:
            raise bad(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be in [1, n_routed_experts={e}] with moe_intermediate_size > 0",
            )
        if e % self.n_group != 0:
            raise bad("n_group", self.n_group, f"must divide n_routed_experts={e}")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        if self.topk_method == "noaux_tc" and e // self.n_group < 2:
            raise bad("n_group", self.n_group, "noaux_tc needs >= 2 experts per group")
        if self.topk_group * (e // self.n_group) < self.num_experts_per_tok:
            raise bad(
                "topk_group",
                self.topk_group,
                f"the chosen groups hold fewer than num_experts_per_tok="
                f"{self.num_experts_per_tok} experts",
            )

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


PRESETS_DIR = Path(__file__).parent / "data" / "models"
DEFAULT_MODEL = "moonlight-16b-a3b"


def known_models() -> list[str]:
    """Preset names `load_model_config` accepts (the published configs, verbatim)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def _config_source(name_or_path: str | Path) -> tuple[Path, str]:
    """The config file of a preset name or a config.json path (or its folder), and the
    model's name."""
    text = str(name_or_path)
    preset = PRESETS_DIR / f"{text.lower()}.json"
    path = Path(text).expanduser()
    if preset.is_file():
        return preset, text.lower()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json", path.resolve().name
    if path.is_file():
        return path, path.resolve().parent.name if path.name == "config.json" else path.stem
    raise ValueError(
        f"unknown model {text!r}: not a preset ({', '.join(known_models())}) nor a config.json path"
    )


def _block_size(quant: dict[str, Any]) -> tuple[int, int]:
    """quantization_config.weight_block_size: two positive ints (DeepSeek's default)."""
    raw = quant.get("weight_block_size") or FP8_DEFAULT_BLOCK
    if (
        not isinstance(raw, list | tuple)
        or len(raw) != 2
        or not all(isinstance(v, int) and v > 0 for v in raw)
    ):
        raise ValueError(f"quantization_config.weight_block_size={raw!r}: expected [rows, cols]")
    return int(raw[0]), int(raw[1])


def load_model_config(name_or_path: str | Path, dtype_bytes: int | None = None) -> ModelConfig:
    """A preset by name ("moonlight-16b-a3b"), or a config.json (or a folder holding one).

    `dtype_bytes` overrides the weight dtype read from the config (2: bf16, 1: fp8).
    """
    src, name = _config_source(name_or_path)
    cfg = ModelConfig.from_file(src, name=name)
    return cfg if dtype_bytes is None else cfg.replace(dtype_bytes=dtype_bytes)


def write_config_with_mtp_layer(name_or_path: str | Path, out_dir: str | Path) -> Path:
    """A folder under `out_dir`, named after the model, holding its config with one MTP
    layer (`num_nextn_predict_layers` >= 1: a DeepSeek-V3 MTP layer in the model's own
    shapes). For dummy-weight runs of speculation on models that ship none (Moonlight,
    DeepSeek-V2-Lite); the folder's name keeps the model's name, so the simulator finds
    the model's profiles."""
    src, name = _config_source(name_or_path)
    raw = json.loads(src.read_text())
    raw["num_nextn_predict_layers"] = max(1, int(raw.get("num_nextn_predict_layers") or 0))
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    return folder

"""Every DEEPINFER_* (and reference-engine) environment variable, read in one place.

Each reader is a function so the value is read when a config is built, not at
import time; explicit arguments always override these defaults.
"""

from __future__ import annotations

import os


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def accelerator() -> str | None:
    """DEEPINFER_ACCELERATOR: nvidia, ascend or cpu; None means detect."""
    raw = os.environ.get("DEEPINFER_ACCELERATOR")
    if not raw:
        return None
    if raw not in ("nvidia", "ascend", "cpu"):
        raise ValueError(f"DEEPINFER_ACCELERATOR={raw!r}: expected nvidia, ascend or cpu")
    return raw


def hf_model_dir() -> str | None:
    """DEEPINFER_HF_MODEL_DIR: a local checkpoint used instead of the hub."""
    return os.environ.get("DEEPINFER_HF_MODEL_DIR") or None


def api_key() -> str | None:
    """DEEPINFER_API_KEY: the key `deepinfer serve` requires when --api-key is not given."""
    return os.environ.get("DEEPINFER_API_KEY") or None


def cache_dir() -> str | None:
    """DEEPINFER_CACHE_DIR: where the simulator keeps its memo of profile fits
    (sim/fit_cache.py); None: under XDG_CACHE_HOME, else ~/.cache."""
    return os.environ.get("DEEPINFER_CACHE_DIR") or None


def prefill_watermark() -> float:
    """GPU_CACHE_PREFILL_WATERMARK: KV usage above which no new prompt starts."""
    return _float("GPU_CACHE_PREFILL_WATERMARK", 0.9)


def enable_mtp_varlen() -> bool:
    """DEEPINFER_ENABLE_MTP_VARLEN: confidence-scheduled variable-length drafts
    (deepinfer/spec_policy.py); turns speculation on with up to use_nextn_decode() drafts
    when num_speculative_tokens is not set. Off by default here (the reference engine's
    default is on: here that would speculate for every model)."""
    return _flag("DEEPINFER_ENABLE_MTP_VARLEN", False)


def use_nextn_decode() -> int:
    """DEEPINFER_USE_NEXTN_DECODE: the maximum length of variable-length drafts."""
    n = _int("DEEPINFER_USE_NEXTN_DECODE", 5)
    if n < 1:
        raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={n}: expected a positive integer")
    return n


def cpu_threads() -> int:
    """DEEPINFER_CPU_THREADS: torch threads of the CPU executor. Default 1: the models run on
    the CPU are small, so more threads gain nothing, and threads that spin-wait for each
    other make every step slower on a busy machine."""
    n = _int("DEEPINFER_CPU_THREADS", 1)
    if n < 1:
        raise ValueError(f"DEEPINFER_CPU_THREADS={n}: expected a positive integer")
    return n


def allow_long_max_model_len() -> bool:
    """DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN: accept max_model_len beyond the model's positions
    (RoPE-scaled models only; vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    return _flag("DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN", False)


def kernel_backend() -> str:
    """DEEPINFER_KERNEL_BACKEND: auto (Triton kernels on CUDA), torch (the torch twins
    everywhere: turns the kernels off) or triton."""
    raw = os.environ.get("DEEPINFER_KERNEL_BACKEND") or "auto"
    if raw not in ("auto", "torch", "triton"):
        raise ValueError(f"DEEPINFER_KERNEL_BACKEND={raw!r}: expected auto, torch or triton")
    return raw


def batch_invariant() -> bool:
    """DEEPINFER_BATCH_INVARIANT: batch-invariant kernels (EngineConfig.batch_invariant's
    default): a request's logits and tokens are bit-identical whatever shares its batch,
    however its prompt is chunked, and with or without a prefix-cache hit. NVIDIA only;
    slower (README, "Batch-invariant inference")."""
    return _flag("DEEPINFER_BATCH_INVARIANT", False)


# Reference-engine variables whose feature is not implemented yet: set, they are an
# error naming the variable rather than a setting that silently does nothing.
_UNIMPLEMENTED = {
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "YOCO prefill truncation",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "YOCO prefill truncation",
}


def refuse_unimplemented() -> None:
    """Raise if a variable of a feature that does not exist yet is set (and not off)."""
    for name, feature in _UNIMPLEMENTED.items():
        raw = os.environ.get(name)
        if raw is None or raw.strip().lower() in ("", "0", "false", "no", "off"):
            continue
        raise ValueError(
            f"environment variable {name}={raw!r}: {feature} is not implemented yet; unset it"
        )

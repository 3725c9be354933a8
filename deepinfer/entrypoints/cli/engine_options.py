"""One `--kebab-case` option per EngineConfig field, shared by every command."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from deepinfer.config import EngineConfig

ENGINE_HELP = {
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "KV blocks in the cache",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (GPUs only: on a "
    "CPU the KV cache holds 8 max_model_len sequences, at most 4 GiB, unless --num-gpu-blocks)",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "longest request (prompt + output)",
    "enable_chunked_prefill": "split long prompts across steps",
    "prefill_watermark": "KV usage above which no new prompt starts, in the normal role "
    "(GPU_CACHE_PREFILL_WATERMARK; the prefill and decode roles do not use it)",
    "enable_prefix_caching": "reuse cached KV blocks of equal prefixes",
    "role": "normal, prefill (finish after the first token) or decode (prompt arrives cached)",
    "num_speculative_tokens": "draft tokens verified per step (0: no speculation)",
    "enable_mtp_varlen": "confidence-scheduled variable-length drafts",
    "async_scheduling": "schedule and launch step N+1 while step N runs",
    "policy": "fcfs or priority",
    "seed": "seed for everything random",
    "data_parallel_size": "attention data-parallel ranks, each with its own scheduler and KV cache",
    "data_parallel_router": "which rank a request goes to: round-robin, least-requests, "
    "least-kv, power-of-two, prefix-affinity or least-load",
    "enable_expert_parallel": "shard the MoE experts over the data-parallel ranks "
    "(--expert-parallel alone means true)",
    "batch_invariant": "bit-identical results per request whatever the batch "
    "(DEEPINFER_BATCH_INVARIANT; CUDA only, slower)",
    "quantization": "fp8: linear weights in e4m3 with 128x128 block scales (a bf16 "
    "checkpoint is quantized at load time; an FP8 checkpoint is FP8 without it)",
    "kv_host_cache_gib": "host DRAM (GiB per engine) that prefix blocks evicted from HBM "
    "move to, and load back from (0: none)",
    "model": "model preset or config.json path",
    "hardware": "GPU preset (h200, h100, h800, b200)",
    "cost_model": "profiled, analytic or unit (default: profiled where a profile exists)",
    "acceptance_rate": "per-draft-token acceptance probability when speculating",
}


# Extra spellings of a flag (the and vLLM's names); given alone they mean true.
_ALIASES = {"enable_expert_parallel": "--expert-parallel"}

# Defaults that are computed, described rather than shown as None.
_DEFAULT_TEXT = {
    "num_gpu_blocks": "derived from GPU memory minus weights",
    "max_model_len": "the model's, capped by what the cache holds",
    "async_scheduling": "true; false with several data-parallel ranks",
}


def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One --kebab-case option per EngineConfig field, defaulting to the config's default."""
    group = parser.add_argument_group("engine options (EngineConfig)")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind: Any = {bool: parse_bool, int: int, float: float}.get(type(default), str)
        if f.name in ("num_gpu_blocks", "max_model_len"):
            kind = int
        shown = default.value if hasattr(default, "value") else default
        flags = [flag, _ALIASES[f.name]] if f.name in _ALIASES else [flag]
        extra: dict[str, Any] = {"nargs": "?", "const": True} if f.name in _ALIASES else {}
        group.add_argument(
            *flags,
            **extra,
            dest=f"engine_{f.name}",
            type=kind,
            default=None,
            metavar=f.name.split("_")[-1].upper(),
            help=f"{ENGINE_HELP.get(f.name, '')} (default: {_DEFAULT_TEXT.get(f.name, shown)})",
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {
        k[len("engine_") :]: v
        for k, v in vars(args).items()
        if k.startswith("engine_") and v is not None
    }
    return EngineConfig.from_dict(values, source="command line")

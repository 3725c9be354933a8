"""Batch-invariant mode (EngineConfig.batch_invariant, DEEPINFER_BATCH_INVARIANT=1).

A request's logits must be bit-identical whatever else shares its steps, however its
prompt was chunked and whether its prefix came from the cache. Every op that reduces
across a token's features must then reduce in one order that depends on nothing but
that token (and its own context):

- matmuls (every Linear incl. lm_head and the MLA projections, the absorbed per-head
  products, the router's logits): kernels/batch_invariant.py, one tile config, no split-K;
- fused MoE: one launch config for every token count (kernels/fused_moe.py);
- router selection: fixed 16-token tiles (kernels/moe_router.py);
- MLA decode: keys cut at multiples of a fixed length from key 0, always split-and-merge
  (kernels/mla_decode.py); MLA prefill: the Triton kernel, whose key tiles start at a
  request's key 0, so a chunk's queries see the same tiles as the whole prompt's;
- RMSNorm, the RoPE + cache prologue: one program per row already (Triton only);
- sampling: the logprobs' log-softmax row by row (kernels/batch_invariant.py); seeded
  rows draw from their own generators (executors/sampler.py).

The model runner adds the routing rule (model_runner.py): a prompt position always takes
the prefill (non-absorbed) attention path and an output position the absorbed one,
whatever its step's length. CUDA graphs keep all this: they replay the same kernels with
the same configs, and padding rows never meet a real row's reduction.

This module switches a loaded model into the mode and checks up front that the model
can run in it (the torch twins are not batch-invariant, so there is no fallback).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer import envs
from deepinfer.model_config import ModelConfig
from executors.models.layers import Linear
from executors.models.mla import MLAttention
from executors.models.moe import Experts, Router


def set_batch_invariant(model: nn.Module, on: bool, max_model_len: int) -> None:
    """Switch every Linear, MLA attention, router and expert block of `model` (its MTP
    layers included) into or out of the mode. max_model_len: the longest context the
    engine serves; it fixes the decode attention's piece length (a property of the
    engine, never of a batch)."""
    keys_per_split = None
    if on:
        from kernels.mla_decode import invariant_keys_per_split

        keys_per_split = invariant_keys_per_split(max_model_len)
    for module in model.modules():
        if isinstance(module, Linear | Router | Experts | MLAttention):
            module.batch_invariant = on
        if isinstance(module, MLAttention):
            module.decode_keys_per_split = keys_per_split


def check_supported(cfg: ModelConfig, device: torch.device, block_size: int) -> None:
    """ValueError naming what stops `cfg` from running batch-invariantly on `device`."""
    if device.type != "cuda":
        raise ValueError(
            f"batch_invariant=True (DEEPINFER_BATCH_INVARIANT): batch-invariant mode needs "
            f"CUDA (its kernels are Triton's; the torch twins the executor runs on {device} "
            "are not batch-invariant); unset it, or run on an NVIDIA GPU"
        )
    if envs.kernel_backend() == "torch":
        raise ValueError(
            "batch_invariant=True with DEEPINFER_KERNEL_BACKEND=torch: the mode needs the "
            "Triton kernels; unset DEEPINFER_KERNEL_BACKEND"
        )
    dims = {
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
    }
    bad = {k: v for k, v in dims.items() if v < 16 or v & (v - 1)}
    if block_size & (block_size - 1):
        bad["block_size"] = block_size
    if bad:
        raise ValueError(
            f"batch_invariant=True: {cfg.name} has {bad}; the mode's Triton attention "
            "kernels need powers of two (head dims >= 16)"
        )
    if cfg.n_routed_experts and cfg.n_routed_experts > 256:
        raise ValueError(
            f"batch_invariant=True: {cfg.name} has n_routed_experts={cfg.n_routed_experts}; "
            "the router kernel holds at most 256"
        )

"""Paged latent KV cache tensors and how many blocks fit.

One tensor per layer, [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim];
block ids are the scheduler's. When speculating, each MTP layer has one more such
tensor (`mtp_layers`), addressed through the same block tables: position p of a
request holds the MTP layer's entry for (hidden state at p, token p + 1). The cache holds no bookkeeping: block tables
live in the scheduler and arrive with each step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.host_cache import host_kv_blocks
from deepinfer.model_config import ModelConfig

logger = logging.getLogger(__name__)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        entry_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_block: bool = False,
        num_mtp_layers: int = 0,
    ) -> None:
        self.num_blocks = num_blocks  # the scheduler's blocks: ids [0, num_blocks)
        self.block_size = block_size
        # One more block, never handed out, where CUDA-graph padding rows write.
        self.scratch_block: int | None = num_blocks if scratch_block else None
        rows = num_blocks + int(scratch_block)
        # per layer: [num_blocks (+ 1 scratch), block_size, entry_dim]
        self.layers = [
            torch.zeros(rows, block_size, entry_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.mtp_layers = [
            torch.zeros(rows, block_size, entry_dim, dtype=dtype, device=device)
            for _ in range(num_mtp_layers)
        ]


def bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    return layers * block_size * cfg.kv_entry_dim * torch.empty(0, dtype=dtype).element_size()


def num_kv_layers(cfg: ModelConfig, engine: EngineConfig) -> int:
    """Layers whose latent KV a block holds: the MTP layers too when speculating."""
    return cfg.num_hidden_layers + num_mtp_kv_layers(cfg, engine)


def num_mtp_kv_layers(cfg: ModelConfig, engine: EngineConfig) -> int:
    """MTP layers that keep a KV cache: the first one (chained for k > 1) when speculating."""
    return min(1, cfg.num_nextn_predict_layers) if engine.num_speculative_tokens else 0


def cpu_num_blocks(
    engine: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """engine.num_gpu_blocks, else the host rule (deepinfer/kv_cache/host_cache.py: 8
    sequences of max_model_len, capped), which the simulator's CPU follows too."""
    if engine.num_gpu_blocks is not None:
        return engine.num_gpu_blocks
    per_block = bytes_per_block(cfg, engine.block_size, dtype, num_kv_layers(cfg, engine))
    return host_kv_blocks(max_model_len, engine.block_size, per_block)


def cuda_num_blocks(
    engine: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    profile: Callable[[], None],
) -> int:
    """Blocks that fit in gpu_memory_utilization of the device after weights and the
    peak activations of `profile` (a forward of a full token budget, then the sampler
    over a step's logits: TorchExecutor._profile_run), unless
    engine.num_gpu_blocks says otherwise.
    """
    if engine.num_gpu_blocks is not None:
        return engine.num_gpu_blocks
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory others hold on this GPU (other processes, CUDA context) is not ours to take.
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * engine.gpu_memory_utilization) - peak - others
    per_block = bytes_per_block(cfg, engine.block_size, dtype, num_kv_layers(cfg, engine))
    blocks = budget // per_block
    logger.info(
        "KV cache: %.2f GiB for %d blocks (peak %.2f GiB, total %.2f GiB)",
        budget / 2**30,
        blocks,
        peak / 2**30,
        total / 2**30,
    )
    if blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache: gpu_memory_utilization={engine.gpu_memory_utilization} "
            f"of {total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after weights and "
            f"activations (peak {peak / 2**30:.1f} GiB); one block needs {per_block} bytes"
        )
    return int(blocks)

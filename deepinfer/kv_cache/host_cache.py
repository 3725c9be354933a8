"""The KV cache a host (CPU) executor takes when num_gpu_blocks does not say.

A CPU has no memory fraction to hand out the way a GPU does (gpu_memory_utilization
applies to GPUs only): the torch executor on a CPU and the simulator's CPU hardware
both size the cache by this rule, so that a simulated CPU run queues and preempts as
the real one does.
"""

from __future__ import annotations

HOST_KV_SEQUENCES = 8  # full-length sequences the default cache holds
HOST_KV_BYTES_CAP = 4 << 30  # and never more than this


def host_kv_blocks(max_model_len: int, block_size: int, block_bytes: int) -> int:
    """Blocks for HOST_KV_SEQUENCES sequences of max_model_len tokens, at most
    HOST_KV_BYTES_CAP of blocks of `block_bytes` each (at least one)."""
    wanted = -(-HOST_KV_SEQUENCES * max_model_len // block_size)
    return min(wanted, max(1, HOST_KV_BYTES_CAP // block_bytes))

"""Joining the torch.distributed group of data/expert-parallel ranks.

gloo on the CPU, NCCL on CUDA (one GPU a rank); the rendezvous is TCP on a port the
launcher picked, or torchrun's environment (MASTER_ADDR / MASTER_PORT / RANK /
WORLD_SIZE) when no address is given.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this host now (the launcher's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(
    rank: int,
    world_size: int,
    device: torch.device,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the default group as `rank` of `world_size` (init_method None: env://)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method or "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

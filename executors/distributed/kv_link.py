"""KV handovers between processes over torch.distributed: a prefill engine's process
sends a request's KVHandover (deepinfer/kv_cache/handover.py) to a decode engine's.

A handover crosses as two messages on the default group (or `group`): its header
(request id, token count, block size, chain hashes, the tensor's shape and dtype) as a
pickled object, then the tensor itself, so the receiver allocates the buffer before
the bytes arrive. gloo carries CPU tensors; the same calls take NCCL between GPUs
(the tensor then stays on the device; the header goes through the current device).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepinfer.kv_cache.handover import KVHandover


def send_handover(handover: KVHandover, dst: int, group: Any = None) -> None:
    """Send `handover` (its kv a tensor) to rank `dst`; blocks until it is sent."""
    kv = handover.kv
    if not isinstance(kv, torch.Tensor):
        raise TypeError(
            f"request {handover.req_id!r}: its KV is a {type(kv).__name__}, not a tensor"
        )
    kv = kv.contiguous()
    header = [
        (
            handover.req_id, handover.num_tokens, handover.block_size,
            tuple(handover.block_hashes), tuple(kv.shape), str(kv.dtype).removeprefix("torch."),
        )
    ]  # fmt: skip
    dist.send_object_list(header, dst=dst, group=group)
    dist.send(kv, dst=dst, group=group)


def recv_handover(src: int, device: torch.device, group: Any = None) -> KVHandover:
    """The next handover rank `src` sends, its tensor on `device`. What the link raises
    (a peer gone, a timeout) propagates: the caller aborts the request it waited for."""
    header: list[Any] = [None]
    dist.recv_object_list(header, src=src, group=group)
    req_id, num_tokens, block_size, hashes, shape, dtype = header[0]
    kv = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    dist.recv(kv, src=src, group=group)
    return KVHandover(req_id, num_tokens, block_size, tuple(hashes), kv, kv.nbytes)

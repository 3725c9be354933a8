"""Host-to-device copies that never wait for the device.

A copy from pageable host memory waits for the work already queued on the device
(PyTorch synchronises the stream for it), which would stall a step launched while the
one before it still runs (async scheduling, ModelRunner.launch). These copy from pinned
memory instead, and return at once.
"""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host tensor goes to CUDA through pinned memory."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# Each tensor of a packed copy starts on a multiple of this many elements: a Triton
# kernel specialises on 16-byte-aligned pointers, and one that met an unaligned slice
# would compile a second variant in a served step.
PACK_ALIGN = 16


def packed_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` with one copy (from pinned memory on CUDA):
    views of one device buffer, each contiguous and starting aligned (`PACK_ALIGN`).
    Each copy has a fixed host cost of its own, and a step's metadata has a dozen."""
    if not tensors:
        return []
    dtype = tensors[0].dtype
    assert all(t.dtype == dtype for t in tensors), [t.dtype for t in tensors]
    starts, total = [], 0
    for t in tensors:
        starts.append(total)
        total += -(-t.numel() // PACK_ALIGN) * PACK_ALIGN
    pin = device.type == "cuda"
    buf = torch.empty(max(total, 1), dtype=dtype, pin_memory=pin)
    for t, a in zip(tensors, starts):
        buf[a : a + t.numel()].copy_(t.reshape(-1))
    moved = buf.to(device, non_blocking=pin)
    return [moved[a : a + t.numel()].view(t.shape) for t, a in zip(tensors, starts)]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor of `dtype` on `device` (`to_device_async`)."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


class PackedCopy:
    """Device tensors read back with one copy: packed as float64 (which holds every
    token id and float32 value exactly) and copied into pinned memory now, behind the
    work queued so far; `read()` waits for that copy alone and returns each tensor's
    values, flattened, as a list."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._sizes = [t.numel() for t in tensors]
        packed = torch.cat([t.double().flatten() for t in tensors])
        self._copied: torch.cuda.Event | None = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host = host.copy_(packed, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = packed

    def read(self) -> list[list[float]]:
        if self._copied is not None:
            self._copied.synchronize()
        values = self._host.tolist()
        out, at = [], 0
        for n in self._sizes:
            out.append(values[at : at + n])
            at += n
        return out

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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor of `dtype` on `device` (`to_device_async`)."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)

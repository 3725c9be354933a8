"""Small building blocks: Linear, RMSNorm and the gated SiLU MLP (dense layers, shared
experts), and `fuse_linears`, which lets one GEMM serve linears that share an input."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops as kernel_ops


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose matmul is kernels.ops.linear:
    cuBLAS, or with `batch_invariant` set (executors/batch_invariant.py) the fixed-config
    Triton GEMM, so a token's projection never depends on the rest of the batch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return kernel_ops.linear(x, self.weight, self.bias, self.batch_invariant)


def fuse_linears(linears: Sequence[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of out, in] (and bias) holding the rows of `linears`, which share an
    input, so one GEMM computes all their outputs: at decode one weight read in one launch
    instead of several small ones. Each linear's parameters become views of the fused
    tensors, so memory is not doubled and loading a linear fills the fused weight. Call
    once the parameters are allocated on their device, and keep the result in
    non-persistent buffers: `.to()` then moves it too (the executor's shutdown moves the
    model to meta to free it), though a moved copy no longer shares the linears'
    storage, so load weights before any such move."""
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("fuse_linears: either every linear has a bias or none has")
    weight = torch.cat([lin.weight.data for lin in linears])  # [sum N, K]
    bias = None if biases[0] is None else torch.cat([lin.bias.data for lin in linears])
    start = 0
    for lin in linears:
        stop = start + lin.out_features
        lin.weight.data = weight[start:stop]
        if bias is not None:
            lin.bias.data = bias[start:stop]
        start = stop
    return weight, bias


class RMSNorm(nn.Module):
    """Normalises in float32, casts back, then scales (transformers' order of operations):
    kernels.ops.rmsnorm, the Triton kernel on CUDA, its torch twin elsewhere."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        return kernel_ops.rmsnorm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). After `fuse()` gate and up are one GEMM over
    `gate_up` [2I, hidden] (gate rows first), whose halves are gate_proj's and up_proj's
    weights."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None
        self.register_buffer("gate_up", None, persistent=False)  # set by fuse()

    def fuse(self) -> None:
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = kernel_ops.linear(x, self.gate_up, None, self.gate_proj.batch_invariant)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)

"""Small building blocks: Linear, RMSNorm and the gated SiLU MLP (dense layers, shared
experts)."""

from __future__ import annotations

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
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

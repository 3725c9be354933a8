"""Small building blocks: Linear, RMSNorm and the gated SiLU MLP (dense layers, shared
experts), and `fuse_linears`, which lets one GEMM serve linears that share an input."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops as kernel_ops


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose matmul is kernels.ops.linear:
    cuBLAS, or with `batch_invariant` set (executors/batch_invariant.py) the fixed-config
    Triton GEMM, so a token's projection never depends on the rest of the batch.

    After `to_fp8(block)` the weight is float8_e4m3fn [out, in] with `weight_scale_inv`
    [ceil(out / bn), ceil(in / bk)] float32 beside it (DeepSeek's checkpoint names), and
    the matmul is kernels.ops.fp8_linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = False
        self.fp8_block: tuple[int, int] | None = None
        self.weight_scale_inv: nn.Parameter | None
        self.register_parameter("weight_scale_inv", None)

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight as block-scaled e4m3 (uninitialised, on the weight's device:
        call on the meta device, before the parameters are allocated)."""
        (bn, bk), dev = block, self.weight.device
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=torch.float8_e4m3fn, device=dev),
            requires_grad=False,
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-self.out_features // bn), -(-self.in_features // bk), device=dev),
            requires_grad=False,
        )
        self.fp8_block = block

    def dequantize(self, dtype: torch.dtype) -> None:
        """Back to a plain weight in `dtype` (for a product that reads the weight itself,
        such as MLA's absorbed W_UK / W_UV)."""
        if self.fp8_block is None or self.weight_scale_inv is None:
            return
        w = kernel_ops.dequantize_blocks(
            self.weight.data, self.weight_scale_inv.data, self.fp8_block, dtype
        )
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv = None
        self.fp8_block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return linear(x, self.weight, self.bias, self.weight_scale_inv, self.fp8_block,
                      self.batch_invariant)  # fmt: skip


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale_inv: torch.Tensor | None,
    block: tuple[int, int] | None,
    batch_invariant: bool,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias): e4m3 with its block scales when scale_inv is
    given (kernels.ops.fp8_linear), else kernels.ops.linear."""
    if scale_inv is not None and block is not None:
        return kernel_ops.fp8_linear(x, weight, scale_inv, bias, block, None, batch_invariant)
    return kernel_ops.linear(x, weight, bias, batch_invariant)


@dataclass(frozen=True)
class FusedLinear:
    """Linears that share an input, as one weight [sum of out, in] (and bias, and FP8
    scales: [sum of scale rows, ceil(in / bk)]), computed by one GEMM."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale_inv: torch.Tensor | None
    block: tuple[int, int] | None

    def __call__(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.scale_inv, self.block, batch_invariant)


def fuse_linears(linears: Sequence[Linear]) -> FusedLinear | None:
    """One weight [sum of out, in] (and bias) holding the rows of `linears`, which share an
    input, so one GEMM computes all their outputs: at decode one weight read in one launch
    instead of several small ones. Each linear's parameters become views of the fused
    tensors, so memory is not doubled and loading a linear fills the fused weight. Call
    once the parameters are allocated on their device, and keep the result's tensors in
    non-persistent buffers: `.to()` then moves them too (the executor's shutdown moves
    the model to meta to free it), though a moved copy no longer shares the linears'
    storage, so load weights before any such move.

    None (left apart) where one GEMM cannot hold them: FP8 and plain weights mixed, or
    FP8 linears whose scale blocks would straddle two of them (every one but the last
    must have a multiple of bn rows). Some with a bias and some without: ValueError."""
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("fuse_linears: either every linear has a bias or none has")
    blocks = {lin.fp8_block for lin in linears}
    if len(blocks) > 1:
        return None
    block = blocks.pop()
    if block is not None and any(lin.out_features % block[0] for lin in linears[:-1]):
        return None
    weight = torch.cat([lin.weight.data for lin in linears])  # [sum N, K]
    bias = None if biases[0] is None else torch.cat([lin.bias.data for lin in linears])
    scales = [lin.weight_scale_inv for lin in linears]
    scale = None if block is None else torch.cat([s.data for s in scales if s is not None])
    start = srow = 0
    for lin in linears:
        stop = start + lin.out_features
        lin.weight.data = weight[start:stop]
        if bias is not None:
            lin.bias.data = bias[start:stop]
        if scale is not None and lin.weight_scale_inv is not None:
            rows = lin.weight_scale_inv.shape[0]
            lin.weight_scale_inv.data = scale[srow : srow + rows]
            srow += rows
        start = stop
    return FusedLinear(weight, bias, scale, block)


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
    weights (FP8: `gate_up_scale` the same for their scales)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None
        self.gate_up_scale: torch.Tensor | None
        self.register_buffer("gate_up", None, persistent=False)  # set by fuse()
        self.register_buffer("gate_up_scale", None, persistent=False)

    def fuse(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up, self.gate_up_scale = fused.weight, fused.scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up, None, self.gate_up_scale, self.gate_proj.fp8_block,
                         self.gate_proj.batch_invariant)  # fmt: skip
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)

"""Triton kernels, each with a torch reference twin of the same signature.

Import the ops from here (or `kernels.ops`): each picks the Triton kernel for CUDA
tensors and the twin otherwise. Importing this package compiles nothing.
"""

from kernels.ops import (
    fused_add_rmsnorm,
    fused_moe,
    mla_decode_attention,
    rmsnorm,
    use_triton,
)

__all__ = ["fused_add_rmsnorm", "fused_moe", "mla_decode_attention", "rmsnorm", "use_triton"]

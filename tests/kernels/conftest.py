"""Kernel tests: on a machine without CUDA the Triton kernels run in Triton's CPU
interpreter. TRITON_INTERPRET is read when a kernel is decorated, so it is set
here, before any test module of this folder imports `kernels.*`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and calls int() on
    them for `range` bounds, which NumPy >= 2.4 refuses; take the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_deepinfer_patched", False):
        return

    def patched(tensor, scope) -> None:  # noqa: ANN001 (Triton internals)
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).flat[0]))

    patched._deepinfer_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_fp8_rounding() -> None:
    """Triton 3.9's interpreter rounds a float32 to float8e4nv without carrying a
    rounded-up mantissa into the exponent (31.8 becomes 16, not 32) and rounds ties
    up; the GPU's conversion (cvt.rn) rounds to nearest even, as torch's does. The FP8
    kernels quantize activations in registers, so take torch's conversion there."""
    from triton import language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_deepinfer_patched", False):
        return

    def patched(input, input_dtype, output_dtype, rounding_mode):  # noqa: ANN001, ANN202
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            t = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    patched._deepinfer_patched = True  # type: ignore[attr-defined]
    interpreter._convert_float = patched


def _patch_interpreter_dot() -> None:
    """The interpreter's tl.dot is np.matmul, whose BLAS may reduce a row of the tile
    differently by where the row lies in it (OpenBLAS's Haswell GEMM kernel, which AMD
    Zen CPUs also take, does): a row's bits would then follow the batch. On the GPU an
    MMA computes each output element from its own row and column alone, which
    batch-invariant mode relies on (kernels/batch_invariant.py). Float dots here do the
    same: the products, then one sum over K per element, in one order for every row."""
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_deepinfer_patched", False):
        return

    def operand(x):  # noqa: ANN001, ANN202 (a TensorHandle -> its numpy array)
        if x.dtype.is_floating() and x.dtype.primitive_bitwidth == 8:  # as Triton's dot
            return interpreter._convert_float(x.data, x.dtype, tl.float16, None).view(np.float16)
        return x.data

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        acc = d.data.dtype
        if acc not in (np.float32, np.float64):  # integer dots are exact in any order
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        # [..., M, K, 1] * [..., 1, K, N] -> [..., M, K, N], summed over K
        products = operand(a).astype(acc)[..., :, :, None] * operand(b).astype(acc)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2) + d.data, d.dtype.scalar)

    patched._deepinfer_patched = True  # type: ignore[attr-defined]
    builder.create_dot = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalars()
    _patch_interpreter_fp8_rounding()
    _patch_interpreter_dot()


@pytest.fixture
def device() -> torch.device:
    """Where the tiny-shape tests run: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")

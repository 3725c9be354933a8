"""RMSNorm and residual-add + RMSNorm in Triton, one program per row.

Rounding follows the twins (kernels.reference.rmsnorm_ref, transformers' order):
the residual sum is rounded to the activation dtype, normalised in float32, rounded
back, then scaled by the weight (a product in the activation dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] residual (read when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H] normed
    new_res_ptr,  # [T, H] x + residual (written when HAS_RESIDUAL)
    H,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)  # [T, H]
    assert x2.stride(1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
    out2 = out.view(-1, h)
    res2 = residual.reshape(-1, h) if residual is not None else x2
    if residual is None:
        new_res = out2  # not written
    else:
        new_res = (torch.empty_like(x) if residual_out is None else residual_out).view(-1, h)
    block = triton.next_power_of_2(h)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, res2, weight, out2, new_res, h, eps,
            x2.stride(0), res2.stride(0), out2.stride(0), new_res.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out, new_res.view(x.shape) if residual is not None else None


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] (as `kernels.reference.rmsnorm_ref`)."""
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rmsnorm(x + residual), x + residual), as `kernels.reference.fused_add_rmsnorm_ref`.
    `out` and `residual_out` (contiguous, shaped like x) receive the results when given."""
    normed, new_res = _launch(x, residual, weight, eps, out, residual_out)
    assert new_res is not None
    return normed, new_res

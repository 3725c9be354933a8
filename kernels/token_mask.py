"""Grammar token masks on the logits: one Triton kernel in place of a chain of torch ops.

A structured request's allowed next tokens arrive as a bitmask (xgrammar's layout:
int32 words, bit i of word w allows token 32 * w + i). Each program takes one masked
row and BLOCK tokens of it, reads the BLOCK / 32 words once and stores -inf over the
tokens they do not allow; allowed logits are never read or written. Row indices come
as a device tensor, so nothing on the host waits for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [N, >= V] float
    mask_ptr,  # [N, ceil(V / 32)] int32: row r masks logits row r
    rows_ptr,  # [R] int64: the rows to mask
    V,
    stride_l,
    stride_m,
    BLOCK: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0))
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    words = tl.load(mask_ptr + row * stride_m + (offs >> 5), mask=valid, other=-1)
    allowed = ((words >> (offs & 31)) & 1) != 0
    blocked = valid & (allowed == 0)
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=blocked)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int
) -> None:
    """logits[r, t] = -inf for each r in `rows` and each t < vocab_size that bitmask[r]
    does not allow (in place). logits: [N, >= vocab_size]; bitmask: [N, words] int32;
    rows: [R] int64, all three on the same device."""
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1 and bitmask.dtype == torch.int32
    if rows.numel() == 0:
        return
    grid = (rows.numel(), triton.cdiv(vocab_size, BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows, vocab_size, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK
    )

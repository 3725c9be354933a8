"""The Triton grammar mask sets exactly the disallowed logits of the listed rows to -inf,
as xgrammar's own torch implementation does, and leaves every other logit alone."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import apply_token_bitmask_ref
from kernels.token_mask import apply_token_bitmask


@pytest.mark.parametrize(
    ("n", "vocab", "rows"), [(1, 40, [0]), (5, 4099, [0, 2, 4]), (3, 8200, [])]
)
def test_token_mask_matches_xgrammar(n, vocab, rows, device) -> None:
    xgr_torch = pytest.importorskip("xgrammar.kernels.apply_token_bitmask_inplace_torch")
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = 0  # a word that allows nothing, and one that allows everything
    bitmask[-1, -1] = -1
    logits = torch.randn(n, vocab + 3, generator=gen)  # wider than the vocabulary: left alone
    want = logits.clone()
    if rows:
        xgr_torch.apply_token_bitmask_inplace_torch(want, bitmask, vocab, rows)
    idx = torch.tensor(rows, dtype=torch.int64)
    got = logits.to(device)
    apply_token_bitmask(got, bitmask.to(device), idx.to(device), vocab)
    twin = logits.clone()
    apply_token_bitmask_ref(twin, bitmask, idx, vocab)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(twin, want)

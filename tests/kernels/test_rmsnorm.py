"""Triton RMSNorm (plain and with the residual add) equals its torch twin."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tests.kernels.utils import rel_err


def _inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    r = torch.randn(*shape, generator=gen)
    w = 1.0 + 0.1 * torch.randn(shape[-1], generator=gen)
    return (t.to(dtype=dtype, device=device) for t in (x, r, w))


@pytest.mark.parametrize("shape", [(1, 64), (7, 300), (3, 5, 128)])
def test_rmsnorm_matches_reference(shape, device) -> None:
    x, _, w = _inputs(shape, torch.float32, device, sum(shape))
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-6, out=out)
    ref = rmsnorm_ref(x.double(), w.double(), 1e-6)
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("shape", [(1, 64), (7, 300), (3, 5, 128)])
def test_fused_add_rmsnorm_matches_reference(shape, device) -> None:
    """normed = rmsnorm(x + residual); the sum is returned too and every element written."""
    x, r, w = _inputs(shape, torch.float32, device, sum(shape) + 1)
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    fused_add_rmsnorm(x, r, w, 1e-6, out=out, residual_out=res_out)
    ref, ref_res = fused_add_rmsnorm_ref(x.double(), r.double(), w.double(), 1e-6)
    assert rel_err(res_out, ref_res) < 1e-7
    assert rel_err(out, ref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden", [(1, 2048), (257, 2048), (64, 7168), (4096, 2048)])
def test_bf16_rounding_matches_twin(tokens, hidden) -> None:
    """Same rounding steps as the twin: the sum is bitwise equal; the normed output agrees
    to two bf16 ulps (a one-ulp flip before the weight product can become two after)."""
    x, r, w = _inputs((tokens, hidden), torch.bfloat16, "cuda", tokens + hidden)
    out, res = fused_add_rmsnorm(x, r, w, 1e-6)
    ref, ref_res = fused_add_rmsnorm_ref(x, r, w, 1e-6)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    exact = fused_add_rmsnorm_ref(x.double(), r.double(), w.double(), 1e-6)[0]
    assert rel_err(out, exact) < 1e-2
    assert rel_err(rmsnorm(x, w, 1e-6), rmsnorm_ref(x.double(), w.double(), 1e-6)) < 1e-2

"""The fused MLA prologue (query RoPE in place, latent RMSNorm + key RoPE into the cache)
equals its torch twin; cache slots it was not given stay untouched."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_rope_cache import mla_rope_cache
from kernels.reference import mla_rope_cache_ref
from tests.kernels.utils import rel_err


def _inputs(t, h, dn, lat, rope, num_blocks, page, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dn + rope, generator=gen)  # q_pe is a strided view of this
    kv = torch.randn(t, lat + rope, generator=gen)
    w = 1.0 + 0.1 * torch.randn(lat, generator=gen)
    angles = torch.rand(t, rope // 2, generator=gen) * 6.0
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1  # a YaRN-like attention factor
    slots = torch.randperm(num_blocks * page, generator=gen)[:t]
    cache = torch.full((num_blocks, page, lat + rope), float("nan"))
    cast = {"dtype": dtype, "device": device}
    return (q.to(**cast), kv.to(**cast), w.to(**cast), cos.to(device), sin.to(device),
            cache.to(**cast), slots.to(device))  # fmt: skip


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("t,h", [(1, 1), (5, 3), (9, 16)])
def test_rope_cache_matches_reference(t, h, interleave, device) -> None:
    dn, lat, rope = 8, 32, 16
    q, kv, w, cos, sin, cache, slots = _inputs(
        t, h, dn, lat, rope, 4, 4, torch.float32, device, t * 10 + h + interleave
    )
    q_ref, cache_ref = q.clone().double(), cache.clone().double()
    mla_rope_cache(q[..., dn:], kv, w, 1e-6, cos, sin, cache, slots, interleave)
    mla_rope_cache_ref(
        q_ref[..., dn:],
        kv.double(),
        w.double(),
        1e-6,
        cos.double(),
        sin.double(),
        cache_ref,
        slots,
        interleave,
    )
    assert rel_err(q, q_ref) < 1e-6  # q_nope untouched, q_pe rotated
    flat, flat_ref = cache.view(-1, lat + rope), cache_ref.view(-1, lat + rope)
    assert rel_err(flat[slots], flat_ref[slots]) < 1e-6
    others = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    others[slots] = False
    assert flat[others].isnan().all()  # no slot outside slot_mapping was written


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
def test_rope_cache_at_deepseek_shapes_in_bf16(h) -> None:
    """Moonlight (16 heads) and DeepSeek-V3 (128): L 512, R 64, interleaved, bf16; both
    sides round the same way, so the results agree to bf16 rounding of a few elements."""
    dn, lat, rope, t = 128, 512, 64, 300
    q, kv, w, cos, sin, cache, slots = _inputs(
        t, h, dn, lat, rope, 64, 64, torch.bfloat16, torch.device("cuda"), h
    )
    q_ref, cache_ref = q.clone(), cache.clone()
    mla_rope_cache(q[..., dn:], kv, w, 1e-6, cos, sin, cache, slots, True)
    mla_rope_cache_ref(q_ref[..., dn:], kv, w, 1e-6, cos, sin, cache_ref, slots, True)
    assert rel_err(q, q_ref) < 1e-3
    flat, flat_ref = cache.view(-1, lat + rope), cache_ref.view(-1, lat + rope)
    assert rel_err(flat[slots], flat_ref[slots]) < 1e-3
    assert flat.isnan().sum() == (flat.shape[0] - t) * (lat + rope)

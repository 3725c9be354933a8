"""Triton fused MoE (align + grouped GEMMs) equals its torch twin (float64)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import CONFIGS, fused_moe, moe_config
from kernels.moe_align import moe_align, moe_align_ref
from kernels.reference import fused_moe_ref
from tests.kernels.utils import rel_err


def _routing(t: int, e: int, k: int, gen: torch.Generator, skew: bool = False):
    """Softmax top-k of random logits -> (weights [T, k] float32, ids [T, k] int64).
    skew: most tokens prefer the same few experts (many row blocks per expert)."""
    logits = torch.randn(t, e, generator=gen)
    if skew:
        logits[:, : k + 1] += 4.0
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return weights, ids


def _moe_inputs(t, e, k, hidden, inter, dtype, device, gen, skew=False):
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) / inter**0.5
    weights, ids = _routing(t, e, k, gen, skew)
    cast = {"dtype": dtype, "device": device}
    return x.to(**cast), w13.to(**cast), w2.to(**cast), weights.to(device), ids.to(device)


@pytest.mark.parametrize("method", ["one_program", "grid"])
@pytest.mark.parametrize(
    "t,e,k,block_m",
    # The last two span many chunks of the grid form (128 pairs each for 66 experts,
    # 16 for 1,000), with one expert's run crossing chunks when skewed.
    [(1, 8, 2, 16), (13, 8, 3, 16), (150, 8, 2, 32), (37, 5, 4, 16), (70, 64, 6, 16),
     (300, 66, 8, 64), (45, 1000, 3, 16)],
)  # fmt: skip
def test_align_equals_stable_sort_with_padding(t, e, k, block_m, method, device) -> None:
    """Pairs sorted stably by expert, each run padded to BLOCK_M; one expert per row block."""
    gen = torch.Generator().manual_seed(t * e + k)
    _, ids = _routing(t, e, k, gen, skew=t % 2 == 0)
    got = moe_align(ids.to(device), e, block_m, method)
    want = moe_align_ref(ids, e, block_m)
    for name in ("sorted_pairs", "block_expert", "num_padded"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.parametrize("method", ["one_program", "grid"])
def test_align_of_no_pairs(method, device) -> None:
    """A step with no tokens for the MoE aligns nothing, by either form (the grid's chunk
    count would be 0)."""
    ids = torch.empty(0, 2, dtype=torch.long)
    got = moe_align(ids.to(device), 8, 16, method)
    want = moe_align_ref(ids, 8, 16)
    assert torch.equal(got.num_padded.cpu(), want.num_padded)


def test_align_refuses_an_unknown_method() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        moe_align(torch.zeros(2, 1, dtype=torch.long), 4, 16, "bitonic")


# (T, E, k, H, I, config overrides that make the tiny shapes cover several tiles)
TINY = [
    (1, 8, 2, 64, 48, {"BLOCK_K": 32, "BLOCK_N": 32}),
    (13, 8, 3, 64, 48, {"BLOCK_K": 32, "BLOCK_N": 32}),
    (40, 5, 2, 96, 40, {"BLOCK_M": 32, "BLOCK_K": 32, "BLOCK_N": 16, "GROUP_M": 2}),
    (24, 4, 2, 48, 24, {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_N": 16, "GROUP_M": 4}),
    (70, 8, 3, 64, 48, {"BLOCK_K": 32, "BLOCK_N": 32}),  # 210 pairs: the 3-kernel alignment
]


@pytest.mark.parametrize("t,e,k,hidden,inter,cfg", TINY)
@pytest.mark.parametrize("skew", [False, True])
def test_fused_moe_matches_reference(t, e, k, hidden, inter, cfg, skew, device) -> None:
    gen = torch.Generator().manual_seed(t + e + hidden + skew)
    x, w13, w2, weights, ids = _moe_inputs(t, e, k, hidden, inter, torch.float32, device, gen, skew)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, weights, ids, config=cfg, out=out)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert torch.isfinite(out).all(), "unwritten output rows"
    assert rel_err(out, ref) < 1e-5


def _shared_mlp(x, sw13, sw2):
    """The shared MLP as transformers runs it: down(silu(gate(x)) * up(x)), float64."""
    gate, up = torch.nn.functional.linear(x, sw13).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, sw2)


@pytest.mark.parametrize("t,e,k,hidden,inter,cfg", TINY[:3])
@pytest.mark.parametrize("num_shared", [1, 2])
def test_shared_experts_ride_in_the_fused_moe(t, e, k, hidden, inter, cfg, num_shared, device):
    """ids E .. E + S - 1 of weight 1 stand for the S slices of a shared MLP (gate/up
    [2SI, H], down [H, SI]): the kernel's output is routed experts plus the whole shared
    MLP, and the twin computes the same."""
    gen = torch.Generator().manual_seed(t + e + num_shared)
    x, w13, w2, weights, ids = _moe_inputs(t, e, k, hidden, inter, torch.float32, device, gen)
    si = num_shared * inter
    sw13 = (torch.randn(2 * si, hidden, generator=gen) / hidden**0.5).to(device)
    sw2 = (torch.randn(hidden, si, generator=gen) / si**0.5).to(device)
    tail = torch.arange(e, e + num_shared, device=device).expand(t, -1)
    ids_s = torch.cat([ids, tail], 1)
    weights_s = torch.cat([weights, torch.ones(t, num_shared, device=device)], 1)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, weights_s, ids_s, config=cfg, out=out, shared=(sw13, sw2))
    d = [a.double() for a in (x, w13, w2, weights)]
    want = fused_moe_ref(*d, ids) + _shared_mlp(d[0], sw13.double(), sw2.double())
    assert torch.isfinite(out).all(), "unwritten output rows"
    assert rel_err(out, want) < 1e-5
    twin = fused_moe_ref(*d[:3], weights_s.double(), ids_s, (sw13.double(), sw2.double()))
    assert rel_err(twin, want) < 1e-12


def test_config_table_covers_every_batch_size() -> None:
    assert moe_config(1)["BLOCK_M"] == 16
    assert moe_config(10**9) == CONFIGS[-1][1]
    assert [m for m, _ in CONFIGS] == sorted(m for m, _ in CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 256, 2048])
@pytest.mark.parametrize("skew", [False, True])
def test_fused_moe_bf16_moonlight_shapes(t, skew) -> None:
    """Moonlight-16B-A3B: E=64, k=6, H=2048, I=1408."""
    gen = torch.Generator().manual_seed(t + skew)
    x, w13, w2, weights, ids = _moe_inputs(t, 64, 6, 2048, 1408, torch.bfloat16, "cuda", gen, skew)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, weights, ids, out=out)
    torch.cuda.synchronize()
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 128])
def test_shared_experts_in_moe_bf16_moonlight_shapes(t) -> None:
    """Moonlight's two shared experts (I = 2 x 1408) inside the fused launches."""
    gen = torch.Generator().manual_seed(t)
    x, w13, w2, weights, ids = _moe_inputs(t, 64, 6, 2048, 1408, torch.bfloat16, "cuda", gen)
    sw13 = (torch.randn(4 * 1408, 2048, generator=gen) / 2048**0.5).to("cuda", torch.bfloat16)
    sw2 = (torch.randn(2048, 2 * 1408, generator=gen) / 2816**0.5).to("cuda", torch.bfloat16)
    tail = torch.arange(64, 66, device="cuda").expand(t, -1)
    ids_s = torch.cat([ids, tail], 1)
    weights_s = torch.cat([weights, torch.ones(t, 2, device="cuda")], 1)
    out = fused_moe(x, w13, w2, weights_s, ids_s, shared=(sw13, sw2))
    torch.cuda.synchronize()
    d = [a.double() for a in (x, w13, w2, weights)]
    want = fused_moe_ref(*d, ids) + _shared_mlp(d[0], sw13.double(), sw2.double())
    assert rel_err(out, want) < 1e-2

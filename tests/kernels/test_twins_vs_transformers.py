"""The torch twins are the executor's CPU implementation: each follows transformers'
DeepSeek-V3 modules' order of operations (dtype handling included) where they agree
with the kernels, and the differences that remain are pinned here."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import fused_add_rmsnorm_ref, fused_moe_ref, moe_router_ref, rmsnorm_ref
from tests.kernels.utils import rel_err

hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
DeepseekV3Config = pytest.importorskip("transformers").DeepseekV3Config

HID, INTER, EXP, TOP_K = 64, 48, 8, 3


def _config() -> object:
    return DeepseekV3Config(
        hidden_size=HID, moe_intermediate_size=INTER, n_routed_experts=EXP,
        num_experts_per_tok=TOP_K, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, hidden_act="silu",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_is_transformers_bitwise(dtype) -> None:
    """Normalise in float32, cast back, then scale: the same bits as DeepseekV3RMSNorm."""
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(5, 7, HID, generator=gen)).to(dtype)
    norm = hf.DeepseekV3RMSNorm(HID, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(HID, generator=gen))
        want = norm(x)
        assert torch.equal(rmsnorm_ref(x, norm.weight, 1e-5), want)
        # The decoder layer: residual = residual + attention output, then the norm.
        r = torch.randn(5, 7, HID, generator=gen).to(dtype)
        normed, new_res = fused_add_rmsnorm_ref(x, r, norm.weight, 1e-5)
        assert torch.equal(new_res, r + x)
        assert torch.equal(normed, norm(r + x))


def _experts(dtype: torch.dtype, gen: torch.Generator) -> torch.nn.Module:
    experts = hf.DeepseekV3Experts(_config())
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(EXP, 2 * INTER, HID, generator=gen) / HID**0.5)
        experts.down_proj.copy_(torch.randn(EXP, HID, INTER, generator=gen) / INTER**0.5)
    return experts.to(dtype)


def _routing(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(t, EXP, generator=gen).softmax(-1).topk(TOP_K, dim=-1)  # float32, int64


@torch.no_grad()
def test_fused_moe_float32_is_transformers() -> None:
    """float32 (the CPU parity tests' dtype): the same sums, to float32 rounding."""
    gen = torch.Generator().manual_seed(2)
    experts = _experts(torch.float32, gen)
    x = torch.randn(21, HID, generator=gen)
    weights, ids = _routing(21, gen)
    got = fused_moe_ref(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    torch.testing.assert_close(got, experts(x, ids, weights), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_fused_moe_bf16_accumulates_in_float32() -> None:
    """bf16: the twin keeps the kernel's float32 GEMMs and top-k sum (activation rounded
    to bf16 between the GEMMs) where transformers rounds each GEMM and sums in bf16; so
    the twin is nearer the exact result, and both are within bf16 error of it."""
    gen = torch.Generator().manual_seed(3)
    experts = _experts(torch.bfloat16, gen)
    x = torch.randn(64, HID, generator=gen).bfloat16()
    weights, ids = _routing(64, gen)
    w13, w2 = experts.gate_up_proj, experts.down_proj
    got = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    exact = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    want = experts(x, ids, weights)
    assert rel_err(got, exact) < rel_err(want, exact) < 1e-2
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_v3_router_is_transformers(dtype) -> None:
    """Sigmoid scores, noaux_tc group-limited selection, normalised then scaled: the same
    experts and weights as DeepseekV3TopkRouter (float32 logits from float32 inputs)."""
    gen = torch.Generator().manual_seed(4)
    router = hf.DeepseekV3TopkRouter(_config())
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXP, HID, generator=gen))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(EXP, generator=gen))
    x = torch.randn(33, HID, generator=gen).to(dtype)
    _, want_w, want_ids = router(x)
    w, ids = moe_router_ref(x, router.weight, router.e_score_correction_bias, TOP_K, "sigmoid",
                            "noaux_tc", 4, 2, True, True, 2.5)  # fmt: skip
    got_order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, got_order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, got_order), want_w.gather(1, want_order))

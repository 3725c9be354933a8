"""One GEMM per input (executors/models/deepseek.fuse_projections): the fused weights are
the checkpoint's own parameters (shared storage), and the fused paths compute what the
separate modules compute, the shared experts inside the fused MoE included."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model_config import ModelConfig
from executors.loader import load_model, read_hf_config
from executors.models import moe as moe_module
from executors.models.layers import GatedMLP, Linear, fuse_linears
from executors.models.mla import MLAttention
from executors.models.moe import MoE
from tests.executors.tiny_models import TinyModel


def _load(tiny: TinyModel) -> torch.nn.Module:
    cfg = ModelConfig.from_dict(read_hf_config(tiny.path))
    return load_model(tiny.path, cfg, dtype=torch.float32, device=torch.device("cpu"))


def test_fused_linears_are_views_of_one_weight() -> None:
    a, b = Linear(6, 4, bias=True), Linear(6, 3, bias=True)
    want_a, want_b = a.weight.detach().clone(), b.bias.detach().clone()
    fused = fuse_linears([a, b])
    assert fused is not None and fused.scale_inv is None
    weight, bias = fused.weight, fused.bias
    assert weight.shape == (7, 6) and bias is not None and bias.shape == (7,)
    assert torch.equal(a.weight, want_a) and torch.equal(b.bias, want_b)
    b.weight.data.fill_(2.0)  # what the loader does: copy into a linear's parameter
    assert torch.equal(weight[4:], torch.full((3, 6), 2.0))
    assert a.weight.data_ptr() == weight.data_ptr()
    with pytest.raises(ValueError, match="bias"):
        fuse_linears([Linear(6, 4, bias=True), Linear(6, 3, bias=False)])


@pytest.mark.parametrize("name", ["v3_mtp", "v2_lite"])
def test_loaded_model_holds_fused_projections(tiny_models: dict[str, TinyModel], name) -> None:
    """Every MLA and gated MLP (MTP layers included) is fused: its linears' weights are
    views of the fused weight, in order."""
    model = _load(tiny_models[name])
    attns = [m for m in model.modules() if isinstance(m, MLAttention)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert attns and mlps
    for attn in attns:
        assert attn.in_proj_weight is not None
        first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
        base = attn.in_proj_weight.data_ptr()
        assert first.weight.data_ptr() == base
        row = attn.in_proj_weight.stride(0) * attn.in_proj_weight.element_size()
        assert attn.kv_a_proj_with_mqa.weight.data_ptr() == base + first.out_features * row
    for mlp in mlps:
        assert mlp.gate_up is not None
        assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up.data_ptr()
    model.to("meta")  # the executor's shutdown: the fused weights must go too
    fused = [a.in_proj_weight for a in attns] + [m.gate_up for m in mlps]
    assert all(w is not None and w.device.type == "meta" for w in fused)


def test_bias_on_one_side_only_stays_apart(tiny_models: dict[str, TinyModel]) -> None:
    """attention_bias without q LoRA: kv_a has a bias and q_proj none; the model still
    builds, with the two projections left apart."""
    raw = read_hf_config(tiny_models["v2_lite"].path) | {"attention_bias": True}
    attn = MLAttention(ModelConfig.from_dict(raw))
    attn.fuse()
    assert attn.in_proj_weight is None and attn.kv_a_proj_with_mqa.bias is not None


def _project(attn: MLAttention, x, cos_sin, blocks: int, block_size: int):
    cache = torch.zeros(blocks, block_size, attn.kv_lora_rank + attn.rope_dim)
    slots = torch.arange(x.shape[0])
    q = attn.project(x, cos_sin, slots, cache)
    return q, cache


@torch.no_grad()
@pytest.mark.parametrize("name", ["v3_mtp", "v3_plain"])
def test_fused_paths_equal_the_separate_modules(
    tiny_models: dict[str, TinyModel], name, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MoE layer with its shared experts inside the fused MoE (short steps) equals the
    routed experts plus the shared MLP run on its own (long steps, or unfused); the MLA
    prologue (query, cache entries) through the fused projection equals the one through
    the separate ones."""
    model = _load(tiny_models[name])
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    hidden = layer.experts.hidden_size
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    fused = layer(x)
    monkeypatch.setattr(moe_module, "SHARED_IN_MOE_MAX_TOKENS", 0)
    apart = layer(x)
    assert layer.shared_experts is not None
    gate_up = layer.shared_experts.gate_up
    layer.shared_experts.gate_up = None
    by_hand = layer.experts(x, *layer.gate(x)) + layer.shared_experts(x)
    layer.shared_experts.gate_up = gate_up
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(apart, by_hand, rtol=1e-5, atol=1e-6)

    attn = next(m for m in model.modules() if isinstance(m, MLAttention))
    cos_sin = model.rotary.cos_sin(torch.arange(5))
    q_fused, cache_fused = _project(attn, x, cos_sin, 2, 4)
    weight, bias = attn.in_proj_weight, attn.in_proj_bias
    attn.in_proj_weight = attn.in_proj_bias = None
    q_apart, cache_apart = _project(attn, x, cos_sin, 2, 4)
    attn.in_proj_weight, attn.in_proj_bias = weight, bias
    torch.testing.assert_close(q_fused, q_apart, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache_fused, cache_apart, rtol=1e-5, atol=1e-6)
    assert cache_fused.abs().sum() > 0


def test_warm_up_visits_both_sides_of_the_shared_expert_switch() -> None:
    """Steps up to SHARED_IN_MOE_MAX_TOKENS compile the MoE kernels with the shared
    experts inside and longer ones without: warm-up must run a step of each size."""
    from kernels.ops import warmup_token_counts

    counts = warmup_token_counts(8192)
    edge = moe_module.SHARED_IN_MOE_MAX_TOKENS
    assert edge in counts and edge + 1 in counts

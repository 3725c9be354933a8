"""The Triton MoE router picks the same experts as its torch twin, with the same weights.

Ids are compared as sets per token (the kernel returns them best first, torch.topk in
no promised order) and weights aligned to them. Where a token's decision is a near-tie in
float64 (two groups or two experts scoring within `tol`), float32 rounding may pick
either; such tokens are skipped, and they must be rare.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import ops  # noqa: E402
from kernels.moe_router import moe_router, router_config  # noqa: E402
from kernels.reference import moe_router_ref  # noqa: E402
from tests.kernels.utils import rel_err  # noqa: E402


def _router(top_k, scoring, topk_method, n_group, topk_group, normalise, scale_after_norm,
            routed_scaling_factor) -> dict:  # fmt: skip
    return dict(top_k=top_k, scoring=scoring, topk_method=topk_method, n_group=n_group,
                topk_group=topk_group, normalise=normalise, scale_after_norm=scale_after_norm,
                routed_scaling_factor=routed_scaling_factor)  # fmt: skip


# name -> (experts, router settings); tiny, with E not a power of two in most
TINY = {
    "v2_greedy": (12, _router(3, "softmax", "greedy", 1, 1, False, False, 1.5)),
    "v2_greedy_normalised_not_scaled": (12, _router(3, "softmax", "greedy", 1, 1, True, False, 16.0)),
    "v2_top1_scaled_not_normalised": (12, _router(1, "softmax", "greedy", 1, 1, True, False, 16.0)),
    "v2_group_limited": (24, _router(3, "softmax", "group_limited_greedy", 4, 2, False, False, 1.5)),
    "v3_noaux_groups": (32, _router(4, "sigmoid", "noaux_tc", 4, 2, True, True, 2.5)),
    "v3_noaux_three_groups": (24, _router(4, "sigmoid", "noaux_tc", 3, 2, True, True, 2.5)),
    "v3_noaux_few_kept": (24, _router(6, "sigmoid", "noaux_tc", 6, 2, True, True, 2.5)),
    "v3_noaux_all_groups_kept": (24, _router(4, "sigmoid", "noaux_tc", 4, 4, True, True, 2.5)),
    "moonlight_noaux_one_group": (20, _router(6, "sigmoid", "noaux_tc", 1, 1, True, True, 2.446)),
}  # fmt: skip


def _inputs(t, e, hidden, r, x_dtype, w_dtype, device, gen):
    """x ~ N(0, 1), weight ~ N(0, 1/hidden) (logits ~ N(0, 1)); for noaux_tc a bias in
    [-1, 0.5), so that some biased scores are negative (masked -inf differs from 0)."""
    x = torch.randn(t, hidden, generator=gen).to(device=device, dtype=x_dtype)
    w = (torch.randn(e, hidden, generator=gen) / hidden**0.5).to(device=device, dtype=w_dtype)
    bias = None
    if r["topk_method"] == "noaux_tc":
        bias = (1.5 * torch.rand(e, generator=gen) - 1.0).to(device)
    return x, w, bias


def decision_gaps(x, weight, bias, r) -> torch.Tensor:
    """Per token, in float64: the smaller margin of the router's two decisions (the
    topk_group-th best group over the next; the k-th chosen expert over the best left out)."""
    logits = x.double() @ weight.double().T  # [T, E]
    scores = logits.softmax(-1) if r["scoring"] == "softmax" else logits.sigmoid()
    choice = scores + bias.double() if r["topk_method"] == "noaux_tc" else scores
    t, e = choice.shape
    n_group, topk_group, k = r["n_group"], r["topk_group"], r["top_k"]
    gap = torch.full((t,), float("inf"), dtype=torch.float64, device=x.device)
    if r["topk_method"] != "greedy" and topk_group < n_group:
        grouped = choice.view(t, n_group, -1)
        if r["topk_method"] == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        else:
            group_scores = grouped.amax(-1)
        ranked = group_scores.sort(-1, descending=True)[0]
        gap = ranked[:, topk_group - 1] - ranked[:, topk_group]
        keep = group_scores >= ranked[:, topk_group - 1 : topk_group]
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, 1), float("-inf"))
    ranked = choice.sort(-1, descending=True)[0]
    if k < e:
        gap = torch.minimum(gap, ranked[:, k - 1] - ranked[:, k])
    return gap


def assert_same_routing(got, want, gaps, num_experts, tol, w_tol) -> None:
    (weights, ids), (ref_w, ref_ids) = got, want
    assert torch.isfinite(weights).all(), "unwritten or NaN weights"
    assert ((ids >= 0) & (ids < num_experts)).all(), "unwritten or out-of-range ids"
    ids_sorted, order = ids.sort(dim=1)
    assert (ids_sorted[:, 1:] != ids_sorted[:, :-1]).all(), "an expert chosen twice"
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    clear = (gaps > tol).to(ids.device)
    assert clear.float().mean() >= 0.9, "too many near-ties to be a meaningful check"
    assert torch.equal(ids_sorted[clear], ref_sorted[clear].to(ids.device))
    w = weights.gather(1, order)[clear]
    w_ref = ref_w.gather(1, ref_order)[clear].to(weights.device)
    assert rel_err(w, w_ref) < w_tol


def _poisoned(t, k, device):
    return (
        torch.full((t, k), float("nan"), device=device),
        torch.full((t, k), -1, dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("t", [1, 5, 37])  # few-token path (BLOCK_T < 16) and 16-token tiles
@pytest.mark.parametrize(
    "logits",
    [{"LOGITS_IN": True}, {"LOGITS_IN": True, "SPLIT_LOGITS": False}, {"LOGITS_IN": False}],
    ids=["logits_in", "cublas_logits", "fused_gemm"],
)
def test_router_matches_twin(name, t, logits, device) -> None:
    """float32 inputs; hidden 40 in BLOCK_H=16 slices (a masked tail). Float32 weights
    take the logits-in path by default (up to 8 tokens from `router_logits`, then
    cuBLAS); cuBLAS for few tokens and the fused GEMM stay reachable by config."""
    e, r = TINY[name]
    gen = torch.Generator().manual_seed(t * 131 + e)
    x, w, bias = _inputs(t, e, 40, r, torch.float32, torch.float32, device, gen)
    out = _poisoned(t, r["top_k"], device)
    moe_router(x, w, bias, **r, config={"BLOCK_H": 16, **logits}, out=out)
    want = moe_router_ref(x, w, bias, **r)
    assert_same_routing(out, want, decision_gaps(x, w, bias, r), e, tol=1e-6, w_tol=1e-6)


@pytest.mark.parametrize("t", [3, 21])
def test_bf16_activations_with_float32_router(t, device) -> None:
    """The executor's case: bf16 hidden states, router weight and bias kept in float32."""
    e, r = TINY["v3_noaux_groups"]
    gen = torch.Generator().manual_seed(t)
    x, w, bias = _inputs(t, e, 72, r, torch.bfloat16, torch.float32, device, gen)
    out = _poisoned(t, r["top_k"], device)
    moe_router(x, w, bias, **r, config={"BLOCK_H": 32}, out=out)
    want = moe_router_ref(x, w, bias, **r)
    assert_same_routing(out, want, decision_gaps(x, w, bias, r), e, tol=1e-6, w_tol=1e-6)


@pytest.mark.parametrize("t", [1, 3, 8])
def test_split_logits_are_the_float32_products(t, device) -> None:
    """router_logits: bf16 activations and a float32 weight, an odd expert count (a
    program's last pair half empty) and a hidden size past one BLOCK_H slice: the float32
    logits of x upcast, to float32 rounding."""
    from kernels.router_logits import router_logits

    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 4160, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(13, 4160, generator=gen) / 64).to(device)
    got = router_logits(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (t, 13)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_ops_backends_agree(device) -> None:
    """kernels.ops.moe_router: the kernel (forced) and the twin route identically."""
    e, r = TINY["v2_group_limited"]
    gen = torch.Generator().manual_seed(7)
    x, w, bias = _inputs(9, e, 32, r, torch.float32, torch.float32, device, gen)
    got = ops.moe_router(x, w, bias, *r.values(), backend="triton")
    want = ops.moe_router(x, w, bias, *r.values(), backend="torch")
    assert_same_routing(got, want, decision_gaps(x, w, bias, r), e, tol=1e-6, w_tol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_shared_expert_columns(backend, device) -> None:
    """num_shared=S appends ids E .. E + S - 1 of weight 1 to every token's routing, after
    the routed choice, which is unchanged."""
    e, r = TINY["moonlight_noaux_one_group"]
    gen = torch.Generator().manual_seed(3)
    x, w, bias = _inputs(5, e, 32, r, torch.float32, torch.float32, device, gen)
    weights, ids = ops.moe_router(x, w, bias, *r.values(), backend=backend)
    weights_s, ids_s = ops.moe_router(x, w, bias, *r.values(), backend=backend, num_shared=2)
    k = r["top_k"]
    assert torch.equal(ids_s[:, :k], ids) and torch.equal(weights_s[:, :k], weights)
    assert ids_s[:, k:].tolist() == [[e, e + 1]] * 5
    assert weights_s[:, k:].tolist() == [[1.0, 1.0]] * 5


def test_config_bounds_the_register_tile() -> None:
    """A few float32 tokens take the per-lane path (BLOCK_T < 16) with at most 8k
    accumulators; everything else uses 16- or 32-token tl.dot tiles."""
    for e_pow2 in (16, 64, 256):
        for t in (1, 3, 8):
            cfg = router_config(t, e_pow2, upcast=True)
            assert cfg["BLOCK_T"] < 16 and cfg["BLOCK_T"] * e_pow2 * cfg["BLOCK_H"] <= 8192
        for t, upcast in ((9, True), (1, False), (4096, False), (4096, True)):
            assert router_config(t, e_pow2, upcast)["BLOCK_T"] in (16, 32)


# Real shapes: (experts, hidden, router settings)
REAL = {
    "moonlight": (64, 2048, _router(6, "sigmoid", "noaux_tc", 1, 1, True, True, 2.446)),
    "deepseek_v3": (256, 7168, _router(8, "sigmoid", "noaux_tc", 8, 4, True, True, 2.5)),
    "deepseek_v2": (160, 5120, _router(6, "softmax", "group_limited_greedy", 8, 3, False, False, 16.0)),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_router_real_shapes(name, t, w_dtype) -> None:
    """bf16 activations; float32 router weights (the executor) or bf16 (tensor cores);
    against the twin in float64. Float32 arithmetic: relative error far under 1e-3."""
    e, hidden, r = REAL[name]
    gen = torch.Generator().manual_seed(t + e)
    x, w, bias = _inputs(t, e, hidden, r, torch.bfloat16, w_dtype, "cuda", gen)
    out = _poisoned(t, r["top_k"], "cuda")
    moe_router(x, w, bias, **r, out=out)
    torch.cuda.synchronize()
    b64 = None if bias is None else bias.double()
    want = moe_router_ref(x.double(), w.double(), b64, **r)
    gaps = decision_gaps(x, w, bias, r)
    tol = 1e-5 if w_dtype == torch.float32 else 1e-4
    assert_same_routing(out, want, gaps, e, tol=tol, w_tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_router_replays_from_a_cuda_graph(t) -> None:
    """No host synchronisation or allocation inside: a captured call, replayed on new
    inputs, gives what a direct call gives."""
    e, hidden, r = REAL["moonlight"]
    gen = torch.Generator().manual_seed(t)
    x, w, bias = _inputs(t, e, hidden, r, torch.bfloat16, torch.float32, "cuda", gen)
    out = _poisoned(t, r["top_k"], "cuda")
    moe_router(x, w, bias, **r, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_router(x, w, bias, **r, out=out)
    x.copy_(torch.randn(t, hidden, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    want = moe_router(x, w, bias, **r)
    torch.cuda.synchronize()
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])

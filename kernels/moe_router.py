"""The MoE router in one Triton kernel: gate logits, scoring, group limit and top-k.

Replaces the ~17 launches of the torch router (casts, linear, sigmoid, bias, group
top-k, scatter, masked fill, top-k, gather, sum, div, mul) with one, which matters at
decode, where every launch has a fixed cost even inside a CUDA graph. Semantics are
those of `kernels.reference.moe_router_ref`. Each program owns BLOCK_T tokens and every
expert: logits [BLOCK_T, E_POW2] accumulate in float32 over BLOCK_H-wide slices of
hidden, then the selection runs in registers as rounds of row-wise argmax (padding
experts sit at -inf). No host synchronisation, and nothing allocated but the two outputs
and, on the logits-in path below, a [T, E] float32 buffer, so the call can be captured
in a CUDA graph.

Float32 gate weights (what the executor keeps) take a split path: the float32 logits
are computed across many SMs and the kernel only selects (`LOGITS_IN`), since one
program per 16 tokens streaming a float32 weight runs at one SM's bandwidth. Up to
SPLIT_LOGITS_MAX_TOKENS tokens (decode at small batch) a Triton kernel computes them,
BLOCK_E experts a program, straight from the bf16 activations (kernels/router_logits.py:
one launch where the cast of x and cuBLAS's GEMV with its reduce were three); more
tokens take cuBLAS (plus a cast of x). So the selection is always one launch.

Precision: the twin casts x and the gate weight to float32; so does the kernel, with
one exception. Float32 anywhere (the executor keeps router weights in float32): tiles
are upcast and multiplied on the CUDA cores, either by tl.dot with IEEE float32 (16-token
tiles) or, for up to 8 tokens, as exact products summed per hidden lane (BLOCK_T < 16;
a 16-row dot would do 16x the products one token needs). Both bf16 (or both fp16): the
tiles go to the tensor cores as they are, since the product of two bf16 values is exact
in float32 and only the accumulation order differs from the twin; config={"UPCAST": True}
forces the float32 path instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.router_logits import SPLIT_LOGITS_MAX_TOKENS, logits_dot, logits_fma, router_logits

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

# GROUP_MODE: how experts outside the best groups are dropped (0: no group limit).
_NO_GROUPS, _TOP2_SUM_NEG_INF, _MAX_ZERO = 0, 1, 2


# Token counts at which router_config changes its launch settings (for warm-up).
ROUTER_THRESHOLDS = (8, 2048)


def router_config(num_tokens: int, e_pow2: int, upcast: bool) -> dict[str, int | bool]:
    """Launch settings. bf16 gate weights: 16-token tiles (tl.dot's smallest) on the tensor
    cores, a [E_POW2, BLOCK_H] weight tile of 16k elements. Float32 weights (the executor
    keeps routers in float32): the dot runs on the CUDA cores, where a 16-row tile costs
    16x the products one token needs, so up to 8 tokens take the product-and-sum path
    (BLOCK_T < 16) with a [BLOCK_T, E_POW2, BLOCK_H] accumulator of 8k elements."""
    if upcast and num_tokens <= 8:
        block_t = min(triton.next_power_of_2(num_tokens), max(1, 8192 // (32 * e_pow2)))
        return {"BLOCK_T": block_t, "BLOCK_H": max(16, 8192 // (block_t * e_pow2)),
                "UPCAST": True, "num_warps": 8, "num_stages": 3}  # fmt: skip
    return {
        "BLOCK_T": 32 if num_tokens >= 2048 and e_pow2 <= 64 and not upcast else 16,
        "BLOCK_H": max(16, (8192 if upcast else 16384) // e_pow2),
        "UPCAST": upcast,
        "num_warps": 4 if e_pow2 <= 64 else 8,
        "num_stages": 3,
    }


# Per-step sizes are runtime arguments Triton must not specialise on (value 1, divisible
# by 16), or a new value would compile a new kernel in the middle of serving.
@triton.jit(do_not_specialize=["T"])
def _moe_router_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, H] gate weight
    bias_ptr,  # [E] e_score_correction_bias (read when HAS_BIAS)
    weights_ptr,  # [T, TOP_K + NUM_SHARED] float32 out
    ids_ptr,  # [T, TOP_K + NUM_SHARED] int64 out
    T,
    E,
    H,
    stride_xt,
    stride_we,
    stride_wt,
    stride_it,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORMALISE: tl.constexpr,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    LOGITS_IN: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SHARED: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < T
    offs_e = tl.arange(0, E_POW2)
    e_mask = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)

    x_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_h[None, :]  # [BLOCK_T, BLOCK_H]
    w_ptrs = w_ptr + offs_e[:, None] * stride_we + offs_h[None, :]  # [E_POW2, BLOCK_H]
    if LOGITS_IN:  # x holds float32 logits [T, E] already (a cuBLAS GEMM: many SMs)
        acc = tl.load(
            x_ptr + offs_t[:, None] * stride_xt + offs_e[None, :],
            mask=t_mask[:, None] & e_mask[None, :],
            other=0.0,
        )
    elif BLOCK_T >= 16:  # tl.dot's smallest tile
        acc = logits_dot(x_ptrs, w_ptrs, t_mask, e_mask, H, UPCAST, BLOCK_T, E_POW2, BLOCK_H)
    else:
        acc = logits_fma(x_ptrs, w_ptrs, t_mask, e_mask, H, BLOCK_T, E_POW2, BLOCK_H)

    neg_inf = float("-inf")
    if SOFTMAX:
        logits = tl.where(e_mask[None, :], acc, neg_inf)
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    else:
        scores = tl.sigmoid(acc)
    choice = scores  # what selection ranks; the weights come from the unbiased scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
        choice = scores + bias[None, :]
    choice = tl.where(e_mask[None, :], choice, neg_inf)

    if GROUP_MODE != 0:
        # Each expert carries its group's score: the sum of the group's top two choices
        # (noaux_tc) or their max (group_limited_greedy). Everything stays [BLOCK_T, E_POW2],
        # so the compiler keeps one register layout.
        group = offs_e // GROUP_SIZE  # [E_POW2]; padding lands past N_GROUP
        group_score = tl.full([BLOCK_T, E_POW2], neg_inf, tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (group == g)[None, :]
            member = tl.where(in_g, choice, neg_inf)
            best = tl.max(member, axis=1)  # [BLOCK_T]
            if GROUP_MODE == 1:
                first = tl.argmax(member, axis=1)
                member = tl.where(offs_e[None, :] == first[:, None], neg_inf, member)
                best = best + tl.max(member, axis=1)
            group_score = tl.where(in_g, best[:, None], group_score)
        keep = tl.zeros([BLOCK_T, E_POW2], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best_group = tl.argmax(group_score, axis=1) // GROUP_SIZE  # ties: lowest group
            chosen = group[None, :] == best_group[:, None]
            keep = keep | chosen
            group_score = tl.where(chosen, neg_inf, group_score)
        kept_or_pad = keep | ~e_mask[None, :]  # padding experts stay at -inf
        if GROUP_MODE == 1:
            choice = tl.where(kept_or_pad, choice, neg_inf)
        else:
            choice = tl.where(kept_or_pad, choice, 0.0)

    # top-k: TOP_K rounds of argmax (ids in descending order of choice); rank remembers
    # which expert went to which output column, and weights come from the scores
    rank = tl.full([BLOCK_T, E_POW2], -1, tl.int32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=1)  # [BLOCK_T]
        tl.store(ids_ptr + offs_t * stride_it + j, pick.to(tl.int64), mask=t_mask)
        chosen = offs_e[None, :] == pick[:, None]
        rank = tl.where(chosen, j, rank)
        choice = tl.where(chosen, neg_inf, choice)
    if NORMALISE:
        total = tl.sum(tl.where(rank >= 0, scores, 0.0), axis=1) + 1e-20
    for j in tl.static_range(TOP_K):
        w_j = tl.sum(tl.where(rank == j, scores, 0.0), axis=1)  # [BLOCK_T]
        if NORMALISE:
            w_j = w_j / total
        if SCALE:
            w_j = w_j * routed_scaling_factor
        tl.store(weights_ptr + offs_t * stride_wt + j, w_j, mask=t_mask)
    # Shared experts as always-chosen experts E, E + 1, ... of weight 1 (the fused MoE
    # runs them beside the routed ones): written here, so they cost no launch.
    for j in tl.static_range(NUM_SHARED):
        tl.store(ids_ptr + offs_t * stride_it + TOP_K + j, (E + j).to(tl.int64), mask=t_mask)
        tl.store(
            weights_ptr + offs_t * stride_wt + TOP_K + j,
            tl.full([BLOCK_T], 1.0, tl.float32),
            mask=t_mask,
        )


def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    normalise: bool,
    scale_after_norm: bool,
    routed_scaling_factor: float,
    config: dict | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    batch_invariant: bool = False,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.reference.moe_router_ref`: x [T, H], weight [E, H],
    bias [E] (used by noaux_tc only) -> (weights [T, top_k] float32, ids [T, top_k] int64),
    ids in descending order of the (biased, group-limited) choice. `config` overrides the
    launch settings of `router_config`; `out` = (weights, ids) receives the result.
    num_shared: that many columns more, ids E, E + 1, ... with weight 1 (shared experts
    for `kernels.fused_moe`'s `shared`).
    batch_invariant: the float32 logits come from the fixed-config GEMM of
    kernels.batch_invariant (not cuBLAS) and the selection runs in 16-token tiles for any
    T, so a token's experts and weights never depend on the batch."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    assert weight.shape[1] == hidden and x.stride(1) == 1 and weight.stride(1) == 1
    assert scoring in SCORING and topk_method in TOPK_METHODS, (scoring, topk_method)
    assert 1 <= top_k <= num_experts and num_experts % n_group == 0
    cols = top_k + num_shared
    if out is None:
        weights = torch.empty(t, cols, dtype=torch.float32, device=x.device)
        ids = torch.empty(t, cols, dtype=torch.int64, device=x.device)
    else:
        weights, ids = out
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert weights.shape == ids.shape == (t, cols) and weights.stride(1) == ids.stride(1) == 1
    if t == 0:
        return weights, ids
    has_bias = topk_method == "noaux_tc"
    if has_bias:
        assert bias is not None and bias.shape == (num_experts,) and bias.stride(0) == 1
    group_mode, n_groups = _NO_GROUPS, 1  # keeping every group is a no-op: skipped
    if topk_method != "greedy" and n_group > 1 and topk_group < n_group:
        group_mode = _TOP2_SUM_NEG_INF if topk_method == "noaux_tc" else _MAX_ZERO
        n_groups = n_group
        assert topk_method != "noaux_tc" or num_experts // n_group >= 2
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    same_16bit = x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
    cfg = dict(router_config(t, e_pow2, upcast=not same_16bit), **(config or {}))
    if not same_16bit:
        cfg["UPCAST"] = True  # tl.dot needs one operand dtype
    # Float32 math: one program streaming the whole float32 gate weight (0.5 MB for
    # Moonlight, 7 MB for V3) is bandwidth-starved on one SM (slower than torch at T = 1),
    # so the logits are computed over many SMs (a few tokens: `router_logits`; more:
    # cuBLAS) and the kernel only selects (logits_in).
    # config={"LOGITS_IN": False} keeps the fused GEMM, {"SPLIT_LOGITS": False} cuBLAS.
    logits_in = batch_invariant or bool(cfg.get("LOGITS_IN", cfg["UPCAST"]))
    if batch_invariant:
        from kernels.batch_invariant import linear as bi_linear

        x = bi_linear(x.float(), weight.float())  # [T, E] float32
        hidden = num_experts
        # Every launch setting fixed (BLOCK_H is unused with logits in, but a constexpr).
        cfg.update(BLOCK_T=16, BLOCK_H=16, num_warps=4 if e_pow2 <= 64 else 8, num_stages=3)
    elif logits_in:
        if t <= SPLIT_LOGITS_MAX_TOKENS and cfg.get("SPLIT_LOGITS", True):
            x = router_logits(x, weight)  # [T, E] float32
        else:
            x = torch.nn.functional.linear(x.float(), weight.float())  # [T, E] float32
        hidden = num_experts
        cfg["BLOCK_T"] = min(16, triton.next_power_of_2(t)) if t < 16 else 16
    block_h = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(hidden)))
    # V2 (original DeepSeek code): a top-1 is not normalised; a normalised top-k is not
    # scaled afterwards unless scale_after_norm (V3).
    normalised = normalise and (scale_after_norm or top_k > 1)
    _moe_router_kernel[(triton.cdiv(t, cfg["BLOCK_T"]),)](
        x, weight, bias if has_bias else weight, weights, ids,
        t, num_experts, hidden,
        x.stride(0), weight.stride(0), weights.stride(0), ids.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k, SOFTMAX=scoring == "softmax", HAS_BIAS=has_bias, GROUP_MODE=group_mode,
        N_GROUP=n_groups, GROUP_SIZE=num_experts // n_groups,
        TOPK_GROUP=topk_group if group_mode else 1,
        NORMALISE=normalised, SCALE=scale_after_norm or not normalised,
        UPCAST=bool(cfg["UPCAST"]), LOGITS_IN=logits_in, E_POW2=e_pow2, BLOCK_T=cfg["BLOCK_T"],
        BLOCK_H=block_h, NUM_SHARED=num_shared,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return weights, ids

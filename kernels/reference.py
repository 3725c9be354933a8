"""Torch reference twins of the Triton kernels: same signatures, same semantics.

Each twin computes in float32 (float64 when given float64 inputs, which is how the
tests build their high-precision references), rounds to the input dtype where its
kernel does, and returns the input dtype. They are the executor's one CPU
implementation (the torch path of `kernels.ops`: the models hold no copy), the
reference the kernel tests compare against and the benchmarks' baseline. Where
transformers' DeepSeek modules round differently, the twin's docstring says so
(tests/kernels/test_twins_vs_transformers.py pins it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFILL_REF_BLOCK = 128  # query rows per attention call of mla_prefill_ref (CPU caches)
# mla_decode_ref on the CPU: requests whose page counts lie within this ratio of the
# group's shortest share one padded attention call, when the calls' estimated cost (a
# call's fixed part worth DECODE_REF_CALL_PAGES pages of one request's attention, at the
# demo model's shapes on a CPU) is below the single padded call's.
DECODE_REF_GROUP_RATIO = 1.5
DECODE_REF_CALL_PAGES = 128


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache (MQA: one latent KV for all heads).

    q: [T, H, L + R], kv_cache: [N, block_size, L + R], block_tables: [B, max_blocks],
    seq_lens: [B], query_start_loc: [B + 1] -> [T, H, L]. Query i of a request with
    q_len queries sees keys [0, seq_len - q_len + i].

    On the CPU requests of similar length go together (`_length_groups`), each group
    over its own pages: one padded call costs every request the longest one's keys, so
    one long request among many short ones multiplies the work. Elsewhere (this twin on
    CUDA) it stays one call: grouping reads the lengths on the host, a sync no CUDA
    graph could hold.
    """
    groups = []
    if q.device.type == "cpu" and block_tables.shape[0] > 1:
        groups = _length_groups(seq_lens.tolist(), kv_cache.shape[1])
    padded = DECODE_REF_CALL_PAGES + block_tables.shape[0] * max((w for _, w in groups), default=0)
    grouped = sum(DECODE_REF_CALL_PAGES + len(reqs) * w for reqs, w in groups)
    if len(groups) <= 1 or padded <= grouped:
        return _mla_decode_padded(
            q, kv_cache, block_tables, seq_lens, query_start_loc, kv_lora_rank, scale
        )
    starts = query_start_loc.tolist()
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for reqs, pages in groups:
        rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in reqs])
        q_lens = torch.tensor([starts[r + 1] - starts[r] for r in reqs])
        out[rows] = _mla_decode_padded(
            q[rows], kv_cache, block_tables[reqs, :pages], seq_lens[reqs],
            F.pad(q_lens.cumsum(0), (1, 0)), kv_lora_rank, scale,
        )  # fmt: skip
    return out


def _length_groups(seq_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Requests by page count, shortest first, in groups whose longest is within
    DECODE_REF_GROUP_RATIO of their shortest; each with its widest page count."""
    pages = [max(1, -(-n // block_size)) for n in seq_lens]
    order = sorted(range(len(pages)), key=pages.__getitem__)
    groups: list[tuple[list[int], int]] = []
    for r in order:
        if groups and pages[r] <= DECODE_REF_GROUP_RATIO * pages[groups[-1][0][0]]:
            groups[-1][0].append(r)
            groups[-1] = (groups[-1][0], pages[r])
        else:
            groups.append(([r], pages[r]))
    return groups


def _mla_decode_padded(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """mla_decode_ref as one call over every request's pages, padded to the widest."""
    t, h, d = q.shape
    b = block_tables.shape[0]
    block_size = kv_cache.shape[1]
    acc = _acc_dtype(q.dtype)
    max_blocks = block_tables.shape[1]
    # Every request's pages, flattened: [B, max_blocks * block_size, D]
    kv = kv_cache[block_tables.long()].reshape(b, max_blocks * block_size, d).to(acc)
    req_of = torch.searchsorted(
        query_start_loc[1:].long(), torch.arange(t, device=q.device), right=True
    )  # [T]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [B]
    row = torch.arange(t, device=q.device) - query_start_loc[req_of].long()  # [T]
    last_visible = seq_lens.long()[req_of] - q_lens[req_of] + row  # [T]
    kv_t = kv[req_of]  # [T, S, D]
    scores = torch.einsum("thd,tsd->ths", q.to(acc), kv_t) * scale  # [T, H, S]
    key_pos = torch.arange(kv.shape[1], device=q.device)
    visible = key_pos[None, :] <= last_visible[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("ths,tsl->thl", probs, kv_t[..., :kv_lora_rank])  # [T, H, L]
    return out.to(q.dtype)


def check_prefill_bound(num_queries: int, num_reqs: int, max_query_len: int) -> None:
    """The prefill's host-side contract, shared by the kernel and the twin: with any query
    there must be a request and a positive max_query_len (the kernel's grid: 0 would
    launch nothing and leave the output unwritten). Not derived from cu_seqlens_q: that
    would be a hidden host sync. A positive bound below the true maximum is not caught
    (checking it needs the same sync) and leaves the kernel's rows past it unwritten."""
    if num_queries == 0:
        return
    if num_reqs == 0:
        raise ValueError(f"{num_queries} prefill queries but no request in cu_seqlens_q")
    if max_query_len <= 0:
        raise ValueError(
            f"max_query_len={max_query_len} with {num_queries} prefill queries: pass the "
            "longest request's query count (a host int)"
        )


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Varlen causal MLA attention with full per-head keys [k_nope | k_pe], bottom-right
    aligned as flash-attn's varlen function: query i of a request with len_q queries and
    len_k >= len_q keys sees keys [0, len_k - len_q + i].

    q_nope: [Tq, H, Dn], q_pe: [Tq, H, R], k_nope: [Tk, H, Dn], k_pe: [Tk, R] (one rope
    key per token, shared by all heads), v: [Tk, H, Dv], cu_seqlens_q/k: [B + 1]
    -> [Tq, H, Dv]. max_query_len is the kernel's launch bound: checked as the kernel
    checks it (`check_prefill_bound`: ValueError when <= 0 with queries), else unused.
    """
    check_prefill_bound(q_nope.shape[0], cu_seqlens_q.shape[0] - 1, max_query_len)
    acc = _acc_dtype(q_nope.dtype)
    h = q_nope.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], h, v.shape[-1])
    for qs, qe, ks, ke in zip(
        cu_seqlens_q[:-1].tolist(),
        cu_seqlens_q[1:].tolist(),
        cu_seqlens_k[:-1].tolist(),
        cu_seqlens_k[1:].tolist(),
    ):
        lq, lk = qe - qs, ke - ks
        if lq == 0:
            continue
        assert lk >= lq, f"request with {lq} queries and only {lk} keys"
        q = torch.cat([q_nope[qs:qe], q_pe[qs:qe]], dim=-1).to(acc).transpose(0, 1)
        k = torch.cat([k_nope[ks:ke], k_pe[ks:ke, None, :].expand(-1, h, -1)], dim=-1)
        k = k.to(acc).transpose(0, 1)  # [H, lk, Dn + R]
        vr = v[ks:ke].to(acc).transpose(0, 1)  # [H, lk, Dv]
        # Query rows in blocks, each against the keys it can see: a long prompt's whole
        # [H, lq, lk] scores would leave the CPU's caches.
        for i0 in range(0, lq, PREFILL_REF_BLOCK):
            i1 = min(lq, i0 + PREFILL_REF_BLOCK)
            seen = lk - lq + i1  # keys of the block's last query
            mask = torch.ones(i1 - i0, seen, dtype=torch.bool, device=q.device)
            o = F.scaled_dot_product_attention(
                q[:, i0:i1], k[:, :seen], vr[:, :seen], attn_mask=mask.tril(lk - lq + i0),
                scale=scale,
            )  # fmt: skip  # [H, i1 - i0, Dv]
            out[qs + i0 : qs + i1] = o.transpose(0, 1).to(out.dtype)
    return out


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: Fp8Scales | None = None,
    round_activations: bool = False,
) -> torch.Tensor:
    """Routed experts: sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].
    shared = (gate/up [2SI, H] gate rows first, down [H, SI]): ids E + s stand for slice
    s (intermediate features s*I .. (s+1)*I) of a shared MLP, which sum to all of it.

    x: [T, H], w13: [E, 2I, H] (gate rows first), w2: [E, H, I], topk_weights: [T, k],
    topk_ids: [T, k] -> [T, H] in x.dtype. The kernel's rounding: both GEMMs and the
    weighted sum over the k experts in float32; the activation silu(gate) * up rounded
    to x.dtype between the GEMMs (the kernel stores it so). Transformers' experts round
    every GEMM output and sum in the activation dtype; float32 models agree to rounding.

    fp8: w13 and w2 are float8_e4m3fn with these block scales; each expert used is
    dequantized (`Fp8Scales.dequantize`); shared experts then stay apart (no `shared`). The kernel also rounds each
    GEMM's input to e4m3 per 128-group of a row (`act_quant_ref`); this twin does not,
    as DeepSeek's bf16 GEMM path and transformers' dequantized FP8 models do not, unless
    `round_activations` (the kernel's arithmetic: the model-level reference of its tests).
    """
    if fp8 is not None and shared is not None:
        raise ValueError("fused_moe_ref: shared experts do not ride with FP8 experts")
    t, k = topk_ids.shape
    acc = _acc_dtype(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)
    num_experts = w13.shape[0] + (0 if shared is None else shared[1].shape[1] // w2.shape[2])
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_w = topk_weights.reshape(-1).to(acc)
    out = torch.zeros(t, x.shape[1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tok = pairs // k
        if fp8 is None:
            w13_e, w2_e = _expert(w13, w2, shared, e)
        else:
            w13_e, w2_e = fp8.dequantize(w13, w2, e, acc)
        rows = x[tok].to(acc)
        if fp8 is not None and round_activations:
            rows = rounded_activations(rows, fp8.block[1])
        gate, up = F.linear(rows, w13_e.to(acc)).chunk(2, dim=-1)  # [n, I] each
        act = (F.silu(gate) * up).to(x.dtype).to(acc)  # [n, I], rounded as the kernel's
        if fp8 is not None and round_activations:
            act = rounded_activations(act, fp8.block[1])
        y = F.linear(act, w2_e.to(acc))  # [n, H]
        out.index_add_(0, tok, y * flat_w[pairs, None])
        start += n
    return out.to(x.dtype)


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class Fp8Scales:
    """Block scales of FP8 routed experts (DeepSeek's layout under transformers' fused
    names): w13 [E, 2I, H] e4m3 has w13_scale [E, 2 * ceil(I / bn), ceil(H / bk)], the
    gate rows' blocks then the up rows' (each half quantized on its own, as the
    checkpoint's gate_proj and up_proj are); w2 [E, H, I] has w2_scale
    [E, ceil(H / bn), ceil(I / bk)]. block = (bn, bk): output rows and input columns
    per scale."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(
        self, w13: torch.Tensor, w2: torch.Tensor, e: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate/up [2I, H] and down [H, I] in `dtype`."""
        half, rows = w13.shape[1] // 2, self.w13_scale.shape[1] // 2
        s13, blk = self.w13_scale[e], self.block
        gate = dequantize_blocks(w13[e, :half], s13[:rows], blk, dtype)
        up = dequantize_blocks(w13[e, half:], s13[rows:], blk, dtype)
        return torch.cat([gate, up]), dequantize_blocks(w2[e], self.w2_scale[e], blk, dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], scale_inv [ceil(N / bn), ceil(K / bk)] float32)
    with w ~= e4m3 * scale_inv per block: each block's largest magnitude maps to 448.
    Partial blocks at the edges are scaled by their own entries (DeepSeek pads them with
    zeros, which changes no maximum). An all-zero block gets scale 1."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q8 = q.view(rows * bn, cols * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q8.contiguous(), scale


def dequantize_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 [N, K] * its block's scale_inv [ceil(N / bn), ceil(K / bk)] -> [N, K] in
    `dtype` (the product taken in float32, or float64 for a float64 `dtype`)."""
    n, k = w.shape
    bn, bk = block
    acc = _acc_dtype(dtype)
    s = scale_inv.to(acc).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.to(acc) * s).to(dtype)


def act_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FP8 kernels do to their input on the fly (DeepSeek's act_quant): x
    [M, K] -> (e4m3 [M, K], scale [M, ceil(K / group)] float32), x ~= e4m3 * scale per
    group of `group` columns of a row; the group's largest magnitude maps to 448 (in
    float32, as the kernels compute it; an all-zero group gets scale 1)."""
    m, k = x.shape
    cols = -(-k // group)
    padded = x.new_zeros(m, cols * group, dtype=torch.float32)
    padded[:, :k] = x
    groups = padded.view(m, cols, group)
    amax = groups.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (groups / scale[:, :, None]).view(m, cols * group)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


def rounded_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] as the FP8 kernels see it: rounded to e4m3 per `group` columns of a row
    (`act_quant_ref`), back in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = act_quant_ref(rows, group)
    k = rows.shape[1]
    cols = scale.shape[1]
    full = q.to(torch.float32).new_zeros(rows.shape[0], cols * group)
    full[:, :k] = q.to(torch.float32)
    back = (full.view(-1, cols, group) * scale[:, :, None]).view(-1, cols * group)[:, :k]
    return back.to(x.dtype).reshape(x.shape)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
    round_activations: bool = False,
) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K].T (+ bias) -> [..., N] in x.dtype, in
    float32 (float64 for float64 x). The kernel (kernels/fp8_linear.py) also rounds x to
    e4m3 per `block[1]`-group of a row (`act_quant_ref`); this twin does not: it is the
    model of DeepSeek's bf16 GEMM path (weight_dequant, then a plain GEMM), unless
    `round_activations` (the kernel's arithmetic)."""
    acc = _acc_dtype(x.dtype)
    if round_activations:
        x = rounded_activations(x.to(acc), block[1])
    w = dequantize_blocks(weight, scale_inv, block, acc)
    out = F.linear(x.to(acc), w, None if bias is None else bias.to(acc))
    return out.to(x.dtype)


def _expert(
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None,
    e: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's gate/up [2I, H] and down [H, I]; e >= E is slice e - E of the shared
    MLP (gate/up [2SI, H], down [H, SI])."""
    if e < w13.shape[0]:
        return w13[e], w2[e]
    assert shared is not None
    sw13, sw2 = shared
    inter, s = w2.shape[2], e - w13.shape[0]
    half = sw13.shape[0] // 2
    rows = slice(s * inter, (s + 1) * inter)
    gate_up = torch.cat([sw13[:half][rows], sw13[half:][rows]])
    return gate_up, sw2[:, rows]


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) with the norm in float32, cast back before
    scaling: transformers' order (DeepseekV3RMSNorm), bit for bit. x: [..., H]. float64
    inputs are normalised in float64 (transformers would go through float32)."""
    xf = x.to(_acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x.dtype); returns (rmsnorm(new_residual), new_residual)."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int
) -> None:
    """In place: logits[r, t] = -inf for r in rows, t < vocab_size not allowed by
    bitmask[r] (int32 words, bit i of word w allows token 32 * w + i)."""
    if rows.numel() == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.flatten(1)[:, :vocab_size].bool()  # [R, vocab_size]
    sub = logits[rows, :vocab_size]
    logits[rows, :vocab_size] = sub.masked_fill(~allowed, float("-inf"))


def moe_router_ref(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek MoE router: x [T, H], weight [E, H], bias [E] (e_score_correction_bias,
    used by noaux_tc only) -> (weights [T, top_k], ids [T, top_k] int64).

    Logits in float32 from float32-cast inputs; scores = softmax or sigmoid. Selection
    ranks scores (+ bias for noaux_tc) among the experts of the `topk_group` best of
    `n_group` groups; the weights are the unbiased scores of the chosen experts,
    normalised to sum 1 when `normalise` (V2: not for a top-1) and multiplied by
    `routed_scaling_factor` when `scale_after_norm` (V3) or when not normalised.
    """
    acc = _acc_dtype(x.dtype)
    logits = F.linear(x.to(acc), weight.to(acc))  # [T, E]
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores
    if topk_method == "noaux_tc":
        assert bias is not None
        choice = scores + bias.to(acc)
    limited = topk_method in ("noaux_tc", "group_limited_greedy")
    if limited and n_group > 1 and topk_group < n_group:  # else every group is kept
        choice = _mask_groups(choice, topk_method, n_group, topk_group)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)
    normalised = normalise and (scale_after_norm or top_k > 1)
    if normalised:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale_after_norm or not normalised:
        weights = weights * routed_scaling_factor
    return weights, ids


def _mask_groups(
    choice: torch.Tensor, topk_method: str, n_group: int, topk_group: int
) -> torch.Tensor:
    """Keep only experts of the `topk_group` best groups (masked ones get -inf or 0).
    choice: [T, E] -> [T, E]. Group score: sum of the top two (noaux_tc) or max."""
    t = choice.shape[0]
    grouped = choice.view(t, n_group, -1)  # [T, G, E/G]
    if topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        fill = float("-inf")
    else:
        group_scores = grouped.max(dim=-1).values
        fill = 0.0
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, -1)  # [T, E]
    return choice.masked_fill(~keep, fill)


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate x: [T, ..., R] by cos/sin: [T, R / 2] in float32, rounded to x.dtype.

    Interleaved layout (DeepSeek's): pairs (x0, x1), (x2, x3), ... each rotated by one
    frequency, results written back in place of the pair. Half-split layout: pairs
    (x_i, x_{i + R/2}).
    """
    shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)


def mla_rope_cache_ref(
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleave: bool,
) -> None:
    """MLA's per-token prologue: q_pe [T, H, R] rotated in place; kv [T, L + R] split
    into c_kv (RMSNorm'd with norm_weight) and k_pe (rotated); [c_kv | k_pe] written
    into kv_cache [N, block_size, L + R] at slot_mapping [T]. cos/sin: [T, R / 2]."""
    rope = q_pe.shape[-1]
    c_kv, k_pe = kv.split([kv.shape[-1] - rope, rope], dim=-1)
    q_pe.copy_(rope_ref(q_pe, cos, sin, interleave))
    entry = torch.cat(
        [rmsnorm_ref(c_kv, norm_weight, eps), rope_ref(k_pe, cos, sin, interleave)], dim=-1
    )
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, entry.to(kv_cache.dtype))

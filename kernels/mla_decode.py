"""Paged MLA decode attention in Triton: absorbed form, split-KV (flash-decoding).

All heads share one latent KV entry per token (MQA over [L latent | R rope] dims), so
one program serves BLOCK_H heads of QG query tokens of one request (QG > 1 when drafts
are verified): each K tile [BLOCK_N, L + R] is loaded once for all QG * BLOCK_H rows
and used for QK^T (all L + R dims) and PV (the first L dims).
Long contexts are cut into `num_splits` pieces run in parallel; a second kernel
merges the pieces from their running max, sum and unnormalised output. Softmax runs in
base 2 (exp2).

Batch-invariant mode cuts every context into pieces of a fixed length from key 0 and
folds them in order (`_fold`): in a small batch a program per piece and the merge
kernel folding their written states, in a batch that fills the machine one program per
row folding as it goes: a full machine gains nothing from more programs, and the
partials' round trip through memory would cost it. Both give the same bits.

Grid of the split kernel: (head block, query token, split); head blocks vary
fastest so the programs reading the same KV pages run together and share L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Shorter pieces cost more in merging than they gain. 64, not 128: a short context at a
# small batch (1k, batch 1 to 8) then spreads over 16 pieces, keeping more SMs busy.
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 64
# Batch-invariant mode: a query's keys are cut at multiples of a fixed piece length (never
# fewer keys than this per piece), so its partial sums and their merge never depend on
# the batch (`invariant_keys_per_split`).
MIN_INVARIANT_KEYS_PER_SPLIT = 256


@triton.jit
def _fold(m_row, l_row, acc_row, m_i, l_i, acc, ROWS: tl.constexpr):
    """Folds a piece (running max m_i in base 2, sum l_i, unnormalised output acc) into a
    row's state, which starts empty (m = -inf, l = 0, acc = 0: folding in the first piece
    reproduces it exactly). ROWS: [ROWS] / [ROWS, L] operands, else scalar / [L]. A piece
    with m_i = -inf (no keys for the row) leaves a non-empty state as it is when its l_i
    and acc are 0 (an empty state and an empty piece give NaN: never met, since piece 0
    holds key 0 for every row). The same operations in the split kernel and the merge kernel, fma explicit
    (no contraction left to the compiler): a row folded in one program and a row merged
    from written pieces carry the same bits."""
    empty = m_i == float("-inf")
    m_new = tl.maximum(m_row, tl.where(empty, m_row, m_i))
    to_row = tl.exp2(m_row - m_new)
    to_piece = tl.where(empty, 0.0, tl.exp2(m_i - m_new))
    l_new = tl.fma(l_row, to_row, l_i * to_piece)
    if ROWS:
        acc_new = tl.fma(acc_row, to_row[:, None], acc * to_piece[:, None])
    else:
        acc_new = tl.fma(acc_row, to_row, acc * to_piece)
    return m_new, l_new, acc_new


@triton.jit
def _attend_piece(
    q_nope,  # [ROWS, L]
    q_pe,  # [ROWS, R]
    kv_ptr,
    bt_row,  # the request's block table row
    stride_kvb,
    stride_kvs,
    sm_scale_log2,
    last_key,  # [ROWS] (QG > 1): query i sees keys <= this
    start,
    end,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    QG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Online softmax over keys [start, end): the piece's running max m (base 2, -inf for a
    row that sees none of its keys), sum l and unnormalised output acc [ROWS, L]."""
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, L], tl.float32)
    # Page ids run one tile ahead (loop-carried): without this Triton's pipeliner keeps only
    # one KV tile in flight (the KV address would hang on a load of the same iteration).
    offs_n = start + tl.arange(0, BLOCK_N)
    page_next = tl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = offs_n < end
        page = page_next.to(tl.int64)
        page_next = tl.load(
            bt_row + (offs_n + BLOCK_N) // PAGE, mask=offs_n + BLOCK_N < end, other=0
        )
        kv_row = kv_ptr + page * stride_kvb + (offs_n % PAGE) * stride_kvs  # [BLOCK_N]
        k_nope = tl.load(kv_row[:, None] + offs_l[None, :], mask=n_mask[:, None], other=0.0)
        k_pe = tl.load(kv_row[:, None] + L + offs_r[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)  # [ROWS, BLOCK_N]
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
        if QG == 1:
            s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new
        else:  # causal among the group's queries: a row may see none of this tile
            visible = n_mask[None, :] & (offs_n[None, :] <= last_key[:, None])
            s = tl.where(visible, s * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])  # [ROWS, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc=acc, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# Per-step integers are runtime arguments that Triton must not specialise on (value 1,
# divisibility by 16): a new value would otherwise compile a new kernel mid-serving.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "num_pieces", "min_keys"])
def _mla_decode_split_kernel(
    q_ptr,  # [T, H, L(+ R)]: the latent query
    qpe_ptr,  # [T, H, R]: its rope part (q_ptr + L when one tensor holds both)
    kv_ptr,  # [N, PAGE, L + R], last dim contiguous
    bt_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    qsl_ptr,  # [B + 1]
    out_ptr,  # [T, H, L] (written when not SPLIT)
    part_acc_ptr,  # [T, H, num_pieces, L] float32: a piece's unnormalised output
    part_ml_ptr,  # [T, H, num_pieces, 2] float32: its running max (base 2) and sum
    num_reqs,
    num_heads,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_kvb,
    stride_kvs,
    stride_bt,
    stride_ot,
    stride_oh,
    num_pieces,
    min_keys,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # one piece per program, written for the merge kernel
    FOLD: tl.constexpr,  # (not SPLIT) fold the row's pieces in order, as FOLD merges do
    PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1)

    # Request of token t: how many requests end at or before t.
    b = tl.zeros([], tl.int32)
    for c in tl.range(0, num_reqs, 128):
        offs_b = c + tl.arange(0, 128)
        ends = tl.load(qsl_ptr + 1 + offs_b, mask=offs_b < num_reqs, other=0)
        b += tl.sum(((ends <= t) & (offs_b < num_reqs)).to(tl.int32), axis=0)
    q_start = tl.load(qsl_ptr + b)
    q_end = tl.load(qsl_ptr + b + 1)
    first_key = tl.load(seq_lens_ptr + b) - (q_end - q_start)  # keys before the request's queries
    i0 = (t - q_start).to(tl.int32)  # this program's first query within the request
    if i0 % QG != 0:  # another program serves this query (QG queries per program)
        return
    # Rows are (query, head) pairs: row = qi * BLOCK_H + head offset.
    rows = tl.arange(0, QG * BLOCK_H)
    heads = pid_h * BLOCK_H + rows % BLOCK_H
    if QG == 1:  # scalar token: keeps the single-query kernel's registers down
        tok = t.to(tl.int64)
        row_ok = heads < num_heads
        kv_len = (first_key + i0 + 1).to(tl.int32)
        last_key = kv_len  # unused
    else:
        qi = rows // BLOCK_H
        tok = (t + qi).to(tl.int64)  # [ROWS]
        row_ok = (tok < q_end) & (heads < num_heads)
        last_key = (first_key + i0 + qi).to(tl.int32)  # [ROWS] query i sees keys <= this
        kv_len = (first_key + i0 + tl.minimum(QG, q_end - t)).to(tl.int32)  # any row sees

    # Pieces come from an upper bound on the context (a CUDA graph's table width), so a
    # short context would be cut into slivers: each piece keeps at least min_keys keys and
    # the pieces past the context stay empty (the merge skips or folds them as no-ops).
    per_piece = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_pieces), BLOCK_N) * BLOCK_N, min_keys)
    first_piece = tl.program_id(2)
    if SPLIT:
        row_ml = part_ml_ptr + ((tok * num_heads + heads) * num_pieces + first_piece) * 2
        # A piece past every row's keys writes only its empty mark (max -inf): pieces
        # follow the table width (batch-invariant mode, a batch that splits), so most may
        # lie past a short context, and storing a whole empty partial for each would spend
        # the layer's memory traffic on nothing.
        if first_piece * per_piece >= kv_len:
            neg_inf = tl.full([QG * BLOCK_H], float("-inf"), tl.float32)
            tl.store(row_ml, neg_inf, mask=row_ok)
            return

    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    q_row = q_ptr + (tok * stride_qt + heads * stride_qh)[:, None]
    q_nope = tl.load(q_row + offs_l[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, L]
    pe_row = qpe_ptr + (tok * stride_pt + heads * stride_ph)[:, None]
    q_pe = tl.load(pe_row + offs_r[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, R]
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    if SPLIT:
        m_i, l_i, acc = _attend_piece(
            q_nope, q_pe, kv_ptr, bt_row, stride_kvb, stride_kvs, sm_scale_log2, last_key,
            first_piece * per_piece, tl.minimum((first_piece + 1) * per_piece, kv_len),
            L, R, PAGE, QG * BLOCK_H, QG, BLOCK_N, PRECISION, NUM_STAGES,
        )  # fmt: skip
        row = (tok * num_heads + heads) * num_pieces + first_piece  # [ROWS]
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)  # -inf: no keys for the row
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + row[:, None] * L + offs_l, acc, mask=row_ok[:, None])
    elif FOLD:  # every piece of the row, folded in order as the FOLD merge folds them
        m_row = tl.full([QG * BLOCK_H], float("-inf"), tl.float32)
        l_row = tl.zeros([QG * BLOCK_H], tl.float32)
        acc_row = tl.zeros([QG * BLOCK_H, L], tl.float32)
        for piece in range(0, tl.cdiv(kv_len, per_piece)):
            m_i, l_i, acc = _attend_piece(
                q_nope, q_pe, kv_ptr, bt_row, stride_kvb, stride_kvs, sm_scale_log2, last_key,
                piece * per_piece, tl.minimum((piece + 1) * per_piece, kv_len),
                L, R, PAGE, QG * BLOCK_H, QG, BLOCK_N, PRECISION, NUM_STAGES,
            )  # fmt: skip
            m_row, l_row, acc_row = _fold(m_row, l_row, acc_row, m_i, l_i, acc, True)
        o = acc_row / tl.where(row_ok, l_row, 1.0)[:, None]  # every valid row saw key 0
        o_ptrs = out_ptr + (tok * stride_ot + heads * stride_oh)[:, None] + offs_l
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # the whole row as one piece
        m_i, l_i, acc = _attend_piece(
            q_nope, q_pe, kv_ptr, bt_row, stride_kvb, stride_kvs, sm_scale_log2, last_key,
            0, kv_len, L, R, PAGE, QG * BLOCK_H, QG, BLOCK_N, PRECISION, NUM_STAGES,
        )  # fmt: skip
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # every valid row saw key 0
        o_ptrs = out_ptr + (tok * stride_ot + heads * stride_oh)[:, None] + offs_l
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_pieces"])
def _mla_decode_merge_kernel(
    part_acc_ptr,  # [T, H, num_pieces, L] float32
    part_ml_ptr,  # [T, H, num_pieces, 2] float32
    out_ptr,  # [T, H, L]
    num_heads,
    stride_ot,
    stride_oh,
    num_pieces,
    L: tl.constexpr,
    PIECES_POW2: tl.constexpr,  # >= every num_pieces: one compiled merge serves them all
    FOLD: tl.constexpr,  # fold the pieces in order (batch-invariant mode), else at once
):
    """Merges a row's pieces; those marked empty (max -inf) hold nothing to read. FOLD:
    in order, exactly as the split kernel folds them when one program covers the row."""
    th = tl.program_id(0)  # t * num_heads + h
    t = th // num_heads
    h = th % num_heads
    offs_l = tl.arange(0, L)
    first = th.to(tl.int64) * num_pieces
    if FOLD:
        m_row = tl.full([], float("-inf"), tl.float32)
        l_row = tl.zeros([], tl.float32)
        acc_row = tl.zeros([L], tl.float32)
        for s in tl.range(0, num_pieces, num_stages=2):
            m_i = tl.load(part_ml_ptr + (first + s) * 2)
            # An empty piece's sum and output were never written: its sum is read and
            # discarded, its output load masked off (no branch for the loads to wait on).
            has = m_i > float("-inf")
            l_i = tl.where(has, tl.load(part_ml_ptr + (first + s) * 2 + 1), 0.0)
            acc = tl.load(
                part_acc_ptr + (first + s) * L + offs_l,
                mask=offs_l < tl.where(has, L, 0),
                other=0.0,
            )
            m_row, l_row, acc_row = _fold(m_row, l_row, acc_row, m_i, l_i, acc, False)
        o = acc_row / l_row
    else:
        offs_s = tl.arange(0, PIECES_POW2)
        m = tl.load(
            part_ml_ptr + (first + offs_s) * 2, mask=offs_s < num_pieces, other=float("-inf")
        )  # [PIECES_POW2]; piece 0 always holds keys, so the max is finite
        m_max = tl.max(m, axis=0)
        l_s = tl.load(part_ml_ptr + (first + offs_s) * 2 + 1, mask=m > float("-inf"), other=0.0)
        denom = tl.sum(l_s * tl.exp2(m - m_max), axis=0)
        acc_row = tl.zeros([L], tl.float32)
        for s in range(num_pieces):
            m_s = tl.load(part_ml_ptr + (first + s) * 2)
            if m_s > float("-inf"):
                acc_row += tl.exp2(m_s - m_max) * tl.load(part_acc_ptr + (first + s) * L + offs_l)
        o = acc_row / denom
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_l
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


def choose_num_splits(
    num_programs: int, max_context: int, num_sms: int, ctas_per_sm: int = 2
) -> int:
    """Splits per query token so that the programs fill one wave of resident CTAs
    (num_sms * ctas_per_sm) without spilling into a second, nearly empty one; each
    piece keeps at least MIN_KEYS_PER_SPLIT keys. max_context is an upper bound."""
    splits = (num_sms * ctas_per_sm) // max(num_programs, 1)
    return max(1, min(splits, max_context // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def invariant_keys_per_split(max_model_len: int) -> int:
    """Batch-invariant mode's piece length for contexts up to `max_model_len`: at least
    MIN_INVARIANT_KEYS_PER_SPLIT keys, a multiple of 128 (every BLOCK_N), and few enough
    pieces (<= MAX_SPLITS) for the longest context."""
    per = max(MIN_INVARIANT_KEYS_PER_SPLIT, triton.cdiv(max_model_len, MAX_SPLITS))
    return triton.cdiv(per, 128) * 128


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def default_config(num_heads: int, multi_query: bool) -> dict[str, int]:
    """Launch settings (tuned for an H200 by benchmarks/kernels_bench.py's sweeps). QG:
    queries of one request per program (draft verification: they share the request's KV
    reads). ctas_per_sm: how many such programs fit on one SM (registers, shared
    memory)."""
    if num_heads <= 16 and not multi_query:
        return {"BLOCK_H": 16, "QG": 1, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3,
                "ctas_per_sm": 2}  # fmt: skip
    qg = 4 if num_heads <= 16 else 1  # 64-row tiles either way
    return {"BLOCK_H": 64, "QG": qg, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3,
            "ctas_per_sm": 1}  # fmt: skip


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
    keys_per_split: int | None = None,
    q_pe: torch.Tensor | None = None,
    fold: bool | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.mla_decode_ref` (and the executor's entry
    point `kernels.ops.mla_decode_attention`): q [T, H, L + R] -> [T, H, L], or q
    [T, H, L] with its rope part q_pe [T, H, R] in another tensor (any strides but the
    last: no copy to join them). No host
    synchronisation: the split count comes from T, H and the block table's width, an
    upper bound on the context. L, R and block_size must be powers of two. `num_splits`,
    `config` override the heuristics; `out` [T, H, L] receives the result.

    keys_per_split (batch-invariant mode, `invariant_keys_per_split`): each query's keys
    are cut into pieces of exactly this many from key 0 and folded in order, with the
    single-query launch config: nothing depends on the other requests. A small batch runs
    a program per piece and merges them (pieces past a query's keys stay empty); a batch
    that fills the machine (or `fold=True`) runs a program per row that folds its pieces
    with the merge's arithmetic, the same bits without the partials' traffic."""
    t, h, _ = q.shape
    if q_pe is None:
        q_pe = q[..., kv_lora_rank:]
    d = kv_lora_rank + q_pe.shape[2]
    page = kv_cache.shape[1]
    lat, rope = kv_lora_rank, d - kv_lora_rank
    assert q.shape[2] in (lat, d) and q_pe.shape == (t, h, rope) and q_pe.stride(2) == 1
    assert kv_cache.shape[2] == d and kv_cache.stride(2) == 1 and q.stride(2) == 1
    assert lat & (lat - 1) == 0 and rope & (rope - 1) == 0 and page & (page - 1) == 0
    if out is None:
        out = torch.empty(t, h, lat, dtype=q.dtype, device=q.device)
    assert out.shape == (t, h, lat) and out.stride(2) == 1
    if t == 0:
        return out
    # T > B only when some request verifies drafts (every request has >= 1 query).
    multi_query = t > block_tables.shape[0] and keys_per_split is None
    cfg = dict(default_config(h, multi_query), **(config or {}))
    block_h = max(16, min(cfg["BLOCK_H"], triton.next_power_of_2(h)))
    head_blocks = triton.cdiv(h, block_h)
    qg = cfg["QG"]
    assert qg & (qg - 1) == 0, "QG must be a power of two"
    min_keys = cfg["BLOCK_N"] if num_splits is not None else MIN_KEYS_PER_SPLIT
    max_context = block_tables.shape[1] * page
    programs = triton.cdiv(t, qg) * head_blocks  # busy ones; the rest return at once
    # Splits that fill one wave with these programs: 1 once the rows fill it themselves.
    wave_splits = choose_num_splits(programs, max_context, _num_sms(q.device), cfg["ctas_per_sm"])
    if keys_per_split is not None:
        # per_piece = max(ceil(ceil(kv_len / pieces) / BLOCK_N) * BLOCK_N, min_keys) is then
        # exactly keys_per_split for every kv_len <= pieces * keys_per_split.
        assert keys_per_split % cfg["BLOCK_N"] == 0 and num_splits is None
        num_pieces = min(MAX_SPLITS, max(2, triton.cdiv(max_context, keys_per_split)))
        min_keys = keys_per_split
        if fold is None:  # a launch choice only: both give the same bits
            fold = wave_splits == 1
        split = not fold
    else:
        assert not fold, "fold is batch-invariant mode's choice (keys_per_split)"
        if num_splits is None:
            num_splits = wave_splits
        num_pieces, split = num_splits, num_splits > 1
    assert 1 <= num_pieces <= MAX_SPLITS, num_pieces
    if split:
        part_acc = torch.empty(t, h, num_pieces, lat, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, h, num_pieces, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(head_blocks, t, num_pieces if split else 1)](
        q, q_pe, kv_cache, block_tables, seq_lens, query_start_loc,
        out, part_acc, part_ml,
        block_tables.shape[0], h, scale * LOG2E,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_pieces, min_keys,
        L=lat, R=rope, PAGE=page, BLOCK_H=block_h, QG=qg, BLOCK_N=cfg["BLOCK_N"],
        SPLIT=split, FOLD=keys_per_split is not None, PRECISION=precision,
        NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    if split:
        _mla_decode_merge_kernel[(t * h,)](
            part_acc, part_ml, out, h, out.stride(0), out.stride(1), num_pieces, L=lat,
            PIECES_POW2=triton.next_power_of_2(MAX_SPLITS), FOLD=keys_per_split is not None,
            num_warps=4,
        )  # fmt: skip
    return out

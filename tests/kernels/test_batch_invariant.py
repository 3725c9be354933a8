"""Batch-invariant mode's kernels: each op is row-invariant, f(x)[i] == f(x[rows])[j]
bit for bit, for batches of 1, 3, 17, 64, 100 and 257 rows (the GPU tests, at Moonlight shapes in
bf16), and computes what its torch counterpart computes (the CPU interpreter, float32).

A failing GPU test names the op, the batch size, how many rows differ, the first one and
the largest absolute difference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import batch_invariant as bi
from kernels import ops
from kernels.mla_decode import invariant_keys_per_split, mla_decode
from kernels.reference import mla_decode_ref, moe_router_ref
from tests.kernels.utils import make_mla_case, rel_err

BATCHES = (1, 3, 17, 64, 100, 257)  # every launch config of the matmul (by rows)


def subsets(total: int, seed: int) -> list[torch.Tensor]:
    """Random row subsets of each size in BATCHES (shuffled: a row changes position)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(total, generator=gen)[:b] for b in BATCHES if b <= total]


def assert_rows_equal(op: str, sub: torch.Tensor, full_rows: torch.Tensor) -> None:
    """sub [b, ...] must equal full_rows [b, ...] exactly; the message is the diagnosis."""
    if torch.equal(sub, full_rows):
        return
    diff = (sub.double() - full_rows.double()).abs().flatten(1)
    diff = diff.nan_to_num(float("inf"))
    bad = (diff > 0).any(dim=1).nonzero().flatten().tolist()
    raise AssertionError(
        f"{op}: batch of {sub.shape[0]}: {len(bad)} rows differ from the same rows computed "
        f"in the full batch; first row {bad[:1]}, max abs diff {diff.max().item():.3e}"
    )


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device="cuda")


# ---- the CPU interpreter: the kernels compute the right thing ------------------------


def test_matmul_equals_torch(device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 70, generator=gen).to(device)
    w = torch.randn(33, 70, generator=gen).to(device)
    b = torch.randn(33, generator=gen).to(device)
    assert rel_err(bi.linear(x, w, b), torch.nn.functional.linear(x, w, b)) < 1e-6
    a = torch.randn(7, 3, 40, generator=gen).to(device).transpose(0, 1)  # strided views
    m = torch.randn(3, 20, 40, generator=gen).to(device).transpose(1, 2)
    assert rel_err(bi.bmm(a, m), torch.bmm(a, m)) < 1e-6
    assert bi.linear(x[:0], w).shape == (0, 33)


def test_a_row_keeps_its_bits_wherever_it_lies_in_the_tile(device) -> None:
    """Row-invariance at a float32 shape small enough for the interpreter: rows moved
    within their 16-row tiles give the same bits. There it holds only if tl.dot reduces
    every row of a tile alike, as an MMA does (conftest's interpreter patch)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 128, generator=gen).to(device)
    w = torch.randn(48, 128, generator=gen).to(device)
    full = bi.linear(x, w)
    for rows in [torch.arange(5, 40), *subsets(40, seed=1)]:
        rows = rows.to(device)
        assert_rows_equal("linear 128->48, float32", bi.linear(x[rows], w), full[rows])


@pytest.mark.parametrize("k", [100, 1100])  # one K segment; three, the last one short
def test_split_and_chained_launches_reduce_k_in_the_same_order(device, k) -> None:
    """The same tile config launched as split-K (segment sums, then the chaining kernel)
    and as one program per tile gives the same bits, with bias, and equals torch."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=gen).to(device)
    w = torch.randn(40, k, generator=gen).to(device)
    b = torch.randn(40, generator=gen).to(device)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    outs = []
    for split in (0, 1, 2):  # one program per tile; chaining kernel; last program chains
        out = torch.empty(1, 3, 40, device=device)
        bi._launch(x.unsqueeze(0), w.t().unsqueeze(0), out, b, {**cfg, "split": split})
        outs.append(out[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert rel_err(outs[0], torch.nn.functional.linear(x, w, b)) < 1e-6


def test_log_softmax_equals_torch(device) -> None:
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)).to(device)
    x[1, :4000] = float("-inf")  # masked tokens (grammars, min_tokens)
    assert (bi.log_softmax(x) - x.log_softmax(-1)).nan_to_num(0.0).abs().max() < 1e-5


def test_router_selects_as_the_twin(device) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).to(device)
    w = torch.randn(16, 64, generator=gen).to(device)
    bias = 0.1 * torch.randn(16, generator=gen).to(device)
    args = (x, w, bias, 4, "sigmoid", "noaux_tc", 4, 2, True, True, 2.5)
    weights, ids = ops.moe_router(*args, backend="triton", batch_invariant=True)
    ref_w, ref_ids = moe_router_ref(*args)  # the same experts, maybe in another order
    ids_sorted, order = ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(ids_sorted, ref_sorted)
    assert rel_err(weights.gather(1, order), ref_w.gather(1, ref_order)) < 1e-5


def test_decode_with_fixed_pieces_matches_reference_and_ignores_companions(device) -> None:
    """Fixed pieces of keys from key 0 (contexts over one and over several pieces); the
    same request alone, with another table width, gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    case = make_mla_case([1, 1, 1], [40, 300, 529], 8, 64, 32, 16, torch.float32, device, gen)
    out = mla_decode(*case.args(), keys_per_split=128)
    assert rel_err(out, mla_decode_ref(*case.clean_args())) < 1e-5
    alone = mla_decode(
        case.q[1:2], case.kv_cache, case.block_tables[1:2, :19], case.seq_lens[1:2],
        torch.tensor([0, 1], device=device), 64, case.scale, keys_per_split=128,
    )  # fmt: skip
    assert torch.equal(alone[0], out[1])


@pytest.mark.parametrize("heads,lat,rope,block_size", [(8, 64, 32, 16), (16, 512, 64, 64)])
def test_decode_folded_in_one_program_equals_the_merged_pieces(
    heads, lat, rope, block_size, device
) -> None:
    """A big batch folds each row's pieces inside its program, a small one merges pieces
    written by separate programs: the same bits (contexts of one, several and a ragged
    last piece), and both match the reference."""
    gen = torch.Generator().manual_seed(heads)
    seq = [40, 300, 529, 128]
    case = make_mla_case([1] * 4, seq, heads, lat, rope, block_size, torch.float32, device, gen)
    merged = mla_decode(*case.args(), keys_per_split=128, fold=False)
    folded = mla_decode(*case.args(), keys_per_split=128, fold=True)
    assert torch.equal(folded, merged)
    assert rel_err(folded, mla_decode_ref(*case.clean_args())) < 1e-5


def test_a_batch_that_fills_the_machine_folds_and_a_small_one_merges(
    device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch follows normal mode's rule (a program per row once the rows fill more
    than half a wave of 2 x the SMs): on 8 SMs 10 rows fold (no merge kernel), 4 rows
    split and merge. Only speed would show a wrong choice, so it is checked here."""
    import kernels.mla_decode as md

    merges: list[tuple] = []
    kernel = md._mla_decode_merge_kernel

    class Recording:
        def __getitem__(self, grid: tuple):
            merges.append(grid)
            return kernel[grid]

    monkeypatch.setattr(md, "_mla_decode_merge_kernel", Recording())
    # A small machine: few rows fill it (the interpreter runs a program at a time).
    monkeypatch.setattr(md, "_num_sms", lambda _device: 8)
    gen = torch.Generator().manual_seed(5)
    for rows, want_merge in ((10, False), (4, True)):
        merges.clear()
        case = make_mla_case([1] * rows, [300] * rows, 8, 64, 32, 16, torch.float32, device, gen)
        out = mla_decode(*case.args(), keys_per_split=128)
        assert bool(merges) == want_merge, (rows, merges)
        assert rel_err(out, mla_decode_ref(*case.clean_args())) < 1e-5


def test_keys_per_split_follows_the_engine_not_the_batch() -> None:
    assert invariant_keys_per_split(8192) == 256
    assert invariant_keys_per_split(163840) == 2560
    assert invariant_keys_per_split(100) == 256


LINEAR_SHAPES = [(576, 2048, False), (3072, 512, True), (2048, 2048, False), (32000, 2048, False)]


def test_the_gpu_linear_test_reaches_every_matmul_config() -> None:
    """The row-invariance test below runs 257 rows and subsets of every size in BATCHES
    at LINEAR_SHAPES: between them they must launch each 16-bit config (else a config
    could differ in bits from the others untested)."""
    configs = bi.MATMUL_CONFIGS_16BIT
    reached = {
        configs.index(bi.matmul_config(torch.bfloat16, m, n))
        for m in BATCHES  # (257, the full batch, among them)
        for n, _, _ in LINEAR_SHAPES
    }
    assert reached == set(range(len(configs)))


def test_ops_refuse_the_mode_without_the_triton_kernels() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="batch-invariant linear: needs the Triton kernels"):
        ops.linear(x, torch.randn(4, 8), batch_invariant=True, backend="torch")


# ---- the GPU: bit-identical rows whatever the batch ---------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,bias", LINEAR_SHAPES)
def test_linear_rows_are_batch_invariant(n, k, bias) -> None:
    x = randn(257, k, seed=n)
    w = randn(n, k, seed=n + 1, scale=0.02)
    b = randn(n, seed=n + 2) if bias else None
    full = ops.linear(x, w, b, batch_invariant=True)
    for rows in subsets(257, n):
        sub = ops.linear(x[rows.cuda()], w, b, batch_invariant=True)
        assert_rows_equal(f"linear {k}->{n}", sub, full[rows.cuda()])


@pytest.mark.gpu
def test_router_logits_in_float32_are_batch_invariant() -> None:
    x = randn(257, 2048, seed=5, dtype=torch.float32)
    w = randn(64, 2048, seed=6, dtype=torch.float32)
    full = ops.linear(x, w, batch_invariant=True)
    for rows in subsets(257, 5):
        assert_rows_equal("linear fp32", ops.linear(x[rows.cuda()], w, batch_invariant=True),
                          full[rows.cuda()])  # fmt: skip


@pytest.mark.gpu
def test_absorbed_head_products_are_batch_invariant() -> None:
    """MLA decode's per-head products at Moonlight's shapes: q_nope [T, 16, 128] x W_UK
    [16, 128, 512] and o_lat [T, 16, 512] x W_UV^T."""
    q = randn(257, 16, 128, seed=7)
    w_uk = randn(16, 128, 512, seed=8, scale=0.05)
    o = randn(257, 16, 512, seed=9)
    w_uv = randn(16, 128, 512, seed=10, scale=0.05)
    full_q = ops.bmm(q.transpose(0, 1), w_uk, True).transpose(0, 1)
    full_o = ops.bmm(o.transpose(0, 1), w_uv.transpose(1, 2), True).transpose(0, 1)
    for rows in subsets(257, 7):
        r = rows.cuda()
        sub_q = ops.bmm(q[r].transpose(0, 1), w_uk, True).transpose(0, 1)
        sub_o = ops.bmm(o[r].transpose(0, 1), w_uv.transpose(1, 2), True).transpose(0, 1)
        assert_rows_equal("bmm q_nope x W_UK", sub_q, full_q[r])
        assert_rows_equal("bmm o_lat x W_UV", sub_o, full_o[r])


@pytest.mark.gpu
def test_log_softmax_rows_are_batch_invariant() -> None:
    x = randn(257, 163840, seed=11, scale=3.0, dtype=torch.float32)
    full = ops.log_softmax(x, True)
    for rows in subsets(257, 11):
        assert_rows_equal("log_softmax", ops.log_softmax(x[rows.cuda()], True), full[rows.cuda()])


@pytest.mark.gpu
def test_rmsnorm_rows_are_batch_invariant() -> None:
    x, r = randn(257, 2048, seed=12), randn(257, 2048, seed=13)
    w = randn(2048, seed=14, scale=0.1) + 1
    full = ops.rmsnorm(x, w, 1e-6)
    full_n, full_res = ops.fused_add_rmsnorm(x, r, w, 1e-6)
    for rows in subsets(257, 12):
        i = rows.cuda()
        assert_rows_equal("rmsnorm", ops.rmsnorm(x[i], w, 1e-6), full[i])
        n, res = ops.fused_add_rmsnorm(x[i], r[i], w, 1e-6)
        assert_rows_equal("fused_add_rmsnorm (normed)", n, full_n[i])
        assert_rows_equal("fused_add_rmsnorm (sum)", res, full_res[i])


@pytest.mark.gpu
@pytest.mark.parametrize("experts,groups,topk_group", [(64, 1, 1), (256, 8, 4)])
def test_router_and_fused_moe_rows_are_batch_invariant(experts, groups, topk_group) -> None:
    """Moonlight (64 experts, top-6, one group) and V3-style grouped routing (256, 8/4);
    the MoE at Moonlight's widths (hidden 2048, intermediate 1408)."""
    x = randn(1100, 2048, seed=15)  # 1100 tokens: the MoE's largest-T tiles
    gate = randn(experts, 2048, seed=16, scale=0.05, dtype=torch.float32)
    bias = randn(experts, seed=17, scale=0.01, dtype=torch.float32)
    args = (gate, bias, 6, "sigmoid", "noaux_tc", groups, topk_group, True, True, 2.446)
    full_w, full_ids = ops.moe_router(x, *args, batch_invariant=True)
    for rows in subsets(1100, experts):
        i = rows.cuda()
        w, ids = ops.moe_router(x[i], *args, batch_invariant=True)
        assert_rows_equal("moe_router ids", ids, full_ids[i])
        assert_rows_equal("moe_router weights", w, full_w[i])
    if experts != 64:
        return
    w13 = randn(64, 2 * 1408, 2048, seed=18, scale=0.02)
    w2 = randn(64, 2048, 1408, seed=19, scale=0.02)
    full = ops.fused_moe(x, w13, w2, full_w, full_ids, batch_invariant=True)
    from kernels.fused_moe import CONFIGS

    gen = torch.Generator().manual_seed(21)
    tops = [torch.randperm(1100, generator=gen)[: min(max_t, 1099)] for max_t, _ in CONFIGS]
    for rows in [*subsets(1100, experts + 1), *tops]:  # and a subset at the top of each row
        i = rows.cuda()
        sub = ops.fused_moe(x[i], w13, w2, full_w[i], full_ids[i], batch_invariant=True)
        assert_rows_equal("fused_moe", sub, full[i])


@pytest.mark.gpu
def test_mla_decode_rows_are_batch_invariant() -> None:
    """257 decode requests (contexts 1..4096, Moonlight's H=16, L=512, R=64, 64-token
    pages); a subset runs with a narrower block table (fewer splits in the grid)."""
    gen = torch.Generator().manual_seed(20)
    seq = torch.randint(1, 4097, (257,), generator=gen).tolist()
    case = make_mla_case([1] * 257, seq, 16, 512, 64, 64, torch.bfloat16, "cuda", gen)
    kv = case.kv_cache.nan_to_num(0.0)
    keys = invariant_keys_per_split(8192)
    full = ops.mla_decode_attention(
        case.q, kv, case.block_tables, case.seq_lens, case.query_start_loc, 512, case.scale,
        keys_per_split=keys,
    )  # fmt: skip
    for rows in subsets(257, 20):
        i = rows.cuda()
        width = -(-max(seq[j] for j in rows.tolist()) // 64)
        qsl = torch.arange(len(rows) + 1, device="cuda")
        sub = ops.mla_decode_attention(
            case.q[i], kv, case.block_tables[i, :width], case.seq_lens[i], qsl, 512,
            case.scale, keys_per_split=keys,
        )  # fmt: skip
        assert_rows_equal("mla_decode", sub, full[i])


@pytest.mark.gpu
def test_mla_prefill_chunks_reduce_as_the_whole_prompt() -> None:
    """A 1000-token prompt computed whole, in chunks of 256 (+ a 232-token tail) beside a
    companion, and as 999 cached keys + its last token: every query row is identical."""
    h, dn, r, dv, total = 16, 128, 64, 128, 1000
    q_nope, q_pe = randn(total, h, dn, seed=21), randn(total, h, r, seed=22)
    k_nope, k_pe, v = (
        randn(total, h, dn, seed=23),
        randn(total, r, seed=24),
        randn(total, h, dv, seed=25),
    )
    scale = (dn + r) ** -0.5

    def run(q0: int, q1: int, companion: int) -> torch.Tensor:
        """Queries [q0, q1) over keys [0, q1), after a companion request of `companion`
        tokens (its own queries and keys come first in the flattened batch)."""
        cq = torch.tensor([0, companion, companion + q1 - q0], device="cuda")
        ck = torch.tensor([0, companion, companion + q1], device="cuda")
        cat = lambda a, b: torch.cat([a, b])  # noqa: E731
        out = ops.mla_prefill_attention(
            cat(q_nope[:companion], q_nope[q0:q1]), cat(q_pe[:companion], q_pe[q0:q1]),
            cat(k_nope[:companion], k_nope[:q1]), cat(k_pe[:companion], k_pe[:q1]),
            cat(v[:companion], v[:q1]), cq, ck, max(q1 - q0, companion, 1), scale,
            batch_invariant=True,
        )  # fmt: skip
        return out[companion:]

    whole = run(0, total, 0)
    for q0 in range(0, total, 256):
        q1 = min(q0 + 256, total)
        assert_rows_equal(f"mla_prefill chunk [{q0}, {q1})", run(q0, q1, 37), whole[q0:q1])
    assert_rows_equal("mla_prefill last token after a cache hit", run(999, 1000, 0), whole[999:])

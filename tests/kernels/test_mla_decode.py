"""Triton MLA decode attention equals its torch twin (float64) on random paged caches."""

from __future__ import annotations

import pytest
import torch
import triton

from kernels.mla_decode import choose_num_splits, default_config, mla_decode
from kernels.reference import mla_decode_ref
from tests.kernels.utils import make_mla_case, rel_err

# (q_lens, seq_lens, heads, L, R, block_size, num_splits, queries per program)
TINY_CASES = [
    ([1, 1, 1], [5, 40, 100], 16, 64, 32, 16, None, 1),  # one split, ragged lengths
    ([1, 4, 2], [9, 40, 100], 16, 64, 32, 16, 3, 1),  # draft verification rows
    ([1, 4, 2], [9, 40, 100], 16, 64, 32, 16, 3, 4),  # ... grouped per request
    ([6, 1, 3], [6, 70, 33], 16, 64, 32, 16, 4, 4),  # more queries than one group
    ([5, 2], [50, 9], 8, 64, 32, 16, None, 2),  # groups of 2, one split
    ([4], [4], 20, 64, 32, 32, 4, 1),  # heads past BLOCK_H; splits with no keys
    ([1, 2], [300, 17], 16, 512, 64, 64, 2, 1),  # the real latent / rope widths
    ([3, 1], [70, 33], 8, 64, 32, 16, 5, 1),  # fewer heads than BLOCK_H
]


@pytest.mark.parametrize("q_lens,seq_lens,heads,lat,rope,block_size,splits,qg", TINY_CASES)
def test_split_kv_decode_matches_reference(
    q_lens, seq_lens, heads, lat, rope, block_size, splits, qg, device
) -> None:
    """Every query sees exactly keys [0, seq_len - q_len + i]: NaN sits in every other slot."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + heads)
    case = make_mla_case(q_lens, seq_lens, heads, lat, rope, block_size, torch.float32, device, gen)
    out = torch.full((sum(q_lens), heads, lat), float("nan"), device=device)
    cfg = {"BLOCK_H": 16, "QG": qg, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    mla_decode(*case.args(), num_splits=splits, config=cfg, out=out)
    ref = mla_decode_ref(*case.clean_args())
    assert torch.isfinite(out).all(), "unwritten or poisoned output elements"
    assert rel_err(out, ref) < 1e-5


def test_splits_fill_the_machine_only_when_needed() -> None:
    """Small batches over long contexts split until the programs fill one wave of resident
    CTAs and no more (at most 64 pieces of >= 64 keys); big batches don't split."""
    assert choose_num_splits(1, 8192, 132) == 64
    assert choose_num_splits(8, 8192, 132) == 33  # 264 programs: 2 per SM
    assert choose_num_splits(64, 4096, 132) == 4  # 256, not 320 (a second, ragged wave)
    assert choose_num_splits(64, 4096, 132, ctas_per_sm=1) == 2
    assert choose_num_splits(512, 8192, 132) == 1
    assert choose_num_splits(1, 300, 132) == 4
    assert choose_num_splits(1, 1024, 132) == 16  # (kernels_bench --only small_sweep)
    assert choose_num_splits(1, 100, 132) == 1  # too short to be worth a merge


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("batch,context", [(1, 8192), (8, 4096), (64, 1024), (128, 8192)])
def test_decode_bf16_real_shapes(batch, context, q_len, heads) -> None:
    if q_len == 4 and batch * context > 64 * 8192:
        pytest.skip("the float64 reference would not fit comfortably")
    gen = torch.Generator().manual_seed(batch * 31 + context + q_len + heads)
    seq = torch.randint(context // 2, context + 1, (batch,), generator=gen).tolist()
    case = make_mla_case(
        [q_len] * batch, seq, heads, 512, 64, 64, torch.bfloat16, torch.device("cuda"), gen
    )
    out = torch.full((batch * q_len, heads, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    mla_decode(*case.args(), out=out)
    torch.cuda.synchronize()
    ref = torch.cat([_ref_slice(case, b, min(b + 16, batch)) for b in range(0, batch, 16)])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


def _ref_slice(case, b0: int, b1: int) -> torch.Tensor:
    """float64 reference for requests [b0, b1) (chunked to bound memory)."""
    qsl = case.query_start_loc
    t0, t1 = int(qsl[b0]), int(qsl[b1])
    args = list(case.clean_args())
    args[0] = args[0][t0:t1]
    args[2] = case.block_tables[b0:b1]
    args[3] = case.seq_lens[b0:b1]
    args[4] = qsl[b0 : b1 + 1] - t0
    return mla_decode_ref(*args)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [2, 1, 3]])
@pytest.mark.parametrize("table_cols", [2, 120], ids=["tight_table", "graph_wide_table"])
def test_default_launch_settings(q_lens, table_cols, device) -> None:
    """The heuristics' own choices (single-query and grouped draft paths) are correct,
    also when the table is far wider than the contexts (a CUDA graph's buffers): the
    splits then come from the width, and pieces past a short context stay empty."""
    gen = torch.Generator().manual_seed(len(q_lens) + sum(q_lens))
    seq = [700, 45, 260]
    case = make_mla_case(
        q_lens, seq, 16, 64, 32, 64, torch.float32, device, gen, extra_table_cols=table_cols
    )
    out = torch.full((sum(q_lens), 16, 64), float("nan"), device=device)
    mla_decode(*case.args(), out=out)
    assert rel_err(out, mla_decode_ref(*case.clean_args())) < 1e-5


@pytest.mark.parametrize("q_lens,seq_lens,heads,lat,rope,block_size,splits,qg", TINY_CASES[1:3])
def test_rope_part_read_apart_equals_joined(
    q_lens, seq_lens, heads, lat, rope, block_size, splits, qg, device
) -> None:
    """q [T, H, L] and q_pe [T, H, R] in separate tensors (strided views, as the absorbed
    path produces them) give the same bits as the joined q [T, H, L + R]."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    case = make_mla_case(q_lens, seq_lens, heads, lat, rope, block_size, torch.float32, device, gen)
    args = list(case.clean_args())
    q = args[0]
    cfg = {"BLOCK_H": 16, "QG": qg, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    joined = mla_decode(*args, num_splits=splits, config=cfg)
    q_lat = q[..., :lat].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, L], head-major
    apart = mla_decode(q_lat, *args[1:], num_splits=splits, config=cfg, q_pe=q[..., lat:])
    assert torch.equal(apart, joined)


def test_cpu_reference_groups_ragged_requests_and_computes_what_one_call_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the twin runs requests of similar length together, each group over its
    own pages (one long request no longer costs every short one its keys): the same
    outputs as one padded call (float64), draft-verification rows included; a batch of
    one length stays one call."""
    import kernels.reference as reference

    calls: list[int] = []
    padded = reference._mla_decode_padded

    def counted(q, *args):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return padded(q, *args)

    gen = torch.Generator().manual_seed(3)
    q_lens = [1, 3, 1, 2, 1, 1, 4, 1]
    seq_lens = [5, 1700, 40, 900, 33, 31, 600, 1800]
    case = make_mla_case(q_lens, seq_lens, 8, 64, 16, 16, torch.float64, torch.device("cpu"), gen)
    want = padded(*case.clean_args())
    monkeypatch.setattr(reference, "_mla_decode_padded", counted)
    got = mla_decode_ref(*case.clean_args())
    assert len(calls) > 1 and sum(calls) == sum(q_lens)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    calls.clear()
    even = make_mla_case([1] * 6, [700] * 6, 8, 64, 16, 16, torch.float64, torch.device("cpu"), gen)
    mla_decode_ref(*even.clean_args())
    assert calls == [6]


@pytest.mark.parametrize("heads", [8, 16, 20, 32, 64, 128])
@pytest.mark.parametrize("sms", [78, 132])
def test_the_simulators_split_count_is_the_launchs(heads, sms) -> None:
    """sim/profile_fit.py `decode_splits` restates this launch's split count (the
    simulator cannot import kernels): the pieces of a context for each batch of rows."""
    from sim.profile_fit import decode_splits

    cfg = default_config(heads, multi_query=False)
    block_h = max(16, min(cfg["BLOCK_H"], triton.next_power_of_2(heads)))
    for rows in range(1, 400):
        programs = triton.cdiv(rows, cfg["QG"]) * triton.cdiv(heads, block_h)
        launch = choose_num_splits(programs, 1 << 20, sms, cfg["ctas_per_sm"])
        assert decode_splits(rows, heads, sms) == launch, rows

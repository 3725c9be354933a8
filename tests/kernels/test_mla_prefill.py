"""Triton MLA prefill attention equals its torch twin on random varlen batches.

Inputs are laid out as the executor passes them: q_nope a view of [Tq, H, Dn + R],
k_nope and v views of one [Tk, H, Dn + Dv] tensor (token stride padded), k_pe a view of
the [Tk, L + R] latent. A NaN token follows the last request in every input and NaN
fills the padding, so a read outside a request's rows poisons the output.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.mla_prefill import mla_prefill
from kernels.reference import check_prefill_bound, mla_prefill_ref
from tests.kernels.utils import rel_err

TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}


def make_prefill_case(
    q_lens: list[int],
    k_lens: list[int],
    heads: int,
    dn: int,
    rope: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> tuple:
    """Random args for mla_prefill (minus the scale): strided views into NaN-padded buffers."""
    tq, tk, pad = sum(q_lens), sum(k_lens), 8

    def buffer(rows: int, shape: tuple[int, ...], used: int) -> torch.Tensor:
        buf = torch.full((rows + 1, *shape[:-1], shape[-1] + pad), float("nan"))
        buf[:rows, ..., :used] = torch.randn(rows, *shape[:-1], used, generator=gen)
        return buf.to(dtype=dtype, device=device)

    q = buffer(tq, (heads, dn + rope), dn + rope)  # [Tq + 1, H, Dn + R + pad]
    kv = buffer(tk, (heads, dn + dv), dn + dv)  # [Tk + 1, H, Dn + Dv + pad]
    latent = buffer(tk, (32 + rope,), 32 + rope)  # [Tk + 1, L + R + pad]
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], device=device)
          for n in (q_lens, k_lens)]  # fmt: skip
    return (
        q[:tq, :, :dn], q[:tq, :, dn : dn + rope],
        kv[:tk, :, :dn], latent[:tk, 32 : 32 + rope], kv[:tk, :, dn : dn + dv],
        cu[0], cu[1], max(q_lens),
    )  # fmt: skip


def upcast(args: tuple, dtype: torch.dtype = torch.float64) -> tuple:
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


# (q_lens, k_lens, heads, Dn, R, Dv, config overrides)
TINY_CASES = [
    ([5, 1, 37, 16], [5, 1, 37, 16], 2, 32, 16, 32, {}),  # plain prefill, ragged lengths
    ([20, 1, 7], [53, 64, 7], 3, 32, 16, 32, {}),  # chunks after cached context, len_q = 1
    ([33, 1, 17], [70, 40, 17], 2, 32, 16, 16, {"BLOCK_M": 32}),  # taller query tiles
    ([33, 9], [70, 41], 2, 16, 32, 64, {"BLOCK_N": 32}),  # wider key tiles, Dn < R < Dv
    ([0, 12, 3], [4, 12, 30], 2, 32, 16, 32, {}),  # a request with no queries
    ([40, 1, 37], [40, 64, 90], 2, 32, 16, 32, {"BLOCK_M": 64, "BLOCK_N": 16}),
    ([19] * 17, [19 + c for c in range(17)], 2, 16, 16, 16, {}),  # every diagonal offset
]


@pytest.mark.parametrize("q_lens,k_lens,heads,dn,rope,dv,cfg", TINY_CASES)
def test_prefill_matches_reference(q_lens, k_lens, heads, dn, rope, dv, cfg, device) -> None:
    """Query i of each request sees exactly keys [0, len_k - len_q + i]; every row written."""
    gen = torch.Generator().manual_seed(sum(k_lens) * 7 + heads)
    args = make_prefill_case(q_lens, k_lens, heads, dn, rope, dv, torch.float32, device, gen)
    scale = (dn + rope) ** -0.5
    out = torch.full((sum(q_lens), heads, dv), float("nan"), device=device)
    mla_prefill(*args, scale, config={**TINY, **cfg}, out=out)
    ref = mla_prefill_ref(*upcast(args), scale)
    assert torch.isfinite(out).all(), "unwritten or poisoned output elements"
    assert rel_err(out, ref) < 1e-5


def test_default_launch_settings_at_model_head_dims(device) -> None:
    """The default tiles with Moonlight's widths (Dn 128, R 64, Dv 128)."""
    gen = torch.Generator().manual_seed(3)
    args = make_prefill_case([70, 3], [70, 90], 2, 128, 64, 128, torch.float32, device, gen)
    out = torch.full((73, 2, 128), float("nan"), device=device)
    mla_prefill(*args, 192**-0.5, out=out)
    assert rel_err(out, mla_prefill_ref(*upcast(args), 192**-0.5)) < 1e-5


def test_reference_is_bottom_right_causal_softmax() -> None:
    """The twin is softmax(q.k * scale) over keys [0, len_k - len_q + i], written out
    one query at a time with k = [k_nope | k_pe] for every head."""
    gen = torch.Generator().manual_seed(5)
    args = make_prefill_case([3, 4], [3, 9], 2, 16, 16, 16, torch.float64, torch.device("cpu"), gen)
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, _ = args
    out = mla_prefill_ref(*args, 0.3)
    for b in range(2):
        lq, lk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        for i in range(lq):
            t, keys = int(cu_q[b]) + i, slice(int(cu_k[b]), int(cu_k[b]) + lk - lq + i + 1)
            s = (q_nope[t] * k_nope[keys]).sum(-1) + k_pe[keys] @ q_pe[t].T  # [keys, H]
            p = (s * 0.3).softmax(0)
            torch.testing.assert_close(out[t], torch.einsum("kh,khd->hd", p, v[keys]))


def test_ops_dispatch(device) -> None:
    """backend='triton' runs the kernel for power-of-two dims and falls back to the twin
    otherwise (Dv = 24 as in the tiny executor models); both agree with the twin."""
    gen = torch.Generator().manual_seed(11)
    for dv in (16, 24):
        args = make_prefill_case([6, 2], [6, 9], 2, 16, 16, dv, torch.float32, device, gen)
        out = ops.mla_prefill_attention(*args, 0.25, backend="triton")
        assert out.shape == (8, 2, dv)
        assert rel_err(out, mla_prefill_ref(*upcast(args), 0.25)) < 1e-5


def test_ops_writes_into_a_given_output(device) -> None:
    """`out` receives the result on both backends (the kernel for power-of-two dims, the
    twin for Dv = 24), and is what comes back: a caller's buffer needs no copy. Here it
    is rows 3..10 of a larger buffer (as the prefill rows of a step's attention output),
    whose other rows stay as they were."""
    gen = torch.Generator().manual_seed(12)
    for dv in (16, 24):
        args = make_prefill_case([6, 2], [6, 9], 2, 16, 16, dv, torch.float32, device, gen)
        buf = torch.full((13, 2, dv), -7.0, device=device)
        out = buf[3:11]
        got = ops.mla_prefill_attention(*args, 0.25, backend="triton", out=out)
        assert got.data_ptr() == out.data_ptr() and got.shape == out.shape
        assert rel_err(out, mla_prefill_ref(*upcast(args), 0.25)) < 1e-5
        assert (buf[:3] == -7.0).all() and (buf[11:] == -7.0).all()


def test_zero_max_query_len_with_queries_is_an_error(device) -> None:
    """max_query_len is the kernel's grid bound, a host int the caller already knows (no
    hidden host sync). 0 with queries would launch nothing and return the unwritten
    output buffer, so the kernel, the twin and both ops backends refuse it alike."""
    gen = torch.Generator().manual_seed(13)
    *args, _ = make_prefill_case([3, 2], [3, 5], 2, 16, 16, 16, torch.float32, device, gen)
    for fn in (mla_prefill, mla_prefill_ref):
        with pytest.raises(ValueError, match="max_query_len"):
            fn(*args, 0, 0.25)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="max_query_len"):
            ops.mla_prefill_attention(*args, 0, 0.25, backend=backend)


def test_queries_without_requests_are_an_error(device) -> None:
    """cu_seqlens_q with no request ([0]) cannot cover Tq > 0 queries."""
    gen = torch.Generator().manual_seed(14)
    q_nope, q_pe, k_nope, k_pe, v, _, cu_k, max_len = make_prefill_case(
        [3], [3], 2, 16, 16, 16, torch.float32, device, gen
    )
    cu_q = cu_k.new_zeros(1)
    for fn in (mla_prefill, mla_prefill_ref):
        with pytest.raises(ValueError, match="no request"):
            fn(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k[:1], max_len, 0.25)


def test_no_queries_need_no_bound(device) -> None:
    """Tq = 0 (requests without queries): nothing to write, max_query_len = 0 is fine."""
    gen = torch.Generator().manual_seed(15)
    args = make_prefill_case([0, 0], [4, 2], 2, 16, 16, 16, torch.float32, device, gen)
    assert args[-1] == 0
    for backend in ("torch", "triton"):
        assert ops.mla_prefill_attention(*args, 0.25, backend=backend).shape == (0, 2, 16)


def test_prefill_bound_guard() -> None:
    """The shared guard: a host-side check on shapes and the host int only."""
    check_prefill_bound(num_queries=0, num_reqs=0, max_query_len=0)
    check_prefill_bound(num_queries=0, num_reqs=3, max_query_len=0)
    check_prefill_bound(num_queries=5, num_reqs=2, max_query_len=4)
    with pytest.raises(ValueError, match="max_query_len"):
        check_prefill_bound(num_queries=5, num_reqs=2, max_query_len=0)
    with pytest.raises(ValueError, match="max_query_len"):
        check_prefill_bound(num_queries=5, num_reqs=2, max_query_len=-1)
    with pytest.raises(ValueError, match="no request"):
        check_prefill_bound(num_queries=5, num_reqs=0, max_query_len=5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(
    "q_lens,k_lens",
    [([1024] * 4, [1024] * 4), ([4096], [8192]), ([1, 700, 333], [2048, 700, 1500])],
    ids=["4x1k", "4k-after-4k", "mixed"],
)
def test_prefill_bf16_real_shapes(q_lens, k_lens, heads) -> None:
    """bf16 operands, fp32 accumulation: within bf16's 1e-2 of the float64 twin."""
    gen = torch.Generator().manual_seed(sum(k_lens) + heads)
    dev = torch.device("cuda")
    args = make_prefill_case(q_lens, k_lens, heads, 128, 64, 128, torch.bfloat16, dev, gen)
    out = torch.full((sum(q_lens), heads, 128), float("nan"), device=dev, dtype=torch.bfloat16)
    mla_prefill(*args, 192**-0.5, out=out)
    torch.cuda.synchronize()
    # The float64 reference, 16 heads at a time (bounds its [H, lq, lk] scores).
    ref = torch.cat([_ref_heads(args, h0, min(h0 + 16, heads)) for h0 in range(0, heads, 16)], 1)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_prefill_fp32_on_gpu() -> None:
    """float32 inputs take the fp32 launch settings and ieee dots: tight bound."""
    gen = torch.Generator().manual_seed(17)
    args = make_prefill_case([300, 77], [800, 77], 16, 128, 64, 128, torch.float32,
                             torch.device("cuda"), gen)  # fmt: skip
    out = mla_prefill(*args, 192**-0.5)
    assert rel_err(out, mla_prefill_ref(*upcast(args), 192**-0.5)) < 1e-5


def _ref_heads(args: tuple, h0: int, h1: int) -> torch.Tensor:
    """float64 twin for heads [h0, h1)."""
    q_nope, q_pe, k_nope, k_pe, v, *rest = args
    heads = (q_nope[:, h0:h1], q_pe[:, h0:h1], k_nope[:, h0:h1], k_pe, v[:, h0:h1], *rest)
    return mla_prefill_ref(*upcast(heads), 192**-0.5)

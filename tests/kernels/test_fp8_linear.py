"""FP8 block-scaled GEMM and fused MoE over FP8 experts (Triton) against their torch twins.

The kernels round every input row to e4m3 per group of bk columns on the fly; the twins
dequantize the weights only. So each kernel is checked twice: tightly against the twin
in float64 given the same rounded activations (`act_quant_ref`: only the float32
accumulation order differs), and loosely against the plain twin (the activations'
rounding, about 2% per GEMM). On the CPU the kernels run in Triton's interpreter, whose
float32 -> e4m3 rounding conftest.py replaces with the GPU's (round to nearest even).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_linear import (
    CONFIGS,
    CUBLAS_MIN_ROWS,
    CUBLAS_PADDED_ROWS,
    GEMV_MAX_ROWS,
    _cublas_takes,
    act_quant,
    fp8_linear,
    fp8_linear_config,
)
from kernels.fused_moe import FP8_CONFIGS, fp8_moe_config, fused_moe
from kernels.reference import (
    Fp8Scales,
    act_quant_ref,
    dequantize_blocks,
    fp8_linear_ref,
    fused_moe_ref,
    quantize_blocks,
)
from tests.kernels.test_fused_moe import _moe_inputs
from tests.kernels.utils import rel_err


def _rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernels see it: e4m3 per row and group, back in float64."""
    q, s = act_quant_ref(x.float(), group)
    return dequantize_blocks(q, s, (1, group), torch.float64)


def _quantized_experts(w13, w2, block):
    """Experts quantized as DeepSeek's checkpoint holds them: gate and up apart."""
    e, two_i, _ = w13.shape
    i = two_i // 2
    q13, q2 = (
        torch.empty_like(w13, dtype=torch.float8_e4m3fn),
        torch.empty_like(w2, dtype=torch.float8_e4m3fn),
    )
    s13, s2 = [], []
    for x in range(e):
        qg, sg = quantize_blocks(w13[x, :i].cpu(), block)
        qu, su = quantize_blocks(w13[x, i:].cpu(), block)
        q13[x, :i], q13[x, i:] = qg, qu
        s13.append(torch.cat([sg, su]))
        qd, sd = quantize_blocks(w2[x].cpu(), block)
        q2[x] = qd
        s2.append(sd)
    dev = w13.device
    return q13, q2, Fp8Scales(torch.stack(s13).to(dev), torch.stack(s2).to(dev), block)


def _w8a8_moe(x, q13, q2, weights, ids, fp8: Fp8Scales) -> torch.Tensor:
    """float64 reference of the FP8 fused MoE with the kernel's activation rounding."""
    group = fp8.block[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            w13_e, w2_e = fp8.dequantize(q13.cpu(), q2.cpu(), int(ids[t, j]), torch.float64)
            gate, up = (_rounded(x[t : t + 1].cpu(), group) @ w13_e.T).chunk(2, -1)
            act = (F.silu(gate) * up).to(x.dtype)  # the kernel stores it in x's dtype
            out[t] += float(weights[t, j]) * (_rounded(act, group) @ w2_e.T)[0]
    return out


# (M, N, K, block, config overrides: several tiles on tiny shapes)
LINEAR_CASES = [
    (3, 300, 200, (128, 128), None),  # partial blocks in N and K
    (37, 96, 256, (32, 64), {"BLOCK_N": 16}),  # column tiles narrower than bn
    (20, 130, 130, (128, 128), {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 2}),
    (1, 64, 128, (64, 128), None),  # one decode row
]


@pytest.mark.parametrize("m,n,k,block,cfg", LINEAR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_twin_on_rounded_activations(m, n, k, block, cfg, bias, device):
    gen = torch.Generator().manual_seed(m + n + k + bias)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    q, s = quantize_blocks(w, block)
    out = fp8_linear(x.to(device), q.to(device), s.to(device),
                     None if b is None else b.to(device), block, cfg)  # fmt: skip
    b64 = None if b is None else b.double()
    want = fp8_linear_ref(_rounded(x, block[1]), q, s, b64, block)
    assert torch.isfinite(out).all(), "unwritten output"
    assert rel_err(out.cpu(), want) < 1e-6
    assert rel_err(out.cpu(), fp8_linear_ref(x.double(), q, s, b64, block)) < 5e-2


@pytest.mark.parametrize("m", sorted({1, min(3, GEMV_MAX_ROWS), GEMV_MAX_ROWS}))
def test_a_few_rows_take_the_gemv_kernel_with_the_fused_kernels_rounding(
    m, device, monkeypatch
) -> None:
    """Up to GEMV_MAX_ROWS rows the GEMV-shaped kernel runs (a partial tile of weight
    rows, K past one chunk of groups and a partial group, a bias, x a view whose rows
    lie apart): the fused kernel's result up to the float32 summation order, each row
    exactly what it gives alone; the fused kernel stays where the caller asks for one
    kernel at every row count, and past GEMV_MAX_ROWS."""
    import kernels.fp8_linear as fp8

    launched = []

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    real = fp8._fp8_gemv_kernel
    monkeypatch.setattr(fp8, "_fp8_gemv_kernel", Spy())
    gen = torch.Generator().manual_seed(m)
    k = fp8.GEMV_GROUPS * 128 + 152
    rows = torch.randn(m, k + 40, generator=gen)
    x = rows[:, :k]
    q, s = quantize_blocks(torch.randn(301, k, generator=gen) / k**0.5, (128, 128))
    b = torch.randn(301, generator=gen)
    # x sliced on the device: its rows lie apart there too (stride_xm is read)
    args = (rows.to(device)[:, :k], q.to(device), s.to(device), b.to(device), (128, 128))
    gemv = fp8_linear(*args)
    assert len(launched) == 1, "the GEMV kernel did not run"
    fused = fp8_linear(*args, allow_cublas=False)
    assert len(launched) == 1, "the fused path took the GEMV kernel"
    want = fp8_linear_ref(_rounded(x, 128), q, s, b.double(), (128, 128))
    assert rel_err(gemv.cpu(), want) < 1e-6 and rel_err(fused.cpu(), want) < 1e-6
    assert rel_err(gemv.cpu(), fused.cpu()) < 1e-6
    for i in range(m):  # each row its own, as alone: one weight pass serves every row
        alone = fp8_linear(args[0][i : i + 1], *args[1:])
        assert torch.equal(gemv[i : i + 1], alone), f"row {i} of {m}"
    launched.clear()
    more = torch.randn(GEMV_MAX_ROWS + 1, k, generator=gen).to(device)
    fp8_linear(more, *args[1:])
    assert not launched, f"{GEMV_MAX_ROWS + 1} rows took the GEMV kernel"


def test_fp8_linear_keeps_leading_dims_and_all_zero_rows(device) -> None:
    """x [2, 3, K] -> [2, 3, N]; an all-zero row (scale 1, never 0/0) gives zeros."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 128, generator=gen)
    x[1, 2] = 0.0
    q, s = quantize_blocks(torch.randn(64, 128, generator=gen), (128, 128))
    out = fp8_linear(x.to(device), q.to(device), s.to(device), None, (128, 128)).cpu()
    assert out.shape == (2, 3, 64) and torch.equal(out[1, 2], torch.zeros(64))
    want = fp8_linear_ref(_rounded(x.view(6, 128), 128), q, s, None, (128, 128))
    assert rel_err(out.view(6, 64), want) < 1e-6


def test_act_quant_rounds_a_partial_last_group_as_the_fused_kernels_read_it(device) -> None:
    """K = 96 in groups of 64: the last group's 32 columns are rounded as a group whose
    missing columns are zeros (the fused kernels' masked K tile)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen)
    q, s = act_quant(x.to(device), 64)
    padded = torch.cat([x, torch.zeros(5, 32)], dim=1)
    want_q, want_s = act_quant_ref(padded, 64)
    assert s.shape == (5, 2) and torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q[:, :96].view(torch.uint8))


def test_a_fused_moe_refuses_rounding_inputs_of_bf16_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w13, w2, weights, ids = _moe_inputs(2, 4, 2, 128, 128, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="A_FP8"):
        fused_moe(x, w13, w2, weights, ids, config={"A_FP8": 1})


@pytest.mark.parametrize("m", [1, 37])
def test_act_quant_rounds_as_the_fused_kernel(m, device) -> None:
    """The quantization before cuBLAS's GEMM: each row's group of 128 columns to e4m3
    exactly as the fused kernel rounds it (act_quant_ref), scales stored M-major."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen) * 3
    x[0, :128] = 0.0  # an all-zero group: scale 1
    q, s = act_quant(x.to(device), 128)
    want_q, want_s = act_quant_ref(x, 128)
    assert s.shape == (m, 2) and s.stride() == (1, m)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_act_quant_pads_rows_with_zeros_of_scale_one(device) -> None:
    """rows > M (a cuBLAS build that takes only multiples of 16 rows): the first M rows
    are act_quant's own, the rest zeros with scale 1, scales still M-major."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, 256, generator=gen)
    q, s = act_quant(x.to(device), 128, 48)
    want_q, want_s = act_quant_ref(x, 128)
    assert q.shape == (48, 256) and s.shape == (48, 2) and s.stride() == (1, 48)
    assert torch.equal(s[:37].cpu(), want_s) and torch.equal(s[37:].cpu(), torch.ones(11, 2))
    assert torch.equal(q[:37].cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert not q[37:].cpu().view(torch.uint8).any()


def test_fp8_moe_config_table_covers_every_token_count() -> None:
    assert fp8_moe_config(1)["BLOCK_M"] == 16 and fp8_moe_config(1)["A_FP8"] == 0
    assert fp8_moe_config(10**9) == FP8_CONFIGS[-1][1]
    assert [m for m, _ in FP8_CONFIGS] == sorted(m for m, _ in FP8_CONFIGS)


def test_fp8_config_table_covers_every_row_count() -> None:
    assert fp8_linear_config(1)["BLOCK_M"] == 16
    assert fp8_linear_config(10**9) == CONFIGS[-1][1]
    assert [m for m, _ in CONFIGS] == sorted(m for m, _ in CONFIGS)


# (T, E, k, H, I, block, config overrides)
MOE_CASES = [
    # inputs rounded in each program's K loop
    (5, 4, 2, 128, 96, (32, 64), {"BLOCK_N": 32, "A_FP8": 0}),  # I not a multiple of bn
    (13, 8, 3, 256, 160, (128, 128), {"BLOCK_N": 64, "A_FP8": 0}),
    (40, 5, 2, 96, 64, (64, 32), {"BLOCK_M": 32, "BLOCK_N": 16, "GROUP_M": 2, "A_FP8": 0}),
    (2, 4, 2, 256, 128, (128, 128), None),  # the table's settings
    # inputs rounded once before each launch; I = 96 leaves a partial group of 32
    (5, 4, 2, 128, 96, (32, 64), {"BLOCK_N": 32, "A_FP8": 1}),
    (40, 5, 2, 96, 64, (64, 32), {"BLOCK_M": 32, "BLOCK_N": 16, "GROUP_M": 2, "A_FP8": 1}),
]


@pytest.mark.parametrize("t,e,k,hidden,inter,block,cfg", MOE_CASES)
def test_fp8_fused_moe_matches_twin_on_rounded_activations(
    t, e, k, hidden, inter, block, cfg, device
) -> None:
    gen = torch.Generator().manual_seed(t + e + hidden)
    x, w13, w2, weights, ids = _moe_inputs(t, e, k, hidden, inter, torch.float32, device, gen)
    q13, q2, fp8 = _quantized_experts(w13, w2, block)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, q13, q2, weights, ids, config=cfg, out=out, fp8=fp8)
    assert torch.isfinite(out).all(), "unwritten output rows"
    assert rel_err(out.cpu(), _w8a8_moe(x, q13, q2, weights, ids, fp8)) < 1e-6
    cpu = Fp8Scales(fp8.w13_scale.cpu(), fp8.w2_scale.cpu(), block)
    twin = fused_moe_ref(x.double().cpu(), q13.cpu(), q2.cpu(), weights.double().cpu(),
                         ids.cpu(), fp8=cpu)  # fmt: skip
    assert rel_err(out.cpu(), twin) < 8e-2


def test_fp8_twin_refuses_shared_experts_riding_along() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w13, w2, weights, ids = _moe_inputs(2, 4, 2, 128, 128, torch.float32, "cpu", gen)
    q13, q2, fp8 = _quantized_experts(w13, w2, (128, 128))
    with pytest.raises(ValueError, match="shared experts"):
        fused_moe_ref(x, q13, q2, weights, ids, shared=(w13[0], w2[0]), fp8=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 256, 2048])
@pytest.mark.parametrize("n,k", [(2048, 2048), (3648, 2048), (2048, 11264)])
def test_fp8_linear_bf16_moonlight_shapes(m, n, k) -> None:
    """Moonlight's projections (o_proj, the fused q + kv_a, a dense down_proj) in bf16."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    q, s = quantize_blocks(torch.randn(n, k, generator=gen) / k**0.5, (128, 128))
    out = fp8_linear(x, q.cuda(), s.cuda(), None, (128, 128))
    torch.cuda.synchronize()
    want = fp8_linear_ref(_rounded(x.cpu(), 128), q, s, None, (128, 128))
    assert rel_err(out.cpu(), want) < 1e-2  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("m", [CUBLAS_MIN_ROWS, 100, 333])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_past_a_few_rows_matches_the_fused_kernel(m, bias) -> None:
    """From CUBLAS_MIN_ROWS rows (cuBLAS's block-scaled GEMM where the GPU has it, odd
    row counts included) the result is the fused kernel's up to the float32
    accumulation order and the bf16 output's rounding."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2048, generator=gen).to("cuda", torch.bfloat16)
    q, s = quantize_blocks(torch.randn(1024, 2048, generator=gen) / 2048**0.5, (128, 128))
    b = torch.randn(1024, generator=gen).to("cuda", torch.bfloat16) if bias else None
    q, s = q.cuda(), s.cuda()
    out = fp8_linear(x, q, s, b, (128, 128))
    fused = fp8_linear(x, q, s, b, (128, 128), allow_cublas=False)
    torch.cuda.synchronize()
    assert rel_err(out.float().cpu(), fused.float().cpu()) < 1e-2


@pytest.mark.gpu
def test_hopper_multiplies_past_a_few_rows_in_cublas() -> None:
    """On an sm_90 GPU the block-scaled GEMM of cuBLAS takes every row count from
    CUBLAS_MIN_ROWS on, padded where its build refuses odd counts: a prefill's
    projections must not fall back to the fused kernel, several times slower there.
    Other GPUs (no such GEMM in this path) keep the fused kernel."""
    x = torch.randn(CUBLAS_MIN_ROWS, 256, device="cuda", dtype=torch.bfloat16)
    multiple = _cublas_takes(x, 256, 256, (128, 128))
    if torch.cuda.get_device_capability() == (9, 0):
        assert multiple in (1, CUBLAS_PADDED_ROWS)
    else:
        assert multiple == 0


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 512])
def test_fp8_fused_moe_bf16_moonlight_shapes(t) -> None:
    """Moonlight-16B-A3B experts (E=64, k=6, H=2048, I=1408) in e4m3."""
    gen = torch.Generator().manual_seed(t)
    x, w13, w2, weights, ids = _moe_inputs(t, 64, 6, 2048, 1408, torch.bfloat16, "cuda", gen)
    q13, q2, fp8 = _quantized_experts(w13.float(), w2.float(), (128, 128))
    out = fused_moe(x, q13.cuda(), q2.cuda(), weights, ids, fp8=fp8)
    torch.cuda.synchronize()
    cpu = Fp8Scales(fp8.w13_scale.cpu(), fp8.w2_scale.cpu(), (128, 128))
    twin = fused_moe_ref(x.double().cpu(), q13.cpu(), q2.cpu(), weights.double().cpu(),
                         ids.cpu(), fp8=cpu)  # fmt: skip
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), twin) < 8e-2  # the activations' e4m3 rounding, twice


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 300, 1100])
def test_fp8_experts_inputs_rounded_once_match_rounding_in_the_loop(t) -> None:
    """The table's settings (A_FP8: rows rounded once before each launch) against the same
    tiles rounding in every program's K loop: the same e4m3 values and scales meet the
    same MMAs, so the results agree to float32 accumulation (Moonlight's experts)."""
    gen = torch.Generator().manual_seed(t)
    x, w13, w2, weights, ids = _moe_inputs(t, 64, 6, 2048, 1408, torch.bfloat16, "cuda", gen)
    q13, q2, fp8 = _quantized_experts(w13.float(), w2.float(), (128, 128))
    q13, q2 = q13.cuda(), q2.cuda()
    cfg = fp8_moe_config(t)
    assert cfg["A_FP8"] == 1
    once = fused_moe(x, q13, q2, weights, ids, fp8=fp8)
    in_loop = fused_moe(x, q13, q2, weights, ids, config=dict(cfg, A_FP8=0), fp8=fp8)
    torch.cuda.synchronize()
    assert torch.isfinite(once).all()
    assert rel_err(once.float().cpu(), in_loop.float().cpu()) < 1e-2

"""Is cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm with 1x128 activation and 128x128
weight scales) faster than our Triton `fp8_linear`, and than a bf16 matmul, at the
projection shapes of Moonlight and DeepSeek-V3? A probe for issue 47's FP8 speed.

    python -m benchmarks.investigations.fp8_scaled_mm [--rows 1,8,64,256,1024,8192]

For each (rows, N, K): median times (triton.testing.do_bench) of bf16 x @ w.T, our
fp8_linear (quantizes x in the kernel), and cuBLAS's block-scaled GEMM (x quantized
first by a torch expression, timed with it and alone), and the largest relative
difference of each FP8 result from the bf16 one. A shape or layout cuBLAS refuses
prints its error instead of a time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from triton.testing import do_bench

from kernels.fp8_linear import fp8_linear

# (name, N, K): Moonlight-16B-A3B and DeepSeek-V3 dense projections (out, in).
SHAPES = (
    ("moonlight q_proj", 3072, 2048),
    ("moonlight o_proj", 2048, 2048),
    ("moonlight dense up+gate", 22528, 2048),
    ("v3 q_b_proj", 24576, 1536),
    ("v3 o_proj", 7168, 16384),
    ("v3 dense up+gate", 36864, 7168),
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 [M, K], scales [M, K / 128] float32 (each 128 columns' max -> 448)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    scale = g.abs().amax(dim=2).clamp(min=1e-12) / 448.0
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).view(m, k)
    return q, scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> e4m3 [N, K], scales [N / 128, K / 128] float32."""
    n, k = w.shape
    g = w.float().view(n // 128, 128, k // 128, 128)
    scale = g.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (g / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def cublas_block_scaled(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor
) -> torch.Tensor:
    # 1x128 activation scales are read M-major (outer dim first), 128x128 weight scales
    # as the transposed operand's.
    return torch._scaled_mm(
        xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=torch.bfloat16
    )


def _us(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, return_mode="median")) * 1e3


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def row(name: str, w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, m: int) -> str:
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=torch.bfloat16)
    ref = x @ w.t()
    t_bf16 = _us(lambda: x @ w.t())
    t_tri = _us(lambda: fp8_linear(x, wq, ws, None, (128, 128)))
    err_tri = _rel(fp8_linear(x, wq, ws, None, (128, 128)), ref)
    try:
        xq, xs = quantize_rows(x)
        err_cub = _rel(cublas_block_scaled(xq, xs, wq, ws), ref)
        t_cub = _us(lambda: cublas_block_scaled(xq, xs, wq, ws))
        t_cubq = _us(lambda: cublas_block_scaled(*quantize_rows(x), wq, ws))
        cub = f"{t_cub:.1f} ({t_cubq:.1f})"
    except RuntimeError as e:
        t_cub, err_cub = float("inf"), float("nan")
        cub = f"refused: {str(e).splitlines()[0][:60]}"
    best = min(t_tri, t_cub)
    return (
        f"| {name} {n}x{k} | {m} | {t_bf16:.1f} | {t_tri:.1f} | {cub} | "
        f"{t_bf16 / best:.2f}x | {err_tri:.3f} / {err_cub:.3f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,64,256,1024,8192")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(
        "| shape | rows | bf16 us | triton fp8 us | cuBLAS fp8 us (+quant) | best fp8 / bf16 "
        "| max rel err triton / cuBLAS |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_blocks(w)
        for m in (int(r) for r in args.rows.split(",")):
            print(row(name, w, wq, ws, m), flush=True)


if __name__ == "__main__":
    main()

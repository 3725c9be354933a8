"""The FP8 projections of a decode step at a few rows: the GEMV-shaped kernel
(`kernels/fp8_linear._fp8_gemv_kernel`) at several tiles against the fused GEMM kernel
the same rows took before it, and the weight-read floor. A probe for issue 47's batch-1
FP8 decode.

    python -m benchmarks.investigations.fp8_gemv [--rows 1,2,4]

Each time is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph: no
launch gaps), each replay running the projection over enough copies of the weight to
overflow L2 (so every weight byte comes from HBM), divided by the copies; the floor is
the weight's bytes (plus its scales) at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
from triton.testing import do_bench_cudagraph

from kernels.fp8_linear import _fp8_gemv_kernel, fp8_linear
from kernels.reference import quantize_blocks

# (name, N, K): Moonlight-16B-A3B's projections a decode step runs (out, in).
SHAPES = (
    ("q + kv_a", 3648, 2048),
    ("o_proj", 2048, 2048),
    ("shared up+gate", 5632, 2048),
    ("shared down", 2048, 2816),
    ("dense up+gate", 22528, 2048),
    ("dense down", 2048, 11264),
)
TILES = (
    (2, 16, 2),
    (4, 16, 4),
    (4, 8, 2),
    (8, 8, 4),
    (8, 16, 8),
    (16, 4, 4),
)  # (BLOCK_N, GROUPS, num_warps)


def copy_bandwidth() -> float:
    """Bytes a second of a large device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench_cudagraph(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


def gemv(x, q, s, out, block_n: int, groups: int, warps: int) -> None:
    m, k = x.shape
    n = q.shape[0]
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, q, s, s, out, n, k, x.stride(0), q.stride(0), s.stride(0), out.stride(0),
        M=m, M_POW2=triton.next_power_of_2(m), HAS_BIAS=False, BLOCK_SN=128,
        BLOCK_N=block_n, BLOCK_K=128, GROUPS=groups,
        num_warps=warps, num_stages=2,
    )  # fmt: skip


L2_OVERFLOW_BYTES = 256 << 20  # more than any lent GPU's L2


def over_copies(fn, copies) -> float:
    """Microseconds of fn(q, s) per weight copy, the copies run in turn in one replay."""

    def all_copies() -> None:
        for q, s in copies:
            fn(q, s)

    return 1e3 * do_bench_cudagraph(all_copies) / len(copies)


def _fused_on(x, q, s) -> None:
    fp8_linear(x, q, s, None, (128, 128), allow_cublas=False)


def _gemv_on(x, out, block_n: int, groups: int, warps: int, q, s) -> None:
    gemv(x, q, s, out, block_n, groups, warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    head = " ".join(f"{f'{bn}x{g}w{w}':>8}" for bn, g, w in TILES)
    print(f"{'shape':16} {'M':>2} {'floor us':>8} {'fused':>8} {head}  best/floor")
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        q, s = quantize_blocks(torch.randn(n, k, generator=gen) / k**0.5, (128, 128))
        q, s = q.cuda(), s.cuda()
        copies = [(q.clone(), s.clone()) for _ in range(-(-L2_OVERFLOW_BYTES // q.numel()))]
        floor_us = (q.numel() + 4 * s.numel()) / bw * 1e6
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            want = fp8_linear(x, q, s, None, (128, 128), allow_cublas=False)
            fused = over_copies(partial(_fused_on, x), copies)
            times = []
            for bn, g, w in TILES:
                out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
                gemv(x, q, s, out, bn, g, w)
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                if not err < 1e-2:
                    raise SystemExit(f"{name} M={m} tile {bn}x{g}w{w}: relative error {err}")
                times.append(over_copies(partial(_gemv_on, x, out, bn, g, w), copies))
            cells = " ".join(f"{t:8.2f}" for t in times)
            print(f"{name:16} {m:2d} {floor_us:8.2f} {fused:8.2f} {cells}  "
                  f"{min(times) / floor_us:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

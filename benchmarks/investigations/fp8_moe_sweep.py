"""Which launch settings make the fused MoE over FP8 experts (kernels/fused_moe.py) fast,
and is rounding each GEMM's inputs once before its launch (A_FP8) better than rounding
them in every program's K loop? A probe for issue 47's FP8 speed; its best rows become
`FP8_CONFIGS`.

    python -m benchmarks.investigations.fp8_moe_sweep [--models moonlight,v3] [--tokens 1,64,...]

For each model's expert shapes and token count T (uniform random routing, seed 0): the
median time (triton.testing.do_bench, L2 cleared) of the bf16 fused MoE at its table's
settings, of the FP8 one at FP8_CONFIGS' settings, and of the FP8 one at every candidate
setting; the best candidate's time against bf16, and each time against the roofline
(the bytes of the experts touched at the copy rate, or the matmul FLOPs at the bf16 matmul
rate measured here: FP8's tensor cores are twice that, so FP8 can beat it). Writes JSON to
$OUT/fp8_moe_sweep.json when OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from triton.testing import do_bench

from kernels.fused_moe import fp8_moe_config, fused_moe, moe_config
from kernels.reference import Fp8Scales, quantize_blocks

# (name, experts, hidden, moe intermediate, top-k): Moonlight-16B-A3B (DeepSeek-V2-Lite has
# the same expert shapes) and DeepSeek-V3.
MODELS = {"moonlight": (64, 2048, 1408, 6), "v3": (256, 7168, 2048, 8)}


def candidates(num_tokens: int, top_k: int, experts: int) -> list[dict[str, int]]:
    """Settings worth timing at T tokens: row tiles up to about twice an expert's share of
    the pairs (a larger tile only pads), two column tiles, warps, stages, both roundings."""
    share = num_tokens * top_k / experts
    rows = [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * share]
    out = []
    for bm, bn, warps, stages, a_fp8 in itertools.product(rows, (64, 128), (4, 8), (3, 4), (0, 1)):
        out.append(
            {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 1 if bm == 16 else 8,
             "num_warps": warps, "num_stages": stages, "A_FP8": a_fp8}
        )  # fmt: skip
    return out


def ceilings() -> tuple[float, float]:
    """(copy bytes/s, bf16 matmul FLOP/s) on this device."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() / (do_bench(lambda: b.copy_(a)) * 1e-3)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = 2 * 8192**3 / (do_bench(lambda: x @ x) * 1e-3)
    return copy, mm


def experts(e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales, tuple]:
    """Random bf16 experts and their FP8 copy (128 x 128 blocks, gate and up apart)."""
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device="cuda") / i**0.5

    def blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One expert at a time: a float32 copy of all of DeepSeek-V3's would not fit. I is
        # a multiple of 128 in both models, so no block straddles gate and up rows.
        pairs = [quantize_blocks(w[x], (128, 128)) for x in range(e)]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    q13, s13 = blocks(w13)
    q2, s2 = blocks(w2)
    return w13, w2, Fp8Scales(s13, s2, (128, 128)), (q13, q2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="moonlight,v3")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096,8192")
    a = p.parse_args()
    torch.manual_seed(0)
    copy, mm = ceilings()
    print(f"copy {copy / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name in a.models.split(","):
        e, h, i, k = MODELS[name]
        w13, w2, scales, (q13, q2) = experts(e, h, i)
        for t in (int(x) for x in a.tokens.split(",")):
            x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).int()
            weights = torch.rand(t, k, device="cuda")
            touched = int(ids.unique().numel())
            flops = 2 * t * k * 3 * h * i
            roof_bf16 = max(touched * 3 * h * i * 2 / copy, flops / mm)
            roof_fp8 = max(touched * 3 * h * i / copy, flops / (2 * mm))

            def run(w_13, w_2, fp8, cfg=None, x=x, weights=weights, ids=ids):  # noqa: ANN001, ANN202
                return do_bench(lambda: fused_moe(x, w_13, w_2, weights, ids, config=cfg, fp8=fp8))

            bf16 = run(w13, w2, None)
            table = run(q13, q2, scales)
            best, best_cfg = float("inf"), None
            for cfg in candidates(t, k, e):
                try:
                    ms = run(q13, q2, scales, cfg)
                except Exception as err:  # noqa: BLE001 (a setting that does not fit)
                    print(f"  {cfg}: {type(err).__name__}", flush=True)
                    continue
                if ms < best:
                    best, best_cfg = ms, cfg
            row = {
                "model": name, "tokens": t, "bf16_ms": bf16, "fp8_table_ms": table,
                "fp8_best_ms": best, "best": best_cfg, "table": fp8_moe_config(t),
                "bf16_table": moe_config(t), "bf16_of_roofline": roof_bf16 * 1e3 / bf16,
                "fp8_best_of_roofline": roof_fp8 * 1e3 / best,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name} T={t}: bf16 {bf16 * 1e3:.1f} us, fp8 table {table * 1e3:.1f} us, "
                f"best {best * 1e3:.1f} us ({bf16 / best:.2f}x bf16; of roofline bf16 "
                f"{row['bf16_of_roofline']:.2f}, fp8 {row['fp8_best_of_roofline']:.2f}) "
                f"{best_cfg}",
                flush=True,
            )
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "fp8_moe_sweep.json"
        path.write_text(json.dumps({"copy": copy, "matmul": mm, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

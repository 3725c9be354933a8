"""Batch-invariant matmul: launch configs against cuBLAS at the shapes of a model (CUDA).

    python benchmarks/investigations/binv_matmul.py [--model moonlight-16b-a3b] [--ms 1,16,64,256,8192]

For every Linear shape of the model (N, K) and row count M: the median time of
F.linear (cuBLAS, picks its kernel from M), of the mode's GEMM (kernels.batch_invariant,
its config chosen by M) and of the same GEMM under each candidate config, and whether
the rows are bit-identical to the mode's on the largest M. A config may be chosen by M
only if every candidate it switches between gives the same bits (the '=' marks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.model_config import load_model_config  # noqa: E402
from kernels import batch_invariant as bi  # noqa: E402


# "f": split-K, the tile's last segment program chains the sums; "s": split-K, then the
# chaining kernel; "c": one program per tile chains the segments itself.
def _cfg(bm: int, bn: int, bk: int, split: int, warps: int = 4, stages: int = 4) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "split": split, "num_warps": warps,
            "num_stages": stages}  # fmt: skip


CANDIDATES_16BIT: dict[str, dict[str, int]] = {
    "f16x32x128": _cfg(16, 32, 128, 2),
    "s16x64x128": _cfg(16, 64, 128, 1),
    "f64x64x128": _cfg(64, 64, 128, 2),
    "s64x128x64": _cfg(64, 128, 64, 1),
    "f64x128x64": _cfg(64, 128, 64, 2),
    "s128x128x64": _cfg(128, 128, 64, 1, 8, 3),
    "f128x128x64": _cfg(128, 128, 64, 2, 8, 3),
    "s128x64x64": _cfg(128, 64, 64, 1, 4, 4),
    "s64x128x128": _cfg(64, 128, 128, 1, 4, 3),
    "c128x128x64": _cfg(128, 128, 64, 0, 8, 4),
    "c128x256x64": _cfg(128, 256, 64, 0, 8, 3),
    "c64x64x64": _cfg(64, 64, 64, 0, 4, 4),
    "c64x128x64": _cfg(64, 128, 64, 0, 4, 4),
    "c128x64x64": _cfg(128, 64, 64, 0, 4, 4),
    "s64x64x128": _cfg(64, 64, 128, 1, 4, 3),
    "f64x64x64": _cfg(64, 64, 64, 2, 4, 4),
}
CANDIDATES_FP32: dict[str, dict[str, int]] = {
    "f16x16x64": _cfg(16, 16, 64, 2, 4, 2),
    "f16x32x64": _cfg(16, 32, 64, 2, 4, 2),
    "f32x16x64": _cfg(32, 16, 64, 2, 4, 2),
    "f16x64x32": _cfg(16, 64, 32, 2, 4, 2),
    "f16x16x32 w2": _cfg(16, 16, 32, 2, 2, 2),
    "f16x16x128 s1": _cfg(16, 16, 128, 2, 4, 1),
    "c32x32x32": _cfg(32, 32, 32, 0, 4, 2),
    "c64x64x32": _cfg(64, 64, 32, 0, 4, 2),
    "c32x64x32": _cfg(32, 64, 32, 0, 4, 2),
    "c64x64x64 s3": _cfg(64, 64, 64, 0, 4, 3),
    "c128x64x32 w8": _cfg(128, 64, 32, 0, 8, 2),
    "c64x64x32 w2": _cfg(64, 64, 32, 0, 2, 2),
}
SPLIT_MAX_M = 512  # split candidates are timed up to this many rows


def bench(fn) -> float:  # noqa: ANN001
    """Device microseconds per call, replayed from a CUDA graph (as the engine runs decode):
    a Triton launch's host overhead would otherwise hide a short kernel's time."""
    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def shapes(model: str) -> list[tuple[str, int, int, torch.dtype]]:
    """(name, N, K, dtype) of every distinct Linear of the model (weight [N, K])."""
    c = load_model_config(model)
    h = c.hidden_size
    bf = torch.bfloat16
    q = [("q_proj", c.num_attention_heads * c.qk_head_dim, h, bf)]
    if c.q_lora_rank:
        q = [
            ("q_a_proj", c.q_lora_rank, h, bf),
            ("q_b_proj", c.num_attention_heads * c.qk_head_dim, c.q_lora_rank, bf),
        ]
    shared = c.moe_intermediate_size * c.n_shared_experts
    return [
        *q,
        ("kv_a_proj", c.kv_entry_dim, h, bf),
        ("o_proj", h, c.num_attention_heads * c.v_head_dim, bf),
        ("shared gate/up", shared, h, bf),
        ("shared down", h, shared, bf),
        ("dense gate/up", c.intermediate_size, h, bf),
        ("dense down", h, c.intermediate_size, bf),
        ("lm_head", c.vocab_size, h, bf),
        ("router (fp32)", c.n_routed_experts, h, torch.float32),
    ]  # fmt: skip


def table(rows: list[tuple[str, int, int, torch.dtype]], cands: dict[str, dict[str, int]],
          ms: list[int]) -> None:  # fmt: skip
    """One markdown table: per shape and M, cuBLAS, the mode (bi.linear: matmul_config's
    pick) and each candidate in microseconds; '=' where a candidate's rows equal the
    mode's on the full M bit for bit."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cols = ["cuBLAS", "mode", *cands]
    print("| shape | N | K | M | " + " | ".join(cols) + " | mode/cuBLAS |")
    print("|---" * (5 + len(cols)) + "|")
    totals = {name: [0.0] * len(ms) for name in cols}
    for name, n, k, dtype in rows:
        w = torch.randn(n, k, generator=gen, device=dev, dtype=dtype) * 0.02
        x_full = torch.randn(max(ms), k, generator=gen, device=dev, dtype=dtype)
        ref = bi.linear(x_full, w)
        for j, m in enumerate(ms):
            x = x_full[:m]
            t_ref = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            t_mode = bench(lambda x=x, w=w: bi.linear(x, w))
            same_mode = "=" if torch.equal(bi.linear(x, w), ref[:m]) else "≠"
            totals["cuBLAS"][j] += t_ref
            totals["mode"][j] += t_mode
            cells = [f"{t_ref:.1f}", f"{t_mode:.1f} {same_mode}"]
            for cname, cfg in cands.items():
                if cfg["split"] and m > SPLIT_MAX_M or not cfg["split"] and m < 64:
                    cells.append("")
                    continue
                out = torch.empty(m, n, dtype=x.dtype, device=dev)

                def run(cfg=cfg, out=out, x=x, w=w) -> None:
                    bi._launch(x.unsqueeze(0), w.t().unsqueeze(0), out.unsqueeze(0), None, cfg)

                run()
                same = "=" if torch.equal(out, ref[:m]) else "≠"
                t = bench(run)
                totals[cname][j] += t
                cells.append(f"{t:.1f} {same}")
            print(f"| {name} | {n} | {k} | {m} | " + " | ".join(cells) + f" | {t_mode / t_ref:.2f} |",
                  flush=True)  # fmt: skip
    for j, m in enumerate(ms):
        print(f"| all, once each | | | {m} | " + " | ".join(f"{totals[c][j]:.0f}" for c in cols)
              + f" | {totals['mode'][j] / totals['cuBLAS'][j]:.2f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--ms", default="1,16,64,256,8192")
    p.add_argument("--no-candidates", action="store_true", help="cuBLAS and the mode only")
    args = p.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    rows = shapes(args.model)
    for dtype, cands in ((torch.bfloat16, CANDIDATES_16BIT), (torch.float32, CANDIDATES_FP32)):
        table([r for r in rows if r[3] == dtype], {} if args.no_candidates else cands, ms)
        print()


if __name__ == "__main__":
    main()

"""Kernel benchmarks against the device's measured ceilings (run on a CUDA machine).

    deepinfer bench kernels [--quick] [--no-sweep] [--only accuracy,mla,moe,rmsnorm,router,prefill,binv_mla,moe_sweep,small_sweep,align]

First the two ceilings: device-to-device copy bandwidth (bytes read + written) and a
bf16 8192^3 matmul on random data (triton.testing.do_bench medians; L2 cleared before
every run). Then each kernel at representative shapes, timed as the median of CUDA-graph
replays with L2 cleared before each (and eagerly, Python launch overhead included),
beside its torch twin and the executor's current torch path (eager medians). Achieved TB/s counts the fewest
bytes the op must move (MLA: the KV read + q + out; MoE: the weights of the distinct
experts touched + x + out). Prints a markdown table; writes JSON to $OUT if set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.fused_moe import CONFIGS, fused_moe, moe_config  # noqa: E402
from kernels.mla_decode import mla_decode  # noqa: E402
from kernels.mla_prefill import mla_prefill  # noqa: E402
from kernels.moe_router import moe_router, router_config  # noqa: E402
from kernels.reference import (  # noqa: E402
    fused_add_rmsnorm_ref,
    fused_moe_ref,
    mla_decode_ref,
    mla_prefill_ref,
    moe_router_ref,
)
from kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402

DEV = torch.device("cuda")
ROWS: list[dict] = []


def ms(fn: Callable[[], object], rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn: Callable[[], object], reps: int = 40) -> float:
    """Median of CUDA-graph replays of fn, L2 cleared before each (launch overhead gone,
    as in a graph-captured decode step)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    events = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def maybe_ms(fn: Callable[[], object] | None, rep: int = 50) -> float | None:
    """Time a baseline; None if it is missing or runs out of memory."""
    if fn is None:
        return None
    try:
        return ms(fn, rep)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def maybe_graph_us(fn: Callable[[], object]) -> float | None:
    """Graph-replay time of a torch baseline in us; None if it cannot be captured."""
    try:
        return graph_ms(fn) * 1e3
    except RuntimeError as err:
        print(f"graph capture failed: {str(err)[:80]}", flush=True)
        return None


def copy_tbps(n: int = 1 << 29) -> float:
    """Device-to-device copy of n bf16 values (1 GiB), counting bytes read + written."""
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * 2 * n / ms(lambda: dst.copy_(src)) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    return 2 * n**3 / ms(lambda: a @ b) / 1e9


def ceilings() -> dict[str, float]:
    return {"copy_tbps": copy_tbps(), "matmul_tflops": matmul_tflops()}


def record(kind: str, shape: str, fn: Callable, nbytes: float, flops: float, ceil: dict,
           twin_ms: float | None = None, exec_ms: float | None = None, **extra) -> None:  # fmt: skip
    """fn is timed twice: replayed from a CUDA graph (the figure used) and launched eagerly."""
    t_ms = graph_ms(fn)
    tbps = nbytes / t_ms / 1e9
    row = {
        "kernel": kind, "shape": shape, "us": t_ms * 1e3, "eager_us": ms(fn) * 1e3, "tbps": tbps,
        "pct_bw": 100 * tbps / ceil["copy_tbps"], "tflops": flops / t_ms / 1e9,
        "twin_us": twin_ms and twin_ms * 1e3, "exec_us": exec_ms and exec_ms * 1e3, **extra,
    }  # fmt: skip
    row["pct_mm"] = 100 * row["tflops"] / ceil["matmul_tflops"]
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def mla_inputs(batch: int, ctx: int, heads: int, q_len: int = 1, page: int = 64):
    nb = batch * math.ceil(ctx / page)
    kv = torch.randn(nb, page, 576, device=DEV, dtype=torch.bfloat16)
    table = torch.randperm(nb, device=DEV).view(batch, -1)
    seq = torch.full((batch,), ctx, device=DEV, dtype=torch.int64)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int64) * q_len
    q = torch.randn(batch * q_len, heads, 576, device=DEV, dtype=torch.bfloat16)
    return (q, kv, table, seq, qsl, 512, 576**-0.5)


def executor_mla() -> Callable | None:
    try:
        from kernels.ops import mla_decode_attention  # the executor's entry point
    except Exception:  # noqa: BLE001 (the baseline is optional)
        return None
    return mla_decode_attention


def bench_mla(ceil: dict, quick: bool) -> None:
    exec_fn = executor_mla()
    shapes = [(b, c) for b in (1, 8, 64, 128) for c in (1024, 4096, 8192)]
    if quick:
        shapes = [(1, 8192), (64, 4096), (128, 8192)]
    for heads in (16, 128):
        for batch, ctx, q_len in [*[(b, c, 1) for b, c in shapes], (64, 4096, 4)]:
            args = mla_inputs(batch, ctx, heads, q_len)
            t = batch * q_len
            nbytes = batch * ctx * 576 * 2 + t * heads * (576 + 512) * 2
            flops = 2 * t * heads * ctx * (576 + 512)
            big = batch * q_len * ctx * heads > 64 * 4096 * 128
            record(
                "mla_decode", f"H={heads} B={batch} ctx={ctx} q={q_len}",
                lambda a=args: mla_decode(*a), nbytes, flops, ceil,
                twin_ms=None if big else maybe_ms(lambda a=args: mla_decode_ref(*a)),
                exec_ms=None if big or exec_fn is None else maybe_ms(lambda a=args: exec_fn(*a)),
            )  # fmt: skip
            del args
            torch.cuda.empty_cache()


def sweep(kind: str, fn: Callable, configs: list[dict], nbytes: float, ceil: dict, **key) -> None:
    """Time fn(config) for each config (skipping ones that fail to compile or launch)."""
    for cfg in configs:
        try:
            t = graph_ms(lambda c=cfg: fn(c), 20)
        except Exception as err:  # noqa: BLE001 (out of resources: skip the config)
            print(f"sweep skip {cfg}: {type(err).__name__}: {str(err)[:80]}", flush=True)
            continue
        row = {"sweep": kind, **key, **cfg, "us": t * 1e3,
               "pct_bw": 100 * nbytes / t / 1e9 / ceil["copy_tbps"]}  # fmt: skip
        ROWS.append(row)
        print(json.dumps(row), flush=True)


def sweep_mla(ceil: dict) -> None:
    """Launch settings around the defaults, at the shapes the targets name."""
    single = [{"splits": 2}, {"splits": 8}, {"num_stages": 4}, {"BLOCK_N": 64, "num_warps": 8}]
    grouped = [{"QG": 4, "BLOCK_N": 32, "num_warps": 8, "num_stages": st} for st in (2, 3)]
    grouped += [{"QG": 4, "BLOCK_N": 16, "num_warps": 8, "num_stages": 4},
                {"QG": 2, "BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
                {"QG": 1, "BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3,
                 "ctas_per_sm": 2}]  # fmt: skip
    for heads, batch, ctx, q_len, configs in (
        (16, 64, 4096, 1, single),
        (16, 64, 4096, 4, grouped),
    ):
        args = mla_inputs(batch, ctx, heads, q_len)

        def run(cfg: dict, args: tuple = args) -> torch.Tensor:
            cfg = dict(cfg)
            return mla_decode(*args, num_splits=cfg.pop("splits", None), config=cfg)

        key = {"H": heads, "B": batch, "ctx": ctx, "q": q_len}
        sweep("mla", run, configs, batch * ctx * 576 * 2, ceil, **key)


def bench_binv_mla(ceil: dict) -> None:
    """Batch-invariant decode attention (fixed pieces of keys_per_split keys) against the
    normal split choice, as the engine runs it: Moonlight's 16 heads, a block table as
    wide as an 8k-context graph's (the binv grid follows the width, not the context);
    for 256-key pieces also each launch (a program per piece, merged; a program per
    row, folding)."""
    width = 8192 // 64
    for batch, ctx in [(b, c) for b in (1, 64, 256) for c in (1024, 4096)]:
        q, kv, table, seq, qsl, lat, scale = mla_inputs(batch, ctx, 16)
        wide = torch.zeros(batch, width, dtype=table.dtype, device=DEV)
        wide[:, : table.shape[1]] = table
        args = (q, kv, wide, seq, qsl, lat, scale)
        nbytes = batch * ctx * 576 * 2 + batch * 16 * (576 + 512) * 2
        flops = 2 * batch * 16 * ctx * (576 + 512)
        record("mla_decode normal", f"H=16 B={batch} ctx={ctx}",
               lambda a=args: mla_decode(*a), nbytes, flops, ceil)  # fmt: skip
        for keys in (256, 512, 1024):
            record(f"mla_decode binv {keys}", f"H=16 B={batch} ctx={ctx}",
                   lambda a=args, k=keys: mla_decode(*a, keys_per_split=k), nbytes, flops,
                   ceil)  # fmt: skip
        # Both launches of the engine's 256-key pieces (the batch picks one; same bits).
        for fold in (False, True):
            record(f"mla_decode binv 256 {'folded' if fold else 'split'}",
                   f"H=16 B={batch} ctx={ctx}",
                   lambda a=args, f=fold: mla_decode(*a, keys_per_split=256, fold=f), nbytes,
                   flops, ceil)  # fmt: skip
        del args, kv
        torch.cuda.empty_cache()


def moe_inputs(t: int, e: int = 64, k: int = 6, hidden: int = 2048, inter: int = 1408):
    bf = {"device": DEV, "dtype": torch.bfloat16}
    x = torch.randn(t, hidden, **bf)
    w13 = torch.randn(e, 2 * inter, hidden, **bf) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, **bf) / inter**0.5
    weights, ids = torch.randn(t, e, device=DEV).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights, ids


def executor_moe(w13: torch.Tensor, w2: torch.Tensor) -> Callable | None:
    try:
        from executors.models.moe import Experts
    except Exception:  # noqa: BLE001
        return None
    experts = Experts(w13.shape[0], w13.shape[2], w2.shape[2]).to(DEV, torch.bfloat16)
    experts.gate_up_proj.data, experts.down_proj.data = w13, w2
    return experts


def bench_moe(ceil: dict) -> None:
    """Block configs were swept on the H200 once (benchmarks/archive/kernels-notes.md); the table holds the best."""
    for t in (1, 8, 64, 256, 2048):
        bench_moe_one(t, ceil)
        torch.cuda.empty_cache()


def bench_moe_one(t: int, ceil: dict) -> None:
    x, w13, w2, weights, ids = moe_inputs(t)
    e, two_i, hidden = w13.shape
    touched = ids.unique().numel()
    nbytes = touched * 3 * (two_i // 2) * hidden * 2 + 2 * t * hidden * 2
    flops = t * ids.shape[1] * 6 * hidden * (two_i // 2)
    experts = executor_moe(w13, w2)
    with torch.inference_mode():
        record(
            "fused_moe", f"T={t} E={e} k={ids.shape[1]} H={hidden} I={two_i // 2}",
            lambda: fused_moe(x, w13, w2, weights, ids), nbytes, flops, ceil,
            twin_ms=maybe_ms(lambda: fused_moe_ref(x, w13, w2, weights, ids)),
            exec_ms=maybe_ms(experts and (lambda: experts(x, weights, ids))),
            experts_touched=touched, config=moe_config(t),
        )  # fmt: skip


# Candidates for kernels/fused_moe.py's CONFIGS: around each row of the table, wider N and
# K tiles, deeper pipelines; the table's own rows come first.
MOE_SWEEP = [dict(c) for c in dict.fromkeys(tuple(cfg.items()) for _, cfg in CONFIGS)] + [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": nw, "num_stages": ns}
    for bm, bn, bk, nw, ns in (
        (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 128, 4, 3), (32, 128, 64, 4, 4),
        (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 256, 64, 8, 3),
        (64, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
        (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (128, 256, 32, 8, 4),
        (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (32, 64, 128, 8, 3), (16, 32, 128, 4, 5),
        (128, 256, 64, 8, 4),
    )
]  # fmt: skip


def sweep_moe(ceil: dict) -> None:
    """Every MOE_SWEEP config at the token counts of batched decode, verify, mixed and
    prefill steps (Moonlight's routed experts; the whole fused_moe, alignment included)."""
    for t in (128, 256, 512, 1024, 2048, 4096, 8192):
        x, w13, w2, weights, ids = moe_inputs(t)
        inter, hidden = w2.shape[2], w2.shape[1]
        nbytes = ids.unique().numel() * 3 * inter * hidden * 2 + 2 * t * hidden * 2
        flops = t * ids.shape[1] * 6 * hidden * inter

        def run(cfg: dict, a: tuple = (x, w13, w2, weights, ids)) -> torch.Tensor:
            return fused_moe(*a, config=cfg)

        with torch.inference_mode():
            sweep("moe", run, MOE_SWEEP, nbytes, ceil, T=t, gflop=round(flops / 1e9, 2))
        del x, w13, w2
        torch.cuda.empty_cache()


# Decode-sized candidates (BLOCK_M 16: a few rows an expert): narrower and wider N and K
# tiles, deeper pipelines, more warps; the table's row for these T comes first.
MOE_SMALL_SWEEP = [moe_config(1)] + [
    {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": nw, "num_stages": ns}
    for bn, bk, nw, ns in (
        (32, 128, 4, 4), (32, 256, 4, 4), (64, 64, 4, 6), (64, 128, 4, 6), (64, 128, 8, 4),
        (64, 256, 4, 3), (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4),
        (32, 128, 4, 6), (16, 256, 4, 4),
    )
]  # fmt: skip


def bench_align(ceil: dict) -> None:
    """moe_align's three forms by size, Moonlight's routing with its shared experts fused
    (64 + 2 ids, 8 pairs a token): sets MAX_PAIRS_ONE_PROGRAM in kernels/moe_align.py."""
    from kernels.moe_align import ALIGN_METHODS, moe_align

    e, k, block_m = 66, 8, 64
    for t in (1, 16, 64, 128, 256, 1024, 4096, 16384):
        ids = torch.rand(t, e, device=DEV).topk(k, dim=-1).indices
        for method in ALIGN_METHODS:
            record(f"moe_align {method}", f"T={t} E={e} k={k} BM={block_m}",
                   lambda i=ids, m=method: moe_align(i, e, block_m, m), ids.numel() * 8, 0.0,
                   ceil)  # fmt: skip


def sweep_small(ceil: dict) -> None:
    """Batch-1 to 32 decode kernels around their defaults, as the engine calls them:
    the fused MoE with Moonlight's two shared experts riding along (8 weight slices a
    token), and MLA decode with a block table as wide as an 8k-context graph's (the split
    count follows the width), by split count and key tile."""
    shared_i = 2 * 1408
    for t in (1, 8, 32):
        x, w13, w2, weights, ids = moe_inputs(t)
        sw13 = torch.randn(2 * shared_i, 2048, device=DEV, dtype=torch.bfloat16) / 45
        sw2 = torch.randn(2048, shared_i, device=DEV, dtype=torch.bfloat16) / 53
        e = w13.shape[0]
        ids8 = torch.cat([ids, torch.tensor([e, e + 1], device=DEV).expand(t, 2)], 1)
        w8 = torch.cat([weights, weights.new_ones(t, 2)], 1)
        nbytes = (ids.unique().numel() + 2) * 3 * 1408 * 2048 * 2 + 2 * t * 2048 * 2

        def run(cfg: dict, a: tuple = (x, w13, w2, w8, ids8), s: tuple = (sw13, sw2)):
            return fused_moe(*a, config=cfg, shared=s)

        with torch.inference_mode():
            sweep("moe_small", run, MOE_SMALL_SWEEP, nbytes, ceil, T=t)
        del x, w13, w2, sw13, sw2
        torch.cuda.empty_cache()
    width = 8192 // 64
    configs = [{}] + [
        {"splits": s, "BLOCK_N": bn, "num_warps": nw}
        for s in (8, 16, 32, 64)
        for bn, nw in ((16, 4), (32, 4), (64, 4))
    ]
    for batch, ctx in ((1, 1024), (1, 4096), (8, 1024)):
        q, kv, table, seq, qsl, lat, scale = mla_inputs(batch, ctx, 16)
        wide = torch.zeros(batch, width, dtype=table.dtype, device=DEV)
        wide[:, : table.shape[1]] = table
        args = (q, kv, wide, seq, qsl, lat, scale)

        def run_mla(cfg: dict, args: tuple = args) -> torch.Tensor:
            cfg = dict(cfg)
            return mla_decode(*args, num_splits=cfg.pop("splits", None), config=cfg)

        nbytes = batch * ctx * 576 * 2 + batch * 16 * (576 + 512) * 2
        sweep("mla_small", run_mla, configs, nbytes, ceil, B=batch, ctx=ctx)
        del args, kv
        torch.cuda.empty_cache()


def bench_rmsnorm(ceil: dict) -> None:
    for t, hidden in ((1, 2048), (64, 2048), (4096, 2048), (16384, 7168)):
        bench_rmsnorm_one(t, hidden, ceil)


def bench_rmsnorm_one(t: int, hidden: int, ceil: dict) -> None:
    x, r = (torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
    record(
        "fused_add_rmsnorm", f"T={t} H={hidden}",
        lambda: fused_add_rmsnorm(x, r, w, 1e-6), 4 * t * hidden * 2, 0.0, ceil,
        twin_ms=maybe_ms(lambda: fused_add_rmsnorm_ref(x, r, w, 1e-6)),
    )  # fmt: skip


# (experts, hidden, router settings after x, weight, bias)
ROUTERS = {
    "moonlight": (64, 2048, (6, "sigmoid", "noaux_tc", 1, 1, True, True, 2.446)),
    "deepseek_v3": (256, 7168, (8, "sigmoid", "noaux_tc", 8, 4, True, True, 2.5)),
}


def router_inputs(t: int, model: str, w_dtype: torch.dtype = torch.float32):
    """bf16 hidden states; the router weight in float32 as the executor keeps it."""
    e, hidden, _ = ROUTERS[model]
    x = torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(e, hidden, device=DEV) / hidden**0.5).to(w_dtype)
    bias = torch.rand(e, device=DEV) - 0.5
    return x, w, bias


def bench_router(ceil: dict) -> None:
    """One launch instead of the ~17 of the torch router (the twin); its graph-replay
    time is the figure that counts at decode. Bytes: weight + x + outputs."""
    for model, t, w_dtype in [("moonlight", 1, torch.float32), ("moonlight", 64, torch.float32),
                              ("moonlight", 4096, torch.float32), ("moonlight", 1, torch.bfloat16),
                              ("moonlight", 4096, torch.bfloat16), ("deepseek_v3", 1, torch.float32),
                              ("deepseek_v3", 64, torch.float32)]:  # fmt: skip
        x, w, bias = router_inputs(t, model, w_dtype)
        e, hidden, settings = ROUTERS[model]
        args = (x, w, bias, *settings)
        nbytes = w.numel() * w.element_size() + x.numel() * 2 + t * settings[0] * 12
        cfg = router_config(t, max(16, 1 << (e - 1).bit_length()), upcast=w_dtype != torch.bfloat16)
        record(
            "moe_router", f"{model} T={t} E={e} H={hidden} w={str(w_dtype)[6:]}",
            lambda a=args: moe_router(*a), nbytes, 2 * t * e * hidden, ceil,
            twin_ms=maybe_ms(lambda a=args: moe_router_ref(*a)),
            twin_graph_us=maybe_graph_us(lambda a=args: moe_router_ref(*a)), config=cfg,
        )  # fmt: skip


def sweep_router(ceil: dict) -> None:
    """Moonlight: tile sizes around the defaults; the float32 path's few-token variant
    (BLOCK_T < 16) against 16-token FMA dots; bf16 weights on the tensor cores or upcast."""
    few = [{"BLOCK_T": bt, "BLOCK_H": max(16, 8192 // (bt * 64)), "num_warps": nw}
           for bt in (1, 2, 4, 8) for nw in (4, 8)]  # fmt: skip
    dots = [{"BLOCK_T": 16, "BLOCK_H": bh, "num_warps": nw, "num_stages": ns}
            for bh in (64, 128) for nw in (4, 8) for ns in (2, 3)]  # fmt: skip
    for t, w_dtype, configs in ((1, torch.float32, few[:4] + dots[:2]),
                                (64, torch.float32, few + dots),
                                (4096, torch.float32, few[-2:] + dots),
                                (4096, torch.bfloat16, [{"UPCAST": u, "BLOCK_T": bt}
                                                        for u in (False, True) for bt in (16, 32)])):  # fmt: skip
        x, w, bias = router_inputs(t, "moonlight", w_dtype)
        args = (x, w, bias, *ROUTERS["moonlight"][2])

        def run(cfg: dict, args: tuple = args) -> tuple:
            return moe_router(*args, config=cfg)

        nbytes = w.numel() * w.element_size() + x.numel() * 2
        sweep("router", run, configs, nbytes, ceil, T=t, w=str(w_dtype)[6:])


# (label, heads, q_lens, k_lens): Moonlight's 16 heads at the profiled step (16 x 1k), one
# long prompt, a chunk after cached context; DeepSeek-V3's 128 heads.
PREFILL_SHAPES = [
    ("16x1k", 16, [1024] * 16, [1024] * 16),
    ("1x16k", 16, [16384], [16384]),
    ("4k after 4k", 16, [4096], [8192]),
    ("16x1k", 128, [1024] * 16, [1024] * 16),
]


def prefill_inputs(q_lens: list[int], k_lens: list[int], heads: int, dn: int = 128,
                   rope: int = 64, dv: int = 128) -> tuple:  # fmt: skip
    """bf16 args of mla_prefill laid out as the executor passes them: q_nope, q_pe views
    of [Tq, H, Dn + R]; k_nope, v views of [Tk, H, Dn + Dv]; k_pe a view of the latent."""
    bf = {"device": DEV, "dtype": torch.bfloat16}
    q = torch.randn(sum(q_lens), heads, dn + rope, **bf)
    kv = torch.randn(sum(k_lens), heads, dn + dv, **bf)
    latent = torch.randn(sum(k_lens), 512 + rope, **bf)
    cu_q, cu_k = (torch.tensor([0, *n], device=DEV).cumsum(0) for n in (q_lens, k_lens))
    return (q[..., :dn], q[..., dn:], kv[..., :dn], latent[:, 512:], kv[..., dn:],
            cu_q, cu_k, max(q_lens), (dn + rope) ** -0.5)  # fmt: skip


def prefill_cost(q_lens: list[int], k_lens: list[int], heads: int, dn: int = 128,
                 rope: int = 64, dv: int = 128) -> tuple[float, float]:  # fmt: skip
    """(bytes, FLOPs): q, k_nope, k_pe, v read once and out written once (bf16);
    2 (Dn + R) + 2 Dv FLOPs per visible (causal) query-key pair per head."""
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, k_lens))
    tq, tk = sum(q_lens), sum(k_lens)
    nbytes = 2 * (tq * heads * (dn + rope + dv) + tk * (heads * (dn + dv) + rope))
    return nbytes, pairs * heads * (2 * (dn + rope) + 2 * dv)


def bench_prefill(ceil: dict) -> None:
    """Varlen causal MLA prefill; the twin is per-request float32 SDPA with a dense mask
    (the executor's path before the kernel). Compute-bound: read TFLOP/s, % matmul."""
    for label, heads, q_lens, k_lens in PREFILL_SHAPES:
        args = prefill_inputs(q_lens, k_lens, heads)
        nbytes, flops = prefill_cost(q_lens, k_lens, heads)
        record(
            "mla_prefill", f"H={heads} {label}", lambda a=args: mla_prefill(*a), nbytes, flops,
            ceil, twin_ms=maybe_ms(lambda a=args: mla_prefill_ref(*a), rep=20),
        )  # fmt: skip
        del args
        torch.cuda.empty_cache()


def sweep_prefill(ceil: dict) -> None:
    """Tiles around the default (BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages); gflop in
    each row turns us into TFLOP/s."""
    configs = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
               for bm, bn, nw, ns in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 4),
                                      (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                                      (64, 128, 4, 2))]  # fmt: skip
    for label, heads, q_lens, k_lens in PREFILL_SHAPES[:2]:
        args = prefill_inputs(q_lens, k_lens, heads)

        def run(cfg: dict, args: tuple = args) -> torch.Tensor:
            return mla_prefill(*args, config=cfg)

        nbytes, flops = prefill_cost(q_lens, k_lens, heads)
        sweep("prefill", run, configs, nbytes, ceil, H=heads, shape=label, gflop=flops / 1e9)


def accuracy() -> None:
    """||out - ref|| / ||ref|| of each bf16 kernel against its twin run in float64."""

    def check(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not torch.isfinite(out).all():
            err = float("inf")
        ROWS.append({"check": name, "rel_err": err})
        print(json.dumps(ROWS[-1]), flush=True)

    def f64(args: tuple) -> tuple:
        return tuple(a.double() if a.is_floating_point() else a for a in args[:5]) + args[5:]

    for heads, batch, ctx, q_len in ((16, 64, 4096, 1), (16, 16, 8192, 4), (128, 16, 4096, 1)):
        a = mla_inputs(batch, ctx, heads, q_len)
        check(
            f"mla H={heads} B={batch} ctx={ctx} q={q_len}", mla_decode(*a), mla_decode_ref(*f64(a))
        )
    a = prefill_inputs([1024] * 4 + [300], [1024] * 4 + [2348], 16)  # last: after context
    check("mla_prefill H=16 4x1k + 300 after 2k", mla_prefill(*a), mla_prefill_ref(*f64(a)))
    for t in (1, 64, 2048):
        a = moe_inputs(t)
        check(f"moe T={t}", fused_moe(*a), fused_moe_ref(*(x.double() for x in a[:4]), a[4]))
    x, r = (torch.randn(4096, 2048, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(2048, device=DEV, dtype=torch.bfloat16) + 0.5
    ref = fused_add_rmsnorm_ref(x.double(), r.double(), w.double(), 1e-6)[0]
    check("fused_add_rmsnorm T=4096", fused_add_rmsnorm(x, r, w, 1e-6)[0], ref)


def table(ceil: dict) -> str:
    lines = [
        f"copy bandwidth {ceil['copy_tbps']:.2f} TB/s (read + write); "
        f"bf16 8192^3 matmul {ceil['matmul_tflops']:.0f} TFLOP/s",
        "",
        "us: CUDA-graph replay, L2 cleared (eager: plain launches, Python overhead included)",
        "",
        "| kernel | shape | us | eager us | TB/s | % copy BW | TFLOP/s | % matmul | twin us "
        "| executor us |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in ROWS:
        if "kernel" in r:
            lines.append(
                f"| {r['kernel']} | {r['shape']} | {r['us']:.1f} | {r['eager_us']:.1f} | "
                f"{r['tbps']:.2f} | "
                f"{r['pct_bw']:.0f} | {r['tflops']:.1f} | {r['pct_mm']:.0f} | "
                f"{f(r['twin_us'], '.1f')} | {f(r['exec_us'], '.1f')} |"
            )
    graphs = [f"{r['shape']}: {r['twin_graph_us']:.1f}" for r in ROWS
              if r.get("twin_graph_us") is not None]  # fmt: skip
    if graphs:
        lines += ["", "moe_router twin under CUDA-graph replay (us): " + "; ".join(graphs)]
    errs = [f"{r['check']}: {r['rel_err']:.2e}" for r in ROWS if "check" in r]
    if errs:
        lines += ["", "relative error vs float64 twin: " + "; ".join(errs)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-setting sweeps")
    p.add_argument(
        "--only",
        default="accuracy,mla,moe,rmsnorm,router,prefill",
        help="also: binv_mla, moe_sweep, small_sweep, align",
    )
    a = p.parse_args()
    only = set(a.only.split(","))
    torch.manual_seed(0)
    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    if "accuracy" in only:
        accuracy()
    if "rmsnorm" in only:
        bench_rmsnorm(ceil)
    if "router" in only:
        bench_router(ceil)
        if not a.no_sweep:
            sweep_router(ceil)
    if "moe" in only:
        bench_moe(ceil)
    if "moe_sweep" in only:
        sweep_moe(ceil)
    if "small_sweep" in only:
        sweep_small(ceil)
    if "align" in only:
        bench_align(ceil)
    if "mla" in only:
        bench_mla(ceil, a.quick)
        if not a.no_sweep:
            sweep_mla(ceil)
    if "binv_mla" in only:
        bench_binv_mla(ceil)
    if "prefill" in only:
        bench_prefill(ceil)
        if not a.no_sweep:
            sweep_prefill(ceil)
    text = table(ceil)
    print(text)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "kernels_bench.json").write_text(
            json.dumps({"ceilings": ceil, "rows": ROWS}, indent=1)
        )
        (out / "kernels_bench.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

"""DeepSeek's published production throughput per H800 node beside the simulator's
prediction for an equivalent plan (analytic H800 cost model: uncalibrated).

    deepinfer bench deepseek-production [--prompt 2500] [--output 800] [--hit-rate 0.56]

DeepSeek ("DeepSeek-V3/R1 Inference System Overview", 2025-03-01) reports, per H800 node
over 24 hours: about 73.7k input tokens/s during prefill (cache hits included; 56.3% of
input tokens hit its on-disk KV cache) and about 14.8k output tokens/s during decode,
at 20-22 output tokens/s per user. The equivalent plan here: a prefill unit of 32 H800
(DP attention + EP32) given a saturating burst of prompts whose leading `hit-rate`
share is cached, and a decode unit of 128 H800 (EP128; DeepSeek's 144 carry redundant
experts) at several batches per rank, with one MTP draft accepted `acceptance` of the
time. Prompt and output lengths are assumptions (DeepSeek publishes totals only):
they and the cache tier (HBM here, disk there) are the first things that explain a gap.
"""

from __future__ import annotations

import argparse
import time

from deepinfer.config import EngineConfig
from sim import simulate
from sim.traces import Trace, TraceRequest

PUBLISHED_PREFILL = 73.7e3  # input tokens/s per H800 node (cache hits included)
PUBLISHED_DECODE = 14.8e3  # output tokens/s per H800 node
GPUS_PER_NODE = 8


def prefill_trace(n: int, prompt: int, hit_rate: float, block: int) -> Trace:
    """n prompts at once; each one's first hit_rate of blocks is shared by all."""
    shared = int(prompt * hit_rate) // block
    total = -(-prompt // block)
    reqs = []
    for i in range(n):
        blocks = tuple(range(shared)) + tuple(10**6 * (i + 1) + k for k in range(total - shared))
        reqs.append(TraceRequest(f"p{i}", 0.0, prompt, 1, blocks, block))
    return Trace("deepseek prefill burst", "python", reqs)


def decode_trace(n: int, prompt: int, output: int) -> Trace:
    reqs = [TraceRequest(f"d{i}", 0.0, prompt, output) for i in range(n)]
    return Trace("deepseek decode batch", "python", reqs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=2500, help="input tokens per request")
    ap.add_argument("--output", type=int, default=800, help="output tokens per request")
    ap.add_argument("--hit-rate", type=float, default=0.563, help="share of input cached")
    ap.add_argument("--acceptance", type=float, default=0.85, help="MTP draft acceptance")
    ap.add_argument("--batches", default="16,32,64", help="decode requests per rank")
    ap.add_argument("--prefill-requests", type=int, default=2048)
    args = ap.parse_args(argv)
    block = 64
    print(f"prompt {args.prompt}, output {args.output}, {args.hit_rate:.1%} of input cached")
    print("| stage | plan | simulated per node | published per node | ratio | detail | wall s |")
    print("|---|---|---|---|---|---|---|")
    ranks = 32
    engine = EngineConfig(
        data_parallel_size=ranks, enable_expert_parallel=True, role="prefill",
        max_num_batched_tokens=16384, block_size=block,
    )  # fmt: skip
    t0 = time.perf_counter()
    trace = prefill_trace(args.prefill_requests, args.prompt, args.hit_rate, block)
    res = simulate(trace, "deepseek-v3", "h800", engine, "analytic")
    wall = time.perf_counter() - t0
    s = res.summary
    per_node = args.prompt * s["num_completed"] / s["duration_s"] / (ranks / GPUS_PER_NODE)
    hit = s["prefix_cache_hit_rate"] or 0.0
    print(
        f"| prefill | {ranks} H800, DP+EP{ranks}, burst of {args.prefill_requests} | "
        f"{per_node / 1e3:.1f}k input tok/s | {PUBLISHED_PREFILL / 1e3:.1f}k | "
        f"{per_node / PUBLISHED_PREFILL:.2f} | hits {hit:.1%} | {wall:.0f} |",
        flush=True,
    )
    ranks = 128
    for batch in (int(b) for b in args.batches.split(",")):
        engine = EngineConfig(
            data_parallel_size=ranks, enable_expert_parallel=True, role="decode",
            num_speculative_tokens=1, max_num_seqs=batch, block_size=block,
        )  # fmt: skip
        t0 = time.perf_counter()
        trace = decode_trace(ranks * batch, args.prompt, args.output)
        res = simulate(
            trace, "deepseek-v3", "h800", engine, "analytic", acceptance_rate=args.acceptance
        )
        wall = time.perf_counter() - t0
        s = res.summary
        out = s["total_output_tokens"] / s["duration_s"] / (ranks / GPUS_PER_NODE)
        user = 1e3 / s["tpot_ms_mean"] if s["tpot_ms_mean"] else float("nan")
        print(
            f"| decode | {ranks} H800, DP+EP{ranks}, MTP 1, {batch} req/rank | "
            f"{out / 1e3:.1f}k output tok/s | {PUBLISHED_DECODE / 1e3:.1f}k | "
            f"{out / PUBLISHED_DECODE:.2f} | {user:.0f} tok/s per user | {wall:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""First use of a fresh engine: its first offline burst against the same burst again.

    deepinfer bench first-burst [--model moonlight-16b-a3b] [--num-prompts 128]
        [--bursts 3] [--max-prompt 2048] [--max-output 64] [--json OUT.json]

Issue 12's target: no step of a served trace pays a compile or a graph capture, so the
first burst on a fresh engine runs within 10% of the second; and start-up (weights,
warm-up, graph captures: everything that happens before the first request) under 60 s.
This builds the engine in published shapes with dummy weights (as model_speed.py does),
times its start-up, then runs the same burst of `--num-prompts` requests (the sizes of
the bundled Azure code trace's first requests, capped; random token ids, greedy, EOS
ignored) through one engine `--bursts` times, each time with new token ids (the same
ids would hit the prefix cache from the second burst on). Each burst reports its wall time, its
steps and the Triton kernel variants compiled during it (kernels/compile_stats.py);
the figure is the first burst's time over the median of the later ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.model_speed import build
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from kernels.compile_stats import total_compiled
from sim.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]


def burst_requests(
    num: int, max_prompt: int, max_output: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) of the trace's first `num` requests, capped;
    random ids drawn from `seed`."""
    trace = load_trace(ROOT / "traces" / "azure_code_small.json", max_requests=num)
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in trace.requests:
        n = min(r.prompt_len, max_prompt)
        out.append(
            (
                torch.randint(10, vocab - 10, (n,), generator=g).tolist(),
                min(r.output_len, max_output),
            )
        )
    return out


def run_burst(
    core: EngineCore, requests: list[tuple[list[int], int]], tag: str
) -> dict[str, float | int]:
    """Every request at once; wall seconds until the last finishes, steps, compiles."""
    steps_before, compiled_before = len(core.steps), total_compiled()
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        core.add_request(Request(f"{tag}-{i}", prompt, sp))
    while core.has_unfinished():
        core.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - t0,
        "steps": len(core.steps) - steps_before,
        "compiled": total_compiled() - compiled_before,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="preset name or config.json")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--async-scheduling", default="true", choices=("true", "false"))
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.bursts < 2:
        p.error("--bursts: at least 2 (the first against the others)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = EngineConfig(
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling == "true",
    )  # fmt: skip
    t0 = time.perf_counter()
    ex, _, _ = build(args.model, dev, cfg, with_hf=False)
    startup = time.perf_counter() - t0
    warm = ex.warmup
    print(
        f"start-up {startup:.1f} s (executor's own {ex.startup_seconds:.1f} s; warm-up "
        f"{warm.seconds:.1f} s, {warm.num_compiled} kernel variants)"
        if warm is not None
        else f"start-up {startup:.1f} s"
    )
    print(f"KV cache: {ex.num_kv_blocks()} blocks of {cfg.block_size} tokens")
    core = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
    sizes = args.num_prompts, args.max_prompt, args.max_output, ex.vocab_size
    requests = burst_requests(*sizes)
    tokens = sum(len(pr) for pr, _ in requests), sum(n for _, n in requests)
    print(f"burst: {len(requests)} requests, {tokens[0]} prompt and {tokens[1]} output tokens")
    bursts = []
    for b in range(args.bursts):
        row = run_burst(core, burst_requests(*sizes, seed=b) if b else requests, f"b{b}")
        bursts.append(row)
        print(f"  burst {b + 1}: {row['seconds']:.3f} s, {row['steps']} steps, "
              f"{row['compiled']} kernel variants compiled")  # fmt: skip
    later = statistics.median(float(r["seconds"]) for r in bursts[1:])
    ratio = float(bursts[0]["seconds"]) / later
    print(f"first burst / later bursts (median): {ratio:.3f} (target <= 1.10)")
    if args.json:
        doc = {
            "model": args.model, "device": str(dev), "engine": cfg.to_dict(),
            "startup_s": startup, "executor_startup_s": ex.startup_seconds,
            "num_kv_blocks": ex.num_kv_blocks(),
            "warmup_s": warm.seconds if warm is not None else None,
            "warmup_compiled": warm.num_compiled if warm is not None else None,
            "bursts": bursts, "first_over_later": ratio,
        }  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

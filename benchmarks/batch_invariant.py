"""What batch-invariant mode costs: decode and prefill step times with it on vs off.

    PYTHONPATH=$PWD python benchmarks/batch_invariant.py [--model moonlight-16b-a3b]
        [--batches 1,64,256] [--contexts 1024,4096] [--prefill 1x8000,8x1024]
        [--json $OUT/batch_invariant.json]     # --contexts "" or --prefill "": skip those

Dummy weights in the preset's shapes (as benchmarks/model_speed.py builds them), one
executor per mode (built, measured, freed in turn: two Moonlights do not fit beside
their KV caches), CUDA graphs on as in serving. Each figure is a whole engine step
(scheduler, model, sampler): the median of the ~48 decode steps that run the whole batch
at that context (16 left the normal side's batch-256 median 13% apart between runs), and
the best of two prefill steps of N prompts of L tokens (`NxL`). The target (issue 14): at most 25% slower at decode batch 1/64/256 and prefill 8k.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from benchmarks.model_speed import build, ours, random_prompts, sweep_config
from deepinfer.config import EngineConfig


def measure(
    model: str,
    cfg: EngineConfig,
    batches: list[int],
    contexts: list[int],
    prefills: list[tuple[int, int]],
    new_tokens: int,
) -> dict[str, float]:
    """Step name -> seconds, for one executor in cfg's mode."""
    ex, _, spec = build(model, torch.device("cuda"), cfg, with_hf=False)
    times: dict[str, float] = {}
    try:
        ours(ex, cfg, random_prompts(2, 64, spec.vocab_size, 0), 4, "warm")
        for n, length in prefills:
            prompts = random_prompts(n, length, spec.vocab_size, n * length)
            run_cfg = cfg.replace(max_num_batched_tokens=max(n * length, 1024))
            t = min(ours(ex, run_cfg, prompts, 1, f"p{n}x{length}.{i}")[0] for i in range(2))
            times[f"prefill {n}x{length}"] = t
            print(f"batch_invariant={cfg.batch_invariant} prefill {n}x{length}: {1e3 * t:.2f} ms",
                  flush=True)  # fmt: skip
        for ctx in contexts:
            for b in batches:
                prompts = random_prompts(b, ctx, spec.vocab_size, b + ctx)
                _, step = ours(ex, cfg, prompts, new_tokens, f"d{b}.{ctx}")
                times[f"decode batch {b} ctx {ctx}"] = step
                print(f"batch_invariant={cfg.batch_invariant} decode batch {b} ctx {ctx}: "
                      f"{1e3 * step:.3f} ms", flush=True)  # fmt: skip
    finally:
        ex.shutdown()
        del ex
        gc.collect()
        torch.cuda.empty_cache()
    return times


def table(normal: dict[str, float], invariant: dict[str, float]) -> list[dict]:
    return [
        dict(
            step=k,
            normal_ms=1e3 * normal[k],
            invariant_ms=1e3 * invariant[k],
            slowdown=invariant[k] / normal[k] - 1,
        )  # fmt: skip
        for k in normal
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--prefill", default="1x8000,8x1024", help="NxL: N prompts of L tokens")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("batch-invariant mode needs CUDA: run this on the GPU")
    batches = [int(x) for x in args.batches.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    prefills = [(int(n), int(length)) for n, length in
                (x.split("x") for x in args.prefill.split(",") if x)]  # fmt: skip
    cfg = sweep_config(max(batches, default=1), max(contexts, default=1), args.new_tokens,
                       max((n * length for n, length in prefills), default=1))  # fmt: skip
    normal = measure(args.model, cfg, batches, contexts, prefills, args.new_tokens)
    invariant = measure(args.model, cfg.replace(batch_invariant=True), batches, contexts,
                        prefills, args.new_tokens)  # fmt: skip
    rows = table(normal, invariant)
    print("| step | normal ms | batch-invariant ms | slowdown |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['step']} | {r['normal_ms']:.3f} | {r['invariant_ms']:.3f} "
              f"| {100 * r['slowdown']:+.1f}% |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=args.model, rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""Attention data parallelism + expert parallelism on N GPUs against one GPU, measured and
simulated (random weights in the model's published shapes, `load_format="dummy"`).

    deepinfer bench data-parallel [--model moonlight-16b-a3b] [--ranks 1,2,4,8]
        [--json OUT.json]

For each N (N = 1: one engine, eager and with CUDA graphs; N > 1: `LLM(...,
data_parallel_size=N, enable_expert_parallel=True)`, every rank eager), two offline batches, all requests at
t = 0, their size growing with N so that each rank gets the same share:
- prefill: 8 requests a rank of 2048-token prompts, one output token each;
- decode: 64 requests a rank of 128-token prompts, 256 output tokens each.
Reported per batch: wall seconds of `generate`, tokens/s per GPU (prompt tokens for
prefill, output tokens for decode), and the simulator's prediction of the same batch
(`sim.simulate`, same EngineConfig, default cost model) with its error against the
measurement: the issue asks for simulated within 10% of measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.model_config import known_models, load_model_config
from sim import simulate
from sim.traces import TraceRequest

BATCHES = {"prefill": (8, 2048, 1), "decode": (64, 128, 256)}  # per rank: n, prompt, output


def _engine(ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        data_parallel_size=ranks, enable_expert_parallel=ranks > 1,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )  # fmt: skip


def _run(llm: LLM, ranks: int, kind: str, vocab: int, seed: int) -> dict[str, float]:
    n, prompt, out = BATCHES[kind]
    g = torch.Generator().manual_seed(seed)
    batch = [{"prompt_token_ids": torch.randint(2, vocab, (prompt,), generator=g).tolist()}
             for _ in range(n * ranks)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    llm.generate(batch[: 2 * ranks], params, use_tqdm=False)  # warm: every rank has run
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = n * ranks * (prompt if kind == "prefill" else out)
    return {"seconds": seconds, "tokens_per_s_per_gpu": tokens / seconds / ranks}


def _simulated(model: str, ranks: int, kind: str, engine: dict[str, Any]) -> dict[str, Any]:
    n, prompt, out = BATCHES[kind]
    trace = [TraceRequest(f"{kind}{i}", 0.0, prompt, out) for i in range(n * ranks)]
    res = simulate(trace, model, "h200", engine=EngineConfig(**engine))
    bad = [r.reason for r in res.requests if r.status != "finished"]
    if bad:
        raise RuntimeError(f"simulated {kind}: {len(bad)} requests not served: {bad[0]}")
    seconds = res.summary["makespan_s"]
    tokens = n * ranks * (prompt if kind == "prefill" else out)
    keep = ("all_to_all_seconds", "straggler_seconds", "expert_load_max_over_mean", "cost_model")
    return {"seconds": seconds, "tokens_per_s_per_gpu": tokens / seconds / ranks,
            **{k: res.meta.get(k) for k in keep}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--json", default="data_parallel.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (gloo ranks)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the batch sizes")
    args = ap.parse_args()
    longest = load_model_config(args.model).max_position_embeddings  # (a tiny smoke model)
    for kind, (n, prompt, out) in BATCHES.items():
        BATCHES[kind] = (
            max(1, round(n * args.scale)),
            min(prompt, longest // 2),
            min(out, longest // 4),
        )
    load_format = "dummy" if args.model in known_models() else "auto"
    vocab = load_model_config(args.model).vocab_size
    rows = []
    runs = [(int(n), True) for n in args.ranks.split(",")]
    if 1 in (n for n, _ in runs) and args.device == "cuda":
        runs.insert(1, (1, False))  # one GPU with CUDA graphs too: the best it does alone
    for ranks, eager in runs:
        if args.device == "cuda" and torch.cuda.device_count() < ranks:
            print(f"{ranks} GPUs: skipped, {torch.cuda.device_count()} visible")
            continue
        engine = _engine(ranks, args)
        llm = LLM(args.model, load_format=load_format, enforce_eager=eager, device=args.device,
                  **engine)  # fmt: skip
        label = f"{ranks} GPU{'s' if ranks > 1 else ''}{'' if eager else ' (graphs)'}"
        for kind in BATCHES:
            real = _run(llm, ranks, kind, vocab, seed=ranks)
            sim = _simulated(args.model, ranks, kind, engine)
            err = sim["seconds"] / real["seconds"] - 1.0
            rows.append({"ranks": ranks, "eager": eager, "kind": kind, "measured": real,
                         "simulated": sim, "sim_error": err})  # fmt: skip
            print(f"{label:16s} {kind:8s} measured {real['tokens_per_s_per_gpu']:9.0f} "
                  f"tok/s/GPU ({real['seconds']:.2f} s), simulated "
                  f"{sim['tokens_per_s_per_gpu']:9.0f} ({err:+.1%})")  # fmt: skip
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    base = {  # against one GPU run eagerly, as expert-parallel ranks run
        r["kind"]: r["measured"]["tokens_per_s_per_gpu"]
        for r in rows
        if r["ranks"] == 1 and r["eager"]
    }
    for r in rows:
        if r["kind"] in base:
            r["per_gpu_vs_one_gpu"] = r["measured"]["tokens_per_s_per_gpu"] / base[r["kind"]]
    Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

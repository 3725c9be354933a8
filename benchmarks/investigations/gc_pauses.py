"""Python's garbage collector inside a served run: its pauses by generation, with the
start-up heap frozen (what the executor does on CUDA: executors/warmup.freeze_heap) and
without.

    python benchmarks/investigations/gc_pauses.py [--model deepinfer-demo] [--device cpu]
        [--requests 256] [--prompt-len 64] [--max-tokens 400] [--json OUT.json]

Each mode builds its engine, then runs the same greedy requests to the end, timing each
collection with `gc.callbacks`. A full (generation-2) collection scans every tracked
object: with the start-up's objects in the heap it is a pause of its own, on the host,
in the middle of a step; under async scheduling on a GPU the device idles through it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.engine import EngineCore  # noqa: E402
from deepinfer.request import Request  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from executors.warmup import freeze_heap  # noqa: E402


def run(model: str, device: str | None, frozen: bool, args: argparse.Namespace) -> dict[str, Any]:
    from executors.torch_executor import TorchExecutor

    cfg = EngineConfig(
        max_num_seqs=args.requests, max_num_batched_tokens=4096, async_scheduling=True,
        num_gpu_blocks=args.requests * -(-(args.prompt_len + args.max_tokens) // 64) + 16,
        block_size=64,
    )  # fmt: skip
    ex = TorchExecutor(cfg, model, device=device, load_format="dummy")
    if frozen:
        freeze_heap()
    else:
        gc.unfreeze()
    engine = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gen = torch.Generator().manual_seed(0)
    vocab = ex.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        ids = torch.randint(2, vocab, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", ids, params))
    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        gc.callbacks.remove(timed)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "frozen": frozen, "steps": len(engine.steps), "wall_s": wall,
        "tracked": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
    }  # fmt: skip
    for g, p in pauses.items():
        row[f"gen{g}"] = {"count": len(p), "max_ms": 1e3 * max(p, default=0.0),
                          "total_ms": 1e3 * sum(p)}  # fmt: skip
    ex.shutdown()
    gc.unfreeze()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepinfer-demo")
    p.add_argument("--device", default=None)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for frozen in (False, True):
        row = run(args.model, args.device, frozen, args)
        rows.append(row)
        gens = "  ".join(
            f"gen{g}: {row[f'gen{g}']['count']} x, max {row[f'gen{g}']['max_ms']:.2f} ms, "
            f"total {row[f'gen{g}']['total_ms']:.1f} ms"
            for g in range(3)
        )
        print(
            f"heap {'frozen' if frozen else 'not frozen'}: {row['steps']} steps in "
            f"{row['wall_s']:.2f} s, {row['tracked']} objects tracked "
            f"({row['frozen_objects']} frozen); {gens}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Is a step's time a function of its shape alone? The same mixed step, repeated.

    python benchmarks/investigations/step_variance.py [--model moonlight-16b-a3b] [--reps 40]
        [--served DIR/fidelity.json [--steps 12]]

For a few mixed shapes (one prompt chunk beside D decodes) times `executor.execute`:
  steady  the same requests again (what `deepinfer profile` times)
  new     the prompt is a request the runner has never seen (what a served trace does)
and a fixed pure-Python loop between steps (the host CPU's own speed), then prints the
p10 / p50 / p90 / max of each: a spread at one shape is noise the cost model cannot see.

--served: instead, the prompt-bearing steps a fidelity run served (its `step_samples`, the
longest first), each replayed here as the profiler replays its points (`StepSession`, one
group a request, steady), beside the wall time the engine took for it and the cost
model's price: replayed close to the price but above the served wall says the served
engine ran that shape faster than any replay of it (its context, not its shape).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from executors.profile_grid import StepShape  # noqa: E402
from executors.profile_session import StepSession  # noqa: E402
from executors.profiler import profile_steps  # noqa: E402
from executors.torch_executor import TorchExecutor  # noqa: E402


def _python_loop() -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i & 7
    return time.perf_counter() - t0


def _row(name: str, times: list[float]) -> str:
    a = np.array(times) * 1e3
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return f"{name:34s} p10 {p10:7.2f}  p50 {p50:7.2f}  p90 {p90:7.2f}  max {a.max():7.2f} ms"


def replay_served(ex: TorchExecutor, path: Path, steps: int, reps: int) -> None:
    """The served prompt-bearing steps of a fidelity run, replayed one by one."""
    workloads = json.loads(path.read_text())["workloads"]
    samples = [s for w in workloads for s in w.get("step_samples", []) if s["prompts"]]
    samples.sort(key=lambda s: -s["tokens"])
    print(
        "| tokens | prompts | decodes | served ms | replayed p50 ms | price ms | replayed / served |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for sample in samples[:steps]:
        groups = tuple((1, q, c, bool(p), 0) for q, c, p in sample["shape"])
        replayed = profile_steps(ex, [StepShape(sample["kind"], groups)], reps)[0]["median_s"]
        decodes = sum(1 for r in sample["shape"] if not r[2])
        print(f"| {sample['tokens']} | {sample['prompts']} | {decodes} | "
              f"{1e3 * sample['wall_s']:.1f} | {1e3 * replayed:.1f} | {1e3 * sample['pred_s']:.1f} | "
              f"{replayed / sample['wall_s']:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--served", type=Path, default=None, help="a fidelity.json to replay")
    p.add_argument("--steps", type=int, default=12, help="--served: how many steps")
    args = p.parse_args()
    cfg = EngineConfig(num_gpu_blocks=20000, max_num_seqs=256, max_num_batched_tokens=8192)
    ex = TorchExecutor(cfg, args.model, load_format="dummy", enforce_eager=args.enforce_eager)
    print(f"start-up {ex.startup_seconds:.1f} s, graphs {'off' if args.enforce_eager else 'on'}")
    if args.served is not None:
        replay_served(ex, args.served, args.steps, min(args.reps, 8))
        return
    rng = random.Random(0)
    for decodes, prompt, ctx in (
        (10, 150, 6000),
        (10, 600, 6000),
        (40, 400, 6000),
        (4, 2048, 2000),
    ):
        shape = StepShape("mixed", ((decodes, 1, ctx, False, 0), (1, prompt, 0, True, 0)))
        session = StepSession(shape, ex.runner, rng, reps=2 * args.reps)
        first = session.first
        session.advance(ex.execute(SchedulerOutput(-1, first)))
        held, times_new, times_steady, py = [], [], [], []
        for i in range(args.reps):
            steady = session.next_step().scheduled
            t0 = time.perf_counter()
            session.advance(ex.execute(SchedulerOutput(-1, steady)))
            times_steady.append(time.perf_counter() - t0)
            # the prompt as a new request: a fresh id, its whole table and token ids
            pr = first[-1]
            fresh = ScheduledRequest(
                req_id=f"new{i}", num_tokens=pr.num_tokens, num_computed_tokens=0,
                is_prompt=True, will_sample=True, new_block_ids=[], block_table=pr.block_table,
                token_ids=pr.token_ids, sampling_params=pr.sampling_params,
                num_prompt_tokens=pr.num_prompt_tokens,
            )  # fmt: skip
            steady = session.next_step().scheduled
            t0 = time.perf_counter()
            session.advance(ex.execute(SchedulerOutput(-1, steady[:-1] + [fresh])))
            times_new.append(time.perf_counter() - t0)
            held.append(fresh.req_id)
            py.append(_python_loop())
        ex.execute(SchedulerOutput(-1, [], finished_req_ids={s.req_id for s in first} | set(held)))
        label = f"{decodes} decodes @{ctx} + prompt {prompt}"
        print(_row(f"{label}: steady", times_steady), flush=True)
        print(_row(f"{label}: new prompt", times_new), flush=True)
        print(_row("  python loop (200k iterations)", py), flush=True)


if __name__ == "__main__":
    main()

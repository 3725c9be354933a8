"""Does a step run slower after the engine sat idle? (GPU clocks drop when idle.)

    python benchmarks/investigations/idle_penalty.py [--model moonlight-16b-a3b] [--batch 8]

Times one decode step (a CUDA graph) and one prefill step after sleeping 0 to 500 ms,
and prints the median of each against the back-to-back time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.outputs import SchedulerOutput  # noqa: E402
from executors.profile_grid import StepShape  # noqa: E402
from executors.profile_session import StepSession  # noqa: E402
from executors.torch_executor import TorchExecutor  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    cfg = EngineConfig(num_gpu_blocks=4000, max_num_seqs=64, max_num_batched_tokens=2048)
    ex = TorchExecutor(cfg, args.model, load_format="dummy")
    rng = random.Random(0)
    for shape in (
        StepShape("decode", ((args.batch, 1, 1024, False, 0),)),
        StepShape("prefill", ((1, 512, 0, True, 0),)),
    ):
        idles = (0.0, 0.001, 0.005, 0.02, 0.1, 0.5)
        session = StepSession(shape, ex.runner, rng, reps=7 * len(idles))
        session.advance(ex.execute(SchedulerOutput(-1, session.first)))
        for idle in idles:
            times = []
            for _ in range(7):
                time.sleep(idle)
                out = session.next_step()
                t0 = time.perf_counter()
                res = ex.execute(out)
                times.append(time.perf_counter() - t0)
                session.advance(res)
            print(
                f"{shape.kind:8s} idle {idle * 1e3:6.1f} ms: step {statistics.median(times) * 1e3:7.2f}"
                f" ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})",
                flush=True,
            )
        ex.execute(session.finish())


if __name__ == "__main__":
    main()

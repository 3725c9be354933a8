"""Host time per scheduled request of a decode step, the forward left out.

    deepinfer bench host-overhead [--batches 1,16,64,256,512] [--steps 20] [--json F]

A decode step's host work sits on its critical path unless async scheduling hides it:
the core's `schedule()` and `apply_results()` (pure Python), and the model runner's input
preparation for a decode graph (`update_states`, `collect`, `DecodeGraphs._load`: the
numpy tables and the pinned copies; on the CPU the same work without a device). This
times each, per step, for batches of B decoding requests of the demo model's runner on
the CPU (the shapes do not matter for host work; no forward runs, the sampled token is
a constant), and fits time = a + b * B by least squares: b is the host time per
scheduled request, a the fixed part. Issue 12's target is b <= 15 us. Run it on the
machine whose host you care about: the figures follow the CPU.

Not timed: the sampler's bookkeeping after the forward (on the GPU its argmax and the
one copy of the sampled ids; per request, the sampling state and the output lists),
and the graph replay's launch.

`--mixed D:P,...` also times the input preparation of eager and piecewise steps (mixed
prefill + decode, prompts): `InputBuilder.to_device` of D decodes at context 1,024 beside
one prompt chunk of P tokens (the attention metadata, ids, positions and sampled rows;
the copy is host-to-host here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.executor import Executor
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.demo import DEMO_MODEL_DIR
from executors.input_builder import HostBatch
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner

PROMPT_LEN = 16
BLOCK_SIZE = 16


class HostOnlyExecutor(Executor):
    """The Executor contract over a real ModelRunner that prepares every step's inputs as
    for a graph replay (decode) and stops there: one constant token a request."""

    needs_token_ids = True

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self._num_blocks = num_blocks
        self.prepare_s: list[float] = []  # per executed step

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        runner = self.runner
        runner.update_states(out)
        host = runner.inputs.collect(out.scheduled, drafting=runner.speculator is not None)
        graphs = runner.graphs
        if graphs is not None and host.num_decode == len(host.req_ids) and host.req_ids:
            graphs._load(host.input_ids, host.positions, host.block_tables)
        self.prepare_s.append(time.perf_counter() - t0)
        res = ModelRunnerOutput()
        for sr in out.scheduled:
            if sr.will_sample:
                res.sampled_token_ids[sr.req_id] = [7]
        return res


def build(max_batch: int, steps: int) -> tuple[EngineConfig, ModelRunner, int]:
    cfg = ModelConfig.from_dict(read_hf_config(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, cfg, dtype=torch.float32, device=torch.device("cpu"))
    per_req = -(-(PROMPT_LEN + steps + 8) // BLOCK_SIZE)
    num_blocks = max_batch * per_req + 8
    cache = PagedKVCache(
        cfg.num_hidden_layers, num_blocks + 1, BLOCK_SIZE, cfg.kv_entry_dim, torch.float32,
        torch.device("cpu"), scratch_block=True,
    )  # fmt: skip
    engine_cfg = EngineConfig(
        block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks, max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batch * PROMPT_LEN, 256), enable_prefix_caching=False,
    )  # fmt: skip
    max_len = PROMPT_LEN + steps + 16
    runner = ModelRunner(model, cache, engine_cfg, eos_token_id=None, max_model_len=max_len)
    runner.enable_cuda_graphs(capture=False)  # the buffers and _load, not captured
    return engine_cfg, runner, num_blocks


def measure(batch: int, steps: int, cfg: EngineConfig, runner: ModelRunner, blocks: int) -> dict:
    """Median seconds per decode step of `batch` requests: schedule, prepare, process."""
    ex = HostOnlyExecutor(runner, blocks)
    core = EngineCore(cfg, ex, model_max_len=PROMPT_LEN + steps + 16)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        core.add_request(Request(f"b{batch}-{i}", [11 + i % 50] * PROMPT_LEN, params))
    while core.scheduler.waiting:  # the prompts (their steps are not timed)
        out = core.schedule()
        core.apply_results(out, ex.execute(out))
    sched, prep, proc = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = core.schedule()
        t1 = time.perf_counter()
        res = ex.execute(out)
        t2 = time.perf_counter()
        core.apply_results(out, res)
        t3 = time.perf_counter()
        assert len(out.scheduled) == batch and out.num_batched_tokens == batch, (
            len(out.scheduled),
            out.num_batched_tokens,
            [sr.num_tokens for sr in out.scheduled][:4],
        )
        sched.append(t1 - t0)
        prep.append(t2 - t1)
        proc.append(t3 - t2)
    while core.has_unfinished():
        out = core.schedule()
        core.apply_results(out, ex.execute(out))
    return {
        "batch": batch,
        "schedule_s": statistics.median(sched),
        "prepare_s": statistics.median(prep),
        "process_s": statistics.median(proc),
    }


def measure_mixed(runner: ModelRunner, decodes: int, prompt: int, reps: int = 30) -> float:
    """Median seconds of `InputBuilder.to_device` for `decodes` decodes at context 1,024 (random
    block ids) beside one prompt chunk of `prompt` tokens."""
    rng = np.random.default_rng(decodes * 7919 + prompt)
    ctx = 1024 + rng.integers(0, BLOCK_SIZE * 4, size=decodes)
    lens = [int(c) + 1 for c in ctx] + ([prompt] if prompt else [])
    tables = [rng.integers(1, 1 << 20, size=-(-n // BLOCK_SIZE)).tolist() for n in lens]
    host = HostBatch(
        req_ids=[f"r{i}" for i in range(len(lens))],
        input_ids=[5] * (decodes + prompt),
        positions=[int(c) for c in ctx] + list(range(prompt)),
        query_lens=[1] * decodes + ([prompt] if prompt else []),
        context_lens=[int(c) for c in ctx] + ([0] if prompt else []),
        block_tables=tables, num_decode=decodes,
        logits_indices=list(range(decodes)) + ([decodes + prompt - 1] if prompt else []),
    )  # fmt: skip
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.inputs.to_device(host)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64,256,512")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--mixed",
        default="16:512,64:512,240:512,240:2048,0:7680",
        help="D:P shapes of eager steps whose inputs are timed ('' for none)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    cfg, runner, blocks = build(max(batches), args.steps)
    rows = [measure(b, args.steps, cfg, runner, blocks) for b in batches]
    print("| batch | schedule ms | prepare ms | process ms | total ms | us a request |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        total = r["schedule_s"] + r["prepare_s"] + r["process_s"]
        print(
            f"| {r['batch']} | {r['schedule_s'] * 1e3:.3f} | {r['prepare_s'] * 1e3:.3f} | "
            f"{r['process_s'] * 1e3:.3f} | {total * 1e3:.3f} | {total / r['batch'] * 1e6:.1f} |"
        )
    x = np.array([r["batch"] for r in rows], dtype=float)
    fits = {}
    for part in ("schedule_s", "prepare_s", "process_s"):
        slope, fixed = np.polyfit(x, [r[part] for r in rows], 1)
        fits[part] = (fixed, slope)
    slope = sum(s for _, s in fits.values())
    fixed = sum(f for f, _ in fits.values())
    print(
        f"fit: {fixed * 1e3:.3f} ms + {slope * 1e6:.2f} us a request "
        + "("
        + ", ".join(f"{k[:-2]} {s * 1e6:.2f} us" for k, (_, s) in fits.items())
        + ")"
    )
    mixed = []
    for shape in filter(None, args.mixed.split(",")):
        d, p_ = (int(x) for x in shape.split(":"))
        mixed.append({"decodes": d, "prompt": p_, "to_device_s": measure_mixed(runner, d, p_)})
    if mixed:
        print("\n| decodes | prompt tokens | eager inputs ms |\n|---:|---:|---:|")
        for m in mixed:
            print(f"| {m['decodes']} | {m['prompt']} | {m['to_device_s'] * 1e3:.3f} |")
    if args.json:
        out = {"rows": rows, "fit_fixed_s": fixed, "fit_per_request_s": slope, "mixed": mixed}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

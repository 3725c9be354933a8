"""Profile the real executor: whole engine steps over a grid of step shapes.

Each point is one SchedulerOutput built to a shape (decode: B requests of one token over
a context; prefill: a chunk of P tokens after C cached ones; mixed: D decodes beside a
prefill chunk; many short prompts), run through `executor.execute` exactly as
`EngineCore.step` runs it: input preparation, the forward (a CUDA graph where the engine
would replay one), the sampler and its host sync. Host work outside the executor (the
scheduler, output processing) is measured separately from a short real run through
`EngineCore`. The result is the profile JSON the simulator's profiled cost model fits.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.engine import EngineCore
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from kernels.compile_stats import total_compiled

# Replayed traces (and the fidelity benchmark) sample greedily: so do the profiled steps.
GREEDY = SamplingParams(temperature=0.0)

# (count, query tokens, context tokens, is_prompt): requests of one kind in a step
Group = tuple[int, int, int, bool]


@dataclass(frozen=True)
class StepShape:
    kind: str  # "decode", "prefill", "mixed" or "short_prompts"
    groups: tuple[Group, ...]

    @property
    def num_reqs(self) -> int:
        return sum(g[0] for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return sum(g[0] * g[1] for g in self.groups)

    def kv_tokens(self) -> int:
        return sum(g[0] * (g[1] + g[2]) for g in self.groups)


def default_grid(
    max_tokens: int, max_seqs: int, max_len: int, capacity: int, quick: bool = False
) -> list[StepShape]:
    """Decode (batch x context), prefill (tokens x prior context), mixed (decodes x prefill
    tokens) and many short prompts, within the engine's budgets and the cache."""
    if quick:
        batches, contexts = [1, 4, 16], [64, 256]
        chunks, priors = [16, 64, 256], [0, 128]
        mixes = [(4, 64, 256)]
        shorts = [4]
        long_priors = []
    else:
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        # Up to the model's context: long-context models decode at 16k-64k in real traces.
        contexts = [256, 1024, 4096, 7168] + [c for c in (16384, 32768, 65536) if c < max_len]
        chunks = [16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384]
        priors = [0, 1024, 4096]
        # Chunks of long prompts after a long cached prefix (multi-turn traces reach 64k+):
        # prefill attention is then most of the step, and a short-prefix grid cannot
        # calibrate it (Mooncake on DeepSeek-V2-Lite: 8k after 75k took 0.49 s).
        long_priors = [c for c in (16384, 65536) if c < max_len]
        mixes = [
            (d, p, c)
            for d in (4, 16, 64, 240)
            for p in (256, 512, 2048, 7680)
            for c in (1024, 4096)
        ]
        shorts = [8, 32, 96]
    grid: list[StepShape] = []
    for b in batches:
        for c in contexts:
            grid.append(StepShape("decode", ((b, 1, c, False),)))
    for p in chunks:
        for c in priors + (long_priors if p in (2048, 8192) else []):
            grid.append(StepShape("prefill", ((1, p, c, True),)))
    for d, p, ctx in mixes:
        grid.append(StepShape("mixed", ((d, 1, ctx, False), (1, p, 0, True))))
    for k in shorts:
        grid.append(StepShape("short_prompts", ((k, 64, 0, True),)))
    return [
        s for s in grid
        if s.num_tokens <= max_tokens and s.num_reqs <= max_seqs
        and all(g[1] + g[2] < max_len for g in s.groups) and s.kv_tokens() <= capacity
    ]  # fmt: skip


def _scheduled(
    shape: StepShape,
    block_size: int,
    num_blocks: int,
    vocab: int,
    rng: random.Random,
    reps: int = 0,
) -> list[ScheduledRequest]:
    """Requests of the shape, each over its own KV blocks (taken in order); decodes hold
    blocks for `reps` more steps (see _steady)."""
    out, cursor = [], 0
    for gi, (count, q, ctx, is_prompt) in enumerate(shape.groups):
        for i in range(count):
            n = -(-(ctx + q * (1 + (0 if is_prompt else reps))) // block_size)
            table = [(cursor + j) % num_blocks for j in range(n)]
            cursor += n
            out.append(ScheduledRequest(
                req_id=f"p{gi}.{i}", num_tokens=q, num_computed_tokens=ctx,
                is_prompt=is_prompt, samples=True, new_block_ids=[], block_table=table,
                token_ids=[rng.randrange(vocab) for _ in range(q)],
                sampling_params=GREEDY,
                num_prompt_tokens=ctx + q if is_prompt else ctx,
            ))  # fmt: skip
    return out


def _steady(sr: ScheduledRequest, rep: int) -> ScheduledRequest:
    """The request's work again, `rep` steps after its first run: a prompt chunk is
    started afresh (it sends its table), a decode goes on as decoding does (the runner
    holds it, and its context has grown by `rep` steps: the runner refuses a position
    it has already computed)."""
    if sr.is_prompt:
        return sr
    return ScheduledRequest(
        req_id=sr.req_id, num_tokens=sr.num_tokens,
        num_computed_tokens=sr.num_computed_tokens + rep * sr.num_tokens,
        is_prompt=False, samples=True, new_block_ids=[], token_ids=sr.token_ids,
        num_prompt_tokens=sr.num_prompt_tokens,
    )  # fmt: skip


def profile_steps(
    executor: Any,
    shapes: list[StepShape],
    reps: int = 5,
    seed: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Median, p10, p90 of `executor.execute` over `reps` runs of each shape."""
    rng = random.Random(seed)
    runner = executor.runner
    vocab = executor.config.vocab_size
    points = []
    for shape in shapes:
        first = _scheduled(
            shape, runner.block_size, runner.kv_cache.num_blocks, vocab, rng, reps=reps
        )
        compiled = total_compiled()
        executor.execute(SchedulerOutput(step_id=-1, scheduled=first))  # state, warm caches
        times = []
        for rep in range(1, reps + 1):
            steady = [_steady(sr, rep) for sr in first]
            t0 = time.perf_counter()
            executor.execute(SchedulerOutput(step_id=-1, scheduled=steady))
            times.append(time.perf_counter() - t0)
        done = {sr.req_id for sr in first}
        executor.execute(SchedulerOutput(step_id=-1, scheduled=[], finished_req_ids=done))
        times.sort()
        point = {
            "kind": shape.kind,
            "groups": [list(g) for g in shape.groups],
            "num_reqs": shape.num_reqs,
            "num_tokens": shape.num_tokens,
            "median_s": statistics.median(times),
            "p10_s": times[int(0.1 * (len(times) - 1))],
            "p90_s": times[round(0.9 * (len(times) - 1))],
            "reps": reps,
            "compiled": total_compiled() - compiled,
        }
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def profile_host(
    engine: EngineCore, num_requests: int = 96, seed: int = 0, max_prompt: int = 1024
) -> list[dict[str, Any]]:
    """Host time of the core around each step (schedule, then output processing) in a
    real run: per step the request and token counts and the two times."""
    rng = random.Random(seed)
    vocab = engine.executor.config.vocab_size
    max_prompt = min(max_prompt, engine.scheduler.max_model_len // 2)
    for i in range(num_requests):
        n = rng.randrange(16, max_prompt)
        params = SamplingParams(max_tokens=rng.randrange(8, 48), ignore_eos=True)
        engine.add_request(Request(f"h{i}", [rng.randrange(vocab) for _ in range(n)], params))
    samples = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        out = engine.schedule()
        t1 = time.perf_counter()
        res = engine.executor.execute(out)
        t2 = time.perf_counter()
        engine.process(out, res, t2 - t1)
        t3 = time.perf_counter()
        samples.append(
            {
                "num_reqs": len(out.scheduled),
                "num_tokens": out.num_batched_tokens,
                "schedule_s": t1 - t0,
                "process_s": t3 - t2,
                "execute_s": t2 - t1,
            }
        )
    return samples


def hardware_name(device: Any) -> str:
    """The simulator's hardware preset for this device ("h200", "h100", ...) or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "h800", "b200", "a100"):
        if key in name:
            return key
    return name.replace("nvidia", "").strip().replace(" ", "-")


def environment(executor: Any) -> dict[str, Any]:
    """Device, software versions and commit: where a profile's numbers come from."""
    import platform
    import subprocess
    from pathlib import Path

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    root = Path(__file__).resolve().parents[1]
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    dev = executor.device
    return {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "hardware": hardware_name(dev),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit,
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }

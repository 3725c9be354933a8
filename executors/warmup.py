"""Start-up warm-up: run one step of every shape class so that no served step compiles.

Triton compiles a kernel variant the first time it meets a new combination of launch
settings (which follow the step's token count in buckets) and of decode attention's
split mode; each compile costs hundreds of milliseconds. Served steps would pay them
one by one (seconds of stalls early in a trace), so the executor runs, before the
first request, a prefill step for every token-count bucket and decode steps with and
without split-KV, through the runner's ordinary path. The requests are synthetic and
write only into KV blocks no request holds yet (the scheduler starts with an empty
cache, and nothing of theirs is hashed for the prefix cache).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from executors.model_runner import ModelRunner
from kernels.compile_stats import total_compiled
from kernels.ops import warmup_token_counts

logger = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    seconds: float
    num_steps: int
    num_compiled: int  # kernel variants compiled during the warm-up


def _request(req_id: str, num_tokens: int, context: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        num_tokens=num_tokens,
        num_computed_tokens=context,
        is_prompt=context == 0,
        will_sample=True,
        new_block_ids=[],
        block_table=table,
        token_ids=[0] * num_tokens,
        num_prompt_tokens=context + num_tokens,
    )


def warm_up(runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int) -> WarmupReport:
    """Run the warm-up steps eagerly (call it before capturing CUDA graphs)."""
    t0 = time.perf_counter()
    before = total_compiled()
    bs, num_blocks = runner.block_size, runner.kv_cache.num_blocks
    capacity = num_blocks * bs
    steps: list[list[ScheduledRequest]] = []
    # Prefill: one prompt per token-count bucket (router, MoE and alignment settings).
    for n in warmup_token_counts(min(max_num_batched_tokens, capacity)):
        steps.append([_request("warm-p", n, 0, list(range(-(-n // bs))))])
    # Decode: one request over a long context (split-KV + merge), and the widest batch of
    # one-token requests over a short one (no split); they share blocks (reads only).
    long_ctx = min(capacity, runner.max_model_len) - 1
    if long_ctx > 0:
        steps.append([_request("warm-d", 1, long_ctx, list(range(-(-(long_ctx + 1) // bs))))])
    for b in sorted({1, min(max_num_seqs, max_num_batched_tokens)}):
        steps.append([_request(f"warm-d{i}", 1, 1, [0]) for i in range(b)])
    # A decode engine fills a request's counted context from its import; the synthetic
    # decode steps count context that nobody computed and read whatever the blocks hold.
    imports, runner.kv_transfer.imports = runner.kv_transfer.imports, False
    try:
        for i, scheduled in enumerate(steps):
            runner.execute(SchedulerOutput(step_id=-1 - i, scheduled=scheduled))
            done = {sr.req_id for sr in scheduled}
            runner.execute(SchedulerOutput(step_id=-1 - i, scheduled=[], finished_req_ids=done))
    finally:
        runner.kv_transfer.imports = imports
    runner.masks.warm_up()  # the grammar mask kernel (structured outputs)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report = WarmupReport(time.perf_counter() - t0, len(steps), total_compiled() - before)
    logger.info(
        "warm-up: %d steps, %d kernel variants compiled, %.1f s",
        report.num_steps,
        report.num_compiled,
        report.seconds,
    )
    return report


def freeze_heap() -> None:
    """Collect, then move every object alive into the collector's permanent generation
    (gc.freeze, as vLLM's engine does after start-up). A served engine's long-lived
    objects (modules, graphs, kernel metadata) are then
    not traversed again, so a full collection skips them instead of walking them in
    the middle of a step (benchmarks/investigations/gc_pauses.py measures it). Frozen
    cycles are never collected until `gc.unfreeze()`: the executor's shutdown, or the next
    CUDA executor's start (`release_dropped_engines`), which frees an engine dropped
    without a shutdown before it sizes its own KV cache."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def release_dropped_engines() -> None:
    """Before a CUDA executor sizes its KV cache from the free device memory: an engine
    dropped without a shutdown holds its memory in cycles that `freeze_heap` froze, which
    a plain `gc.collect()` no longer frees. Unfreeze, collect, and give the freed blocks
    back to the device."""
    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()

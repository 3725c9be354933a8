"""Explicit cases that random workloads under the ci profile rarely reach, given to
the properties with `@example` (each found by a mutant of the core that survived
tests/property; its name is in the comment)."""

from __future__ import annotations

from deepinfer.config import EngineConfig
from tests.property.strategies import EngineCase, ReqSpec, Workload

# b (5 tokens) preempts itself for its second block and restarts with 8 tokens, whole
# blocks: a restart that keeps one computed token (`_preempt__mutmut_5`) takes a third.
RESTART_FILLS_WHOLE_BLOCKS: tuple[EngineCase, Workload] = (
    EngineCase(
        EngineConfig(
            block_size=4,
            num_gpu_blocks=3,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            prefill_watermark=1.0,
        ),
        0.7,
    ),
    (ReqSpec("a", 0, (1, 2), max_tokens=4), ReqSpec("b", 0, tuple(range(100, 105)), 4)),
)

# Async scheduling with a draft always accepted: a's step in flight reaches
# max_model_len, so the next step gives a no token (its work is 0) while b, after it
# in running, still has work (`_schedule_running__mutmut_33`, `_37`, `_38`: a
# zero-token request scheduled, b skipped, the loop left).
NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER: tuple[EngineCase, Workload] = (
    EngineCase(
        EngineConfig(
            block_size=4,
            num_gpu_blocks=16,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=8,
            prefill_watermark=1.0,
            async_scheduling=True,
            num_speculative_tokens=1,
            enable_mtp_varlen=False,
        ),
        1.0,
    ),
    (ReqSpec("a", 0, (1, 2, 3, 4), max_tokens=100), ReqSpec("b", 0, (100,), max_tokens=100)),
)

"""Explicit cases that random workloads under the ci profile rarely reach, given to
the properties with `@example` (each found by a mutant of the core that survived
tests/property; its name is in the comment)."""

from __future__ import annotations

from deepinfer.config import EngineConfig
from tests.property.strategies import EngineCase, ReqSpec, Workload, sim_token


def _config(**overrides: object) -> EngineConfig:
    """A 16-block cache of 4-token blocks, four sequences, 64 tokens a step."""
    base: dict[str, object] = dict(
        block_size=4, num_gpu_blocks=16, max_num_seqs=4, max_num_batched_tokens=64,
        prefill_watermark=1.0,
    )  # fmt: skip
    return EngineConfig(**{**base, **overrides})  # type: ignore[arg-type]


# b (5 tokens) preempts itself for its second block and restarts with 8 tokens, whole
# blocks: a restart that keeps one computed token (`_preempt__mutmut_5`) takes a third.
RESTART_FILLS_WHOLE_BLOCKS: tuple[EngineCase, Workload] = (
    EngineCase(_config(num_gpu_blocks=3), 0.7),
    (ReqSpec("a", 0, (1, 2), max_tokens=4), ReqSpec("b", 0, tuple(range(100, 105)), 4)),
)

# Async scheduling with a draft always accepted: a's step in flight reaches
# max_model_len, so the next step gives a no token (its work is 0) while b, after it
# in running, still has work (`_schedule_running__mutmut_33`, `_37`, `_38`: a
# zero-token request scheduled, b skipped, the loop left).
NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER: tuple[EngineCase, Workload] = (
    EngineCase(
        _config(
            max_model_len=8,
            async_scheduling=True,
            num_speculative_tokens=1,
            enable_mtp_varlen=False,
        ),
        1.0,
    ),  # fmt: skip
    (ReqSpec("a", 0, (1, 2, 3, 4), max_tokens=100), ReqSpec("b", 0, (100,), max_tokens=100)),
)

# a's decode step fills its first block; b, arriving in that step, starts with those
# four tokens: the block is cached by a's allocation, before b looks it up
# (`_schedule_running__mutmut_44`: one draft counted where none was scheduled leaves
# the block's last token uncached until a's next step).
BLOCK_FILLED_BY_A_DECODE_HIT_IN_THE_SAME_STEP: tuple[EngineCase, Workload] = (
    EngineCase(_config(), 0.7),
    (
        ReqSpec("a", 0, (1, 2, 3), max_tokens=4),
        ReqSpec("b", 1, (1, 2, 3, sim_token("a", 3), 9), max_tokens=2),
    ),
)

# With the handoff test's flavours (the 2nd request submitted asks for prompt logprobs):
# b's prompt is a's, cached when b arrives; b must still compute all of it
# (`_start__mutmut_10`, `_13`: the hit taken anyway).
PROMPT_LOGPROBS_OVER_A_CACHED_PROMPT: tuple[EngineCase, Workload] = (
    EngineCase(_config(), 0.7),
    (
        ReqSpec("a", 0, tuple(range(1, 10)), max_tokens=2),
        ReqSpec("b", 2, tuple(range(1, 10)), max_tokens=2),
    ),
)


def _beside_a_long_prompt(prompt_len: int) -> tuple[EngineCase, Workload]:
    """a's prompt of `prompt_len` tokens holds usage at ceil(prompt_len / 4) / 16 of a
    0.5 watermark when b (3 tokens) arrives in a's first decode step (NORMAL role)."""
    return EngineCase(_config(prefill_watermark=0.5), 0.7), (
        ReqSpec("a", 0, tuple(range(1, prompt_len + 1)), max_tokens=4),
        ReqSpec("b", 1, (100, 101, 102), max_tokens=2),
    )


# Usage 10/16 > 0.5: b waits (`_start__mutmut_7`: the watermark applied in the other
# roles instead of NORMAL, so b starts).
USAGE_ABOVE_THE_WATERMARK = _beside_a_long_prompt(39)
# Usage 8/16 == 0.5: b starts (`_start__mutmut_8`: `>=` holds it back).
USAGE_AT_THE_WATERMARK = _beside_a_long_prompt(31)

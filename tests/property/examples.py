"""Explicit cases that random workloads under the ci profile rarely reach, given to
the properties with `@example` (each found by a mutant of the core that survived
tests/property; its name is in the comment).

Each example pins every EngineConfig field (none is left to a default or to an
environment variable, so a changed default cannot move it off its boundary), and
tests/property/test_examples_reach.py asserts that it still reaches the state its
comment names.
"""

from __future__ import annotations

import dataclasses

from deepinfer.config import EngineConfig, EngineRole
from tests.property.strategies import EngineCase, ReqSpec, Workload, sim_token

_PINNED: dict[str, object] = dict(
    block_size=4, num_gpu_blocks=16, gpu_memory_utilization=0.9, max_num_seqs=4,
    max_num_batched_tokens=64, max_model_len=None, enable_chunked_prefill=True,
    prefill_watermark=1.0, enable_prefix_caching=True, role=EngineRole.NORMAL,
    num_speculative_tokens=0, enable_mtp_varlen=False, policy="fcfs", seed=0,
    data_parallel_size=1, data_parallel_router="least-load", enable_expert_parallel=False,
    batch_invariant=False, quantization=None, kv_host_cache_gib=0.0,
)  # fmt: skip


def _config(*, async_scheduling: bool, **overrides: object) -> EngineConfig:
    """A 16-block cache of 4-token blocks, four sequences, 64 tokens a step, every other
    field pinned too; each example says whether it steps asynchronously."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unpinned = fields - set(_PINNED) - {"async_scheduling"}
    if unpinned:  # a new field: its default would silently shape every example
        raise AssertionError(f"examples.py: pin the new EngineConfig fields {sorted(unpinned)}")
    pinned = {**_PINNED, **overrides, "async_scheduling": async_scheduling}
    return EngineConfig(**pinned)  # type: ignore[arg-type]


# A 3-block cache: a's decode needs its second block while b (5 tokens) holds two, so b
# (the newest) is preempted and restarts with 8 tokens, whole blocks: a restart that
# keeps one computed token (`_preempt__mutmut_5`) takes a third.
RESTART_FILLS_WHOLE_BLOCKS: tuple[EngineCase, Workload] = (
    EngineCase(_config(num_gpu_blocks=3, async_scheduling=True), 0.7),
    (ReqSpec("a", 0, (1, 2), max_tokens=4), ReqSpec("b", 0, tuple(range(100, 105)), 4)),
)


def _one_draft_always_accepted(**overrides: object) -> EngineCase:
    """Async scheduling with one draft a step, always accepted: each running request's
    known tokens grow by two a step."""
    cfg = _config(async_scheduling=True, num_speculative_tokens=1, enable_mtp_varlen=False,
                  **overrides)  # fmt: skip
    return EngineCase(cfg, 1.0)


# a's step in flight reaches max_model_len, so the next step gives a no token (its work
# is 0) while b, after it in running, still has work (`_schedule_running__mutmut_33`,
# `_37`, `_38`: a zero-token request scheduled, b skipped, the loop left).
NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER: tuple[EngineCase, Workload] = (
    _one_draft_always_accepted(max_model_len=8),
    (ReqSpec("a", 0, (1, 2, 3, 4), max_tokens=100), ReqSpec("b", 0, (100,), max_tokens=100)),
)

# As above with the request that reaches max_model_len third in running: a and b, ahead
# of c, are scheduled, then c has no work (`_schedule_running__mutmut_47`: after a request
# with no work the loop goes back to the second, scheduling b again in that step). c's
# 20-token prompt, chunked by the 8-token budget, puts it 6 tokens from the limit while a
# and b are still 9 away: the budget then ends that loop before b's work does.
NO_WORK_AT_MAX_MODEL_LEN_THIRD_IN_RUNNING: tuple[EngineCase, Workload] = (
    _one_draft_always_accepted(max_model_len=22, max_num_batched_tokens=8),
    (
        ReqSpec("a", 0, (1,), max_tokens=100),
        ReqSpec("b", 0, (50,), max_tokens=100),
        ReqSpec("c", 0, tuple(range(100, 120)), max_tokens=100),
    ),
)

# Three one-token prompts in a 3-token budget: in each decode step after the first,
# a and b take two tokens and c, last in running, gets the budget's last one
# (`_schedule_running__mutmut_8`: the running loop left while one token remains).
LAST_DECODE_ON_THE_BUDGETS_LAST_TOKEN: tuple[EngineCase, Workload] = (
    EngineCase(_config(max_num_batched_tokens=3, async_scheduling=False), 0.7),
    tuple(ReqSpec(r, 0, (i + 1,), max_tokens=3) for i, r in enumerate("abc")),
)

# a's decode step fills its first block; b, arriving in that step, starts with those
# four tokens: the block is cached by a's allocation, before b looks it up
# (`_schedule_running__mutmut_44`: one draft counted where none was scheduled leaves
# the block's last token uncached until a's next step).
# Synchronous: under async scheduling a's decode is in flight when b arrives, and b's hit
# comes a step later.
BLOCK_FILLED_BY_A_DECODE_HIT_IN_THE_SAME_STEP: tuple[EngineCase, Workload] = (
    EngineCase(_config(async_scheduling=False), 0.7),
    (
        ReqSpec("a", 0, (1, 2, 3), max_tokens=4),
        ReqSpec("b", 1, (1, 2, 3, sim_token("a", 3), 9), max_tokens=2),
    ),
)

# With the handoff test's flavours (the 2nd request submitted asks for prompt logprobs):
# b's prompt is a's, cached when b arrives; b must still compute all of it
# (`_start__mutmut_10`, `_13`: the hit taken anyway).
PROMPT_LOGPROBS_OVER_A_CACHED_PROMPT: tuple[EngineCase, Workload] = (
    EngineCase(_config(async_scheduling=True), 0.7),
    (
        ReqSpec("a", 0, tuple(range(1, 10)), max_tokens=2),
        ReqSpec("b", 2, tuple(range(1, 10)), max_tokens=2),
    ),
)


def _beside_a_long_prompt(prompt_len: int) -> tuple[EngineCase, Workload]:
    """a's prompt of `prompt_len` tokens holds usage at ceil(prompt_len / 4) / 16 of a
    0.5 watermark when b (3 tokens) arrives in a's first decode step (NORMAL role).
    Synchronous: under async scheduling a's next decode, scheduled before b, can take
    another block first, moving usage off the boundary."""
    return EngineCase(_config(prefill_watermark=0.5, async_scheduling=False), 0.7), (
        ReqSpec("a", 0, tuple(range(1, prompt_len + 1)), max_tokens=4),
        ReqSpec("b", 1, (100, 101, 102), max_tokens=2),
    )


# Usage 10/16 > 0.5: b waits (`_start__mutmut_7`: the watermark applied in the other
# roles instead of NORMAL, so b starts).
USAGE_ABOVE_THE_WATERMARK = _beside_a_long_prompt(39)
# Usage 8/16 == 0.5: b starts (`_start__mutmut_8`: `>=` holds it back).
USAGE_AT_THE_WATERMARK = _beside_a_long_prompt(31)


# b arrives after a has cached the two blocks of prompt they share, so b's record has an
# 8-token prefix hit (for mutmut's few-example profile: tests/property/test_records.py).
_SHARED = tuple(range(1, 9))
PREFIX_HIT_OF_TWO_BLOCKS: tuple[EngineCase, Workload] = (
    EngineCase(
        _config(
            num_gpu_blocks=40,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            prefill_watermark=0.9,
            async_scheduling=True,
        ),
        0.7,
    ),  # fmt: skip
    (ReqSpec("a", 0, (*_SHARED, 9, 10), 4), ReqSpec("b", 3, (*_SHARED, 11, 12), 4)),
)

# A long prompt in chunks (a prefill in progress at step ends) while a short one waits,
# then starts on a's cached first block (for mutmut's few-example profile:
# tests/property/test_self_checks.py).
CHUNKED_PROMPT_BESIDE_A_WAITING_ONE: tuple[EngineCase, Workload] = (
    EngineCase(
        _config(max_num_batched_tokens=8, prefill_watermark=0.9, async_scheduling=True), 0.7
    ),
    (ReqSpec("a", 0, tuple(range(1, 25)), 2), ReqSpec("b", 0, (1, 2, 3, 4, 5), 2)),
)

# Seven requests at once in a roomy cache: seven block holders, more than the stall
# diagnosis lists (tests/property/test_diagnosis.py).
SEVEN_BLOCK_HOLDERS: tuple[EngineCase, Workload] = (
    EngineCase(
        _config(
            block_size=2,
            num_gpu_blocks=64,
            max_num_seqs=8,
            prefill_watermark=0.9,
            async_scheduling=True,
        ),
        0.7,
    ),  # fmt: skip
    tuple(ReqSpec(f"r{i}", 0, tuple(range(100 * i + 1, 100 * i + 2 + i)), 3) for i in range(7)),
)


# Speculation with every draft accepted, a 4-block cache: b (2 prompt tokens) verifies two
# drafts whose acceptance fills its block 0 (known to be full only after the step, so
# its scheduling could not cache it ahead), then a's next verify preempts b, which
# restarts on that cached block (`cache_computed__mutmut_1`, `_2`, `_4`: caching less or
# nothing after a step's results).
ACCEPTED_DRAFTS_FILL_A_BLOCK_THEN_PREEMPTED: tuple[EngineCase, Workload] = (
    EngineCase(
        _config(
            num_gpu_blocks=4,
            async_scheduling=False,
            num_speculative_tokens=2,
            enable_mtp_varlen=False,
        ),
        1.0,
    ),
    (ReqSpec("a", 0, (1,), max_tokens=6), ReqSpec("b", 0, (100, 101), max_tokens=6)),
)

"""Core bugs this suite found that are not fixed yet, each pinned by an
`xfail(strict=True)` test in tests/core/test_regressions.py.

The property tests tolerate exactly these (and nothing else) so that the suite
stays green. When a bug is fixed its regression test XPASSes, which a strict
xfail reports as a failure: remove that xfail marker and set the flag here to
False, so the properties check the full rule again.
"""

from __future__ import annotations

# B1: when the only running request must preempt itself because an in-progress
# chunked prefill holds the rest of the cache, the step schedules nothing at all
# (the waiting loop is skipped after any preemption, in-progress chunks included):
# an empty step, which EngineCore.step() reports as SchedulerStalled.
EMPTY_STEP_AFTER_PREEMPTION = False

# B2: with chunked prefill off, a request preempted after it grew past
# max_num_batched_tokens can never be recomputed in one step: the engine stalls.
# The generators then cap max_model_len at the budget (the suggested fix).
UNCHUNKED_RECOMPUTE_CAN_EXCEED_BUDGET = False

# B3: SimExecutor derives a sampled token from `num_computed_tokens + num_tokens`,
# which counts the draft slots, so under speculation the token at position p is
# f(p + number of drafts verified in that step) instead of f(p).
SIM_TOKEN_POSITION_COUNTS_DRAFTS = False

# B5: Request.content_key keys a block that straddles the prompt/output boundary
# as (prompt part, output part), unlike the flat tuple of the same tokens in a
# prompt, so a later prompt that repeats prompt + output (a chat's next turn)
# misses that block and, the hashes being chained, every block after it.
PREFIX_KEY_SPLITS_AT_PROMPT_END = False

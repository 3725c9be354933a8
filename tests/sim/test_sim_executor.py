"""SimExecutor: a decode run's tokens are those its steps one by one would sample."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim.sim_executor import SimExecutor


@pytest.mark.parametrize(
    ("contexts", "num_steps"),
    [
        ([5, 70, 3000], [4, 4, 2]),  # few tokens: made one range a request
        ([17, 900, 123456, 2**33], [60, 60, 31, 0]),  # many: one array, ends within it
        ([0], [0]),
    ],
)
def test_a_decode_runs_tokens_are_its_single_steps_tokens(
    contexts: list[int], num_steps: list[int]
) -> None:
    """Request i's token of the run's step s is the token `execute` samples for a step
    that decodes position contexts[i] + s: whether the run's tokens are made one range a
    request or as one array."""
    ids = [f"req-{i}" for i in range(len(contexts))]
    run = SimExecutor(EngineConfig(num_gpu_blocks=8)).execute_decode_run(
        ids, contexts, num_steps, frozenset()
    )
    single = SimExecutor(EngineConfig(num_gpu_blocks=8))
    for rid, ctx, steps, tokens in zip(ids, contexts, num_steps, run):
        expected = []
        for s in range(steps):
            sr = ScheduledRequest(rid, 1, ctx + s, False, True, [])
            expected += single.execute(SchedulerOutput(s, [sr])).sampled_token_ids[rid]
        assert tokens == expected

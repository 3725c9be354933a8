"""One profiled step shape's requests on a model runner (executors/profiler.py): built
to the shape, then stepped as the scheduler would move them, in order or pipelined."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer.sampling_params import SamplingParams
from executors.profile_grid import StepShape, run_slack

# Replayed traces (and the fidelity benchmark) sample greedily: so do the profiled steps.
GREEDY = SamplingParams(temperature=0.0)


class StepSession:
    """The requests of one shape on a model runner, stepped as the scheduler would: run
    `first` once (it sends their tables), then `next_step()` and `advance(result)` up to
    `reps` times, then finish them. Prompt chunks are sent again whole (their table
    resets the runner's state); decode and verify requests move on by the tokens each
    step gave them, verifying the drafter's latest proposal (random tokens where it made
    none)."""

    def __init__(self, shape: StepShape, runner: Any, rng: random.Random, reps: int) -> None:
        block_size, num_blocks = runner.block_size, runner.kv_cache.num_blocks
        max_blocks = -(-runner.max_model_len // block_size)
        vocab = runner.vocab_size
        self.rng, self.vocab = rng, vocab
        self.first: list[ScheduledRequest] = []
        self.drafts: dict[str, int] = {}  # req_id -> drafts verified each step
        cursor = 0
        for gi, (count, q, ctx, is_prompt, k) in enumerate(shape.groups):
            # Room for the step, the runs after it and the drafter's chained positions
            # (never wider than a graph's table: a wider one would not replay graphs).
            n = min(max_blocks, -(-(ctx + run_slack(q, k, reps)) // block_size))
            for i in range(count):
                table = [(cursor + j) % num_blocks for j in range(n)]
                cursor += n
                rid = f"p{gi}.{i}"
                tokens = [rng.randrange(vocab) for _ in range(q)]
                self.first.append(ScheduledRequest(
                    req_id=rid, num_tokens=q, num_computed_tokens=ctx,
                    is_prompt=is_prompt, will_sample=True, new_block_ids=[], block_table=table,
                    token_ids=tokens, draft_token_ids=tokens[q - k :] if k else [],
                    sampling_params=GREEDY,
                    num_prompt_tokens=ctx + q if is_prompt else ctx,
                ))  # fmt: skip
                self.drafts[rid] = k
        self.computed = {sr.req_id: sr.num_computed_tokens for sr in self.first}
        self.live: dict[str, str] = {}  # prompt request -> its copy in the runner (pipelined)
        self.copies = 0
        self.last = {sr.req_id: sr.token_ids[-1] for sr in self.first if sr.token_ids}
        self.proposed: dict[str, list[int]] = {}

    def advance(self, res: ModelRunnerOutput) -> None:
        for rid, toks in res.sampled_token_ids.items():
            if toks and rid in self.computed:  # (a caller's own requests aside)
                self.computed[rid] += len(toks)
                self.last[rid] = toks[-1]
        self.proposed = res.draft_token_ids

    def settle(self, res: ModelRunnerOutput) -> None:
        """A pipelined step read: its requests are as far on as the tokens it gave, not
        as every draft accepted, which the steps built after it assumed (the scheduler's
        correction when it applies a step)."""
        for rid, toks in res.sampled_token_ids.items():
            if rid in self.computed:
                self.computed[rid] -= 1 + self.drafts[rid] - len(toks)

    def finish(self) -> SchedulerOutput:
        """The step that drops the shape's requests from the runner."""
        done = {sr.req_id for sr in self.first} | set(self.live.values())
        return SchedulerOutput(step_id=-1, scheduled=[], finished_req_ids=done)

    def next_step(self, pipelined: bool = False) -> SchedulerOutput:
        """The shape's next step. pipelined (async scheduling): it is built before the
        step before it is read, as the scheduler builds it: each decode or verify request
        one token further plus its drafts (every draft assumed accepted), its newest token
        and drafts left to the runner (taken from the step in flight on the device, the
        rows moved back by the drafts it rejected); prompt chunks come as new requests (a
        chunk sent again whole would make the runner read the step in flight first)."""
        scheduled = []
        finished: set[str] = set()
        for sr in self.first:
            if sr.is_prompt:
                if pipelined:
                    self.copies += 1
                    rid = f"{sr.req_id}#{self.copies}"
                    finished.add(self.live.pop(sr.req_id, sr.req_id))
                    self.live[sr.req_id] = rid
                    sr = dataclasses.replace(sr, req_id=rid)
                scheduled.append(sr)
                continue
            k = self.drafts[sr.req_id]
            if pipelined:
                start = self.computed[sr.req_id]
                self.computed[sr.req_id] += 1 + k
                scheduled.append(ScheduledRequest(
                    req_id=sr.req_id, num_tokens=1 + k, num_computed_tokens=start,
                    is_prompt=False, will_sample=True, new_block_ids=[], token_ids=[],
                    draft_token_ids=[DRAFT_PLACEHOLDER] * k,
                    num_prompt_tokens=sr.num_prompt_tokens,
                ))  # fmt: skip
                continue
            drafts = list(self.proposed.get(sr.req_id, ()))[:k]
            drafts += [self.rng.randrange(self.vocab) for _ in range(k - len(drafts))]
            scheduled.append(ScheduledRequest(
                req_id=sr.req_id, num_tokens=1 + k, num_computed_tokens=self.computed[sr.req_id],
                is_prompt=False, will_sample=True, new_block_ids=[],
                token_ids=[self.last[sr.req_id]] + drafts, draft_token_ids=drafts,
                num_prompt_tokens=sr.num_prompt_tokens,
            ))  # fmt: skip
        return SchedulerOutput(step_id=-1, scheduled=scheduled, finished_req_ids=finished)

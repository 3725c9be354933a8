"""The grid of step shapes `deepinfer profile` measures (executors/profiler.py runs them).

Pure Python: a shape is groups of requests (count, query, context, prompt or not, drafts
verified), and whether the MTP drafter proposes after the step (a speculating engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# (count, query tokens, context tokens, is_prompt, drafts verified): requests of one kind
# in a step; a verify request's query is its newest token plus its drafts.
Group = tuple[int, int, int, bool, int]


@dataclass(frozen=True)
class StepShape:
    kind: str  # "decode", "prefill", "mixed", "short_prompts"; "verify", "spec_decode", ...
    groups: tuple[Group, ...]
    drafter: bool = False  # the MTP drafter proposes after the step (a speculating engine)

    @property
    def num_reqs(self) -> int:
        return sum(g[0] for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return sum(g[0] * g[1] for g in self.groups)

    def kv_tokens(self) -> int:
        return sum(g[0] * (g[1] + g[2]) for g in self.groups)


class GridLimits(NamedTuple):
    """What a grid point must fit: the engine's budgets, its longest request, the cache
    (tokens), and `slack` positions past each request's step for the runs that follow
    (decodes advance) and the drafter (see run_slack)."""

    max_tokens: int
    max_seqs: int
    max_len: int
    capacity: int
    slack: int = 0

    def keep(self, grid: list[StepShape]) -> list[StepShape]:
        return [
            s for s in grid
            if s.num_tokens <= self.max_tokens and s.num_reqs <= self.max_seqs
            and all(g[1] + g[2] + self.slack <= self.max_len for g in s.groups)
            and s.kv_tokens() <= self.capacity
        ]  # fmt: skip


def default_grid(limits: GridLimits, quick: bool = False) -> list[StepShape]:
    """Decode (batch x context), prefill (tokens x prior context), mixed (decodes x prefill
    tokens, the chunk after no prefix or a cached one) and many short prompts, within the
    engine's budgets and the cache."""
    if quick:
        batches, contexts = [1, 4, 16], [64, 256]
        chunks, priors = [16, 64, 256], [0, 128]
        mixes = [(4, 64, 256, 0), (4, 64, 256, 128)]
        shorts = [4]
        long_priors: list[int] = []
        between: list[int] = []
    else:
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        # Up to the model's context: long-context models decode at 16k-64k in real traces.
        # 512: the split-KV choice changes with the context, so decode time need not be
        # linear between 256 and 1024.
        contexts = [256, 512, 1024, 4096, 7168] + [
            c for c in (16384, 32768, 65536) if c < limits.max_len
        ]
        chunks = [16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384]
        priors = [0, 1024, 4096]
        # Lone chunks between the piecewise graphs' token buckets (the chunks above are
        # buckets' sizes): the runner pads them to their bucket, which the cost model
        # prices and the held-out check can then test.
        between = [200, 700, 2600]
        # Chunks of long prompts after a long cached prefix (multi-turn traces reach 64k+):
        # prefill attention is then most of the step, and a short-prefix grid cannot
        # calibrate it.
        long_priors = [c for c in (16384, 65536) if c < limits.max_len]
        # (decodes, chunk tokens, the decodes' context, the chunk's cached prefix)
        mixes = [
            (d, p, c, 0)
            for d in (4, 16, 64, 240)
            for p in (256, 512, 2048, 7680)
            for c in (1024, 4096)
        ]
        # Decodes at long contexts beside a chunk (long-context traces' mixed steps): the
        # decode attention's longest request then outweighs the chunk.
        mixes += [(d, p, c, 0) for d in (4, 16) for p in (512, 2048) for c in long_priors]
        # A chunk after a cached prefix beside decodes (a multi-turn conversation's next
        # turn, or a long prompt's later chunk, while others decode): the chunk's
        # attention over the prefix is priced beside decode work, not only alone.
        mixes += [
            (d, p, c, prior)
            for d in (16, 64)
            for p in (512, 2048)
            for prior in [4096, *long_priors]
            for c in (4096, prior)
        ]
        shorts = [8, 32, 96]
    grid: list[StepShape] = []
    for b in batches:
        for c in contexts:
            grid.append(StepShape("decode", ((b, 1, c, False, 0),)))
    for p in chunks:
        for c in priors + (long_priors if p in (2048, 8192) else []):
            grid.append(StepShape("prefill", ((1, p, c, True, 0),)))
    for p in between:
        grid.append(StepShape("prefill", ((1, p, 0, True, 0),)))
    for d, p, ctx, prior in dict.fromkeys(mixes):  # (in order, once each)
        grid.append(StepShape("mixed", ((d, 1, ctx, False, 0), (1, p, prior, True, 0))))
    for k in shorts:
        grid.append(StepShape("short_prompts", ((k, 64, 0, True, 0),)))
    return limits.keep(grid)


def speculative_grid(num_drafts: int, limits: GridLimits, quick: bool = False) -> list[StepShape]:
    """The steps of a speculating engine (each followed by the drafter's proposal):
    verify (B requests of 1 + k tokens over a context, k = 1..num_drafts), decode (the
    steps before drafts exist, k = 0) and a few prompt chunks (the drafter's first pass
    runs over every position of a step)."""
    if quick:
        batches, contexts, chunks = [1, 4, 16], [64, 256], [64, 256]
    else:
        batches, contexts = [1, 2, 4, 8, 16, 64, 256, 512], [256, 1024, 4096]
        chunks = [512, 4096]
    # Verify at long contexts, at the small batches that reach them: split-KV cuts a
    # context into fewer pieces as the batch grows, which contexts to 4,096 barely show.
    long_contexts = [] if quick else [c for c in (16384, 65536) if c < limits.max_len]
    grid: list[StepShape] = []
    for b in batches:
        for c in contexts + (long_contexts if b <= 16 else []):
            grid.append(StepShape("spec_decode", ((b, 1, c, False, 0),), drafter=True))
            for k in range(1, num_drafts + 1):
                grid.append(StepShape("verify", ((b, 1 + k, c, False, k),), drafter=True))
    for p in chunks:
        grid.append(StepShape("spec_prefill", ((1, p, 0, True, 0),), drafter=True))
    return limits.keep(grid)


def run_slack(query: int, drafts: int, reps: int) -> int:
    """Positions a request of `query` tokens needs from its context on: the first run and
    `reps` timed ones (a decode or verify request moves on by up to `query` tokens each),
    the drafter's chained positions after the last; a decode or verify request then
    `reps` + 2 pipelined steps of 1 + drafts tokens (profiler._pipelined: every draft
    assumed accepted) and their chained positions, and on CUDA `reps` steps more
    (profiler._device_only)."""
    if query == 1 + drafts:
        return (3 * reps + 3) * query + drafts
    return (reps + 1) * query + drafts

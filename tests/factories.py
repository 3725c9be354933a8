"""Test factories: engines and requests that need no GPU, no trace file and no simulator."""

from __future__ import annotations

import random
from collections.abc import Sequence

from deepinfer.config import EngineConfig
from deepinfer.data_parallel.protocol import RankInfo
from deepinfer.engine import EngineCore
from deepinfer.executor import Executor
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler_checks import diagnose_stall


def make_config(**overrides: object) -> EngineConfig:
    """A small engine config. It steps synchronously (step N applied before N+1 is
    scheduled) unless asked: these unit tests follow one step at a time; the property
    suite draws both modes, and the LLM tests run the engine's default (async)."""
    base: dict[str, object] = dict(
        block_size=4,
        num_gpu_blocks=10,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        async_scheduling=False,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def make_engine(
    config: EngineConfig | None = None,
    *,
    check: bool = True,
    acceptance_rate: float = 0.7,
    **overrides: object,
) -> EngineCore:
    cfg = config or make_config(**overrides)
    assert cfg.num_gpu_blocks is not None
    ex = ScriptedExecutor(
        cfg.num_gpu_blocks, cfg.num_speculative_tokens, acceptance_rate, seed=cfg.seed
    )
    return EngineCore(cfg, ex, clock=StepClock(), check_invariants=check)


class ScriptedExecutor(Executor):
    """The Executor contract with no model: the token sampled at position p is
    `1000 + p`; each draft is accepted with probability `acceptance_rate` (seeded),
    and the next drafts are the tokens this rule will produce."""

    needs_token_ids = False

    def __init__(
        self, num_blocks: int, num_drafts: int = 0, acceptance_rate: float = 1.0, *, seed: int = 0
    ) -> None:
        self._num_blocks = num_blocks
        self.k = num_drafts
        self.acceptance_rate = acceptance_rate
        self._rng = random.Random(seed)
        self._computed: dict[str, int] = {}  # as SimExecutor: the real start under async

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = ModelRunnerOutput()
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self._computed.pop(rid, None)
        for sr in out.scheduled:
            start = sr.num_computed_tokens
            if sr.block_table is None and sr.req_id in self._computed:
                start = self._computed[sr.req_id]
            self._computed[sr.req_id] = start + sr.num_tokens
            if not sr.will_sample:
                continue
            accepted = 0
            while accepted < len(sr.draft_token_ids) and self._rng.random() < self.acceptance_rate:
                accepted += 1
            self._computed[sr.req_id] -= len(sr.draft_token_ids) - accepted
            first = start + sr.num_tokens - len(sr.draft_token_ids)
            res.sampled_token_ids[sr.req_id] = [1000 + first + j for j in range(accepted + 1)]
            if self.k:
                nxt = first + accepted + 1
                res.draft_token_ids[sr.req_id] = [1000 + nxt + j for j in range(self.k)]
        return res


class StepClock:
    """A clock that advances 1 ms per reading: deterministic timestamps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def make_request(
    req_id: str, prompt: Sequence[int] | int, max_tokens: int = 4, **params: object
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return Request(req_id, tokens, sp)


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> int:
    """Step until nothing is left; returns the number of steps (fails on a hang)."""
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps > max_steps:
            raise AssertionError(
                f"not finished after {max_steps} steps:\n{diagnose_stall(engine.scheduler)}"
            )
    return steps


def rank_info(rank: int, engine: EngineCore) -> RankInfo:
    """What an in-process data-parallel rank over `engine` tells the front-end."""
    s = engine.scheduler
    return RankInfo(
        rank, s.max_model_len, s.kv.num_blocks, s.block_size, s.max_prompt_tokens,
        None, None, None,  # type: ignore[arg-type]
    )  # fmt: skip

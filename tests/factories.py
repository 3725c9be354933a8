"""Test factories: engines and requests that need no GPU and no trace file."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from sim.sim_executor import SimExecutor


def make_config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(block_size=4, num_gpu_blocks=10, max_num_seqs=8,
                                   max_num_batched_tokens=16)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def make_engine(config: EngineConfig | None = None, *, check: bool = True,
                acceptance_rate: float = 0.7, **overrides: object) -> EngineCore:
    cfg = config or make_config(**overrides)
    ex = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=acceptance_rate)
    return EngineCore(cfg, ex, clock=StepClock(), check_invariants=check)


class StepClock:
    """A clock that advances 1 ms per reading: deterministic timestamps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def make_request(req_id: str, prompt: Sequence[int] | int, max_tokens: int = 4,
                 **params: object) -> Request:
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
            raise AssertionError(f"not finished after {max_steps} steps:\n"
                                 f"{engine.scheduler.diagnose()}")
    return steps

"""The server's simulated twin (sim/twin.py): its wall-clock pacing is the simulator's
timing, and its tokens are ordinary vocabulary tokens."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import load_model_config
from sim.cost_model import UnitCostModel
from sim.simulator import build_requests, simulate
from sim.traces import Trace, TraceRequest
from sim.twin import VocabularySimExecutor, WallClockPacer


class _Clock:
    """A wall clock that moves only when the pacer sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_paced_steps_end_when_the_simulator_says(async_scheduling: bool) -> None:
    """The same requests, all at t=0: the twin's records (on a clock that passes only in
    its sleeps) are the simulator's, request by request."""
    trace = Trace(
        "t",
        "test",
        [TraceRequest(f"r{i}", 0.0, 40 + 30 * i, 3 + 2 * i) for i in range(8)],
    )
    engine = EngineConfig(
        num_gpu_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    cost = UnitCostModel(step_seconds=0.01, cpu_seconds=0.002)
    spec = load_model_config("deepseek-v2-lite")
    sim = simulate(trace, spec, "h200", engine, cost)

    clock = _Clock()
    executor = VocabularySimExecutor(engine, 64, spec.vocab_size, excluded={0, 1})
    core = EngineCore(engine, executor, clock=clock, model_max_len=spec.max_position_embeddings)
    pacer = WallClockPacer(cost, clock=clock, sleep=clock.sleep)
    for req in build_requests(trace, spec.vocab_size):
        core.add_request(req)
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished():
        for req in pacer.step(core):
            outputs[req.request_id] = list(req.output_token_ids)
    paced = {r.req_id: r for r in core.records}
    for want in sim.requests:
        got = paced[want.req_id]
        assert got.first_token == pytest.approx(want.first_token)
        assert got.finish == pytest.approx(want.finish)
        assert got.num_output_tokens == want.num_output_tokens
    tokens = [t for ids in outputs.values() for t in ids]
    assert tokens and all(0 < t < spec.vocab_size and t != 1 for t in tokens)


def test_a_seeded_request_repeats_its_tokens() -> None:
    """Whatever its id: a seed fixes the tokens (the server's ids are all different)."""
    from deepinfer.request import Request
    from deepinfer.sampling_params import SamplingParams

    engine = EngineConfig(num_gpu_blocks=16, block_size=16)

    def run(req_id: str, seed: int | None) -> list[int]:
        core = EngineCore(engine, VocabularySimExecutor(engine, 16, 100))
        req = Request(req_id, list(range(1, 20)), SamplingParams(max_tokens=6, seed=seed))
        core.add_request(req)
        while core.has_unfinished():
            core.step()
        return req.output_token_ids

    assert run("a", 3) == run("b", 3)
    assert run("a", None) != run("b", None)


def test_the_twin_runs_every_step_rather_than_fast_forward() -> None:
    """A decode run's tokens would come from SimExecutor's formula, outside the twin's
    vocabulary and its seed: the twin's executor offers none."""
    from deepinfer.request import Request
    from deepinfer.sampling_params import SamplingParams

    engine = EngineConfig(num_gpu_blocks=64, block_size=16, async_scheduling=False)
    core = EngineCore(engine, VocabularySimExecutor(engine, 64, 1000, excluded={0}))
    req = Request("a", list(range(1, 20)), SamplingParams(max_tokens=12, seed=3))
    core.add_request(req)
    core.step()
    assert core.executor.can_fast_forward is False and core.decode_run() is None
    while core.has_unfinished():
        core.step()
    assert all(0 < t < 1000 for t in req.output_token_ids)


@pytest.mark.parametrize("twin", [False, True])
def test_an_executor_forgets_a_request_once_a_step_names_it_finished(twin: bool) -> None:
    """A server's executor holds a salt per live request, not per request it served."""
    from deepinfer.request import Request
    from deepinfer.sampling_params import SamplingParams
    from sim.sim_executor import SimExecutor

    engine = EngineConfig(num_gpu_blocks=256, block_size=16)
    executor = VocabularySimExecutor(engine, 256, 100) if twin else SimExecutor(engine, 256)
    core = EngineCore(engine, executor)
    for batch in range(4):
        for i in range(20):
            seed = i if i % 2 else None
            core.add_request(
                Request(f"{batch}-{i}", [5] * 8, SamplingParams(max_tokens=2, seed=seed))
            )
        while core.has_unfinished():
            core.step()
        # the last batch's finish is named by the next step, when the next batch starts
        assert len(executor._salts) <= 20


def test_a_decode_run_drops_the_requests_its_first_step_would() -> None:
    from sim.sim_executor import SimExecutor

    executor = SimExecutor(EngineConfig(num_gpu_blocks=16, block_size=16), 16)
    executor.execute_decode_run(["a", "b"], [4, 4], [2, 2], frozenset())
    executor.execute_decode_run(["b"], [6], [2], frozenset({"a"}))
    assert set(executor._salts) == {"b"}

"""The fast-forward is exact: `simulate` with decode runs advanced at once gives, to the
bit, what single steps give (request records, step log, summary, the rest of the
report), over random traces, engines and cost models (docs/design.md, "Fast-forward").

The oracle is independent of the code under test: the same simulation with
`fast_forward=False`, every step through the scheduler's own rules, which the rest of
this suite checks. Both ways: the fast-forward must also do the work it may, so a
steady workload is mostly fast-forwarded, and the configurations it leaves to single
steps (speculation, data parallelism, structured outputs) are named and held to it.
"""

from __future__ import annotations

import warnings
from functools import cache

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.model_config import load_model_config
from deepinfer.outputs import SchedulerOutput
from sim.cost_model import CostModel, UnitCostModel
from sim.cost_model_registry import resolve_cost_model
from sim.hardware import get_hardware
from sim.profiled_cost_model import ProfiledCostModel
from sim.simulator import SimResult, simulate
from sim.traces import Trace, TraceRequest
from tests.property.strategies import scaled
from tests.sim.launch_profiles import with_launch_times

MODEL = "moonlight-16b-a3b"
PREFIX_BLOCK = 16  # tokens of one shared prefix block of the generated traces


@cache
def _profiled(async_scheduling: bool, max_num_seqs: int, max_num_batched_tokens: int) -> CostModel:
    """The shipped H200 profile's model for an engine of these settings (fitted once
    each: simulate would fit a model built for other settings again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost, _ = resolve_cost_model(
            "profiled", load_model_config(MODEL), get_hardware("h200"),
            async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )  # fmt: skip
    return cost


@cache
def _launched(async_scheduling: bool, max_num_seqs: int, max_num_batched_tokens: int) -> CostModel:
    """The same profile with each step's launch timed apart from its device work
    (`CostModel.launch_seconds`: the host's launch of a decode run's steps too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ProfiledCostModel(
            with_launch_times(f"{MODEL}__h200"), load_model_config(MODEL), get_hardware("h200"),
            async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )  # fmt: skip


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Bursts and gaps, shared prompt prefixes (prefix-cache hits and evictions), outputs
    long enough to cross blocks, priorities."""
    reqs = []
    t = 0.0
    for i in range(draw(st.integers(1, 20))):
        t += draw(st.sampled_from([0.0, 0.0, 0.0005, 0.003, 0.02, 0.1]))
        prompt = draw(st.integers(1, 160))
        shared = draw(st.lists(st.integers(0, 3), max_size=prompt // PREFIX_BLOCK))
        reqs.append(
            TraceRequest(
                f"r{i}", t, prompt, draw(st.integers(1, 90)), tuple(shared),
                PREFIX_BLOCK if shared else 0, priority=draw(st.integers(0, 2)),
            )
        )  # fmt: skip
    return Trace("generated", "python", reqs)


@st.composite
def engines(draw: st.DrawFn) -> EngineConfig:
    chunked = draw(st.booleans())
    caching = draw(st.booleans())
    # A host KV tier of a few to a few hundred blocks (Moonlight's are ~124 kB to ~500 kB):
    # decode runs evict into it, in the order single steps do.
    host_gib = draw(st.sampled_from([0.0, 0.0005, 0.002, 0.02])) if caching else 0.0
    return EngineConfig(
        block_size=draw(st.sampled_from([4, 8, 16])),
        num_gpu_blocks=draw(st.integers(30, 160)),
        max_num_seqs=draw(st.integers(1, 10)),
        max_num_batched_tokens=draw(st.sampled_from([6, 16, 64, 512])),
        max_model_len=draw(st.one_of(st.none(), st.integers(100, 400))) if chunked else None,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        kv_host_cache_gib=host_gib,
        prefill_watermark=draw(st.sampled_from([0.3, 0.8, 1.0])),
        async_scheduling=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        role=draw(st.sampled_from([EngineRole.NORMAL, EngineRole.NORMAL, EngineRole.DECODE])),
    )


def _cost(name: str, engine: EngineConfig) -> CostModel | str:
    if name in ("profiled", "launched"):
        build = _profiled if name == "profiled" else _launched
        return build(
            bool(engine.async_scheduling), engine.max_num_seqs, engine.max_num_batched_tokens
        )
    if name == "unit":
        return UnitCostModel(0.002, 0.0003)
    return name


def _both(trace: Trace, engine: EngineConfig, cost: str) -> tuple[SimResult, SimResult]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = simulate(trace, MODEL, "h200", engine, _cost(cost, engine), fast_forward=False)
        fast = simulate(trace, MODEL, "h200", engine, _cost(cost, engine))
    return single, fast


def _assert_same(single: SimResult, fast: SimResult) -> None:
    assert fast.requests == single.requests
    assert fast.steps == single.steps
    assert fast.summary == single.summary
    meta = {k: v for k, v in fast.meta.items() if k != "fast_forward"}
    assert meta == {k: v for k, v in single.meta.items() if k != "fast_forward"}


@scaled(0.3)
@given(traces(), engines(), st.sampled_from(["unit", "analytic", "profiled", "launched"]))
def test_fast_forward_gives_the_single_steps_results(
    trace: Trace, engine: EngineConfig, cost: str
) -> None:
    single, fast = _both(trace, engine, cost)
    _assert_same(single, fast)
    assert fast.meta["fast_forward"]["steps"] <= len(fast.steps)


def _steady() -> Trace:
    """Eight requests at once, long outputs of different lengths: after their prompts,
    the engine only decodes, and requests end one by one."""
    return Trace(
        "steady", "python",
        [TraceRequest(f"r{i}", 0.0, 40 + 7 * i, 150 + 20 * i) for i in range(8)],
    )  # fmt: skip


def test_a_steady_workload_is_mostly_fast_forwarded() -> None:
    for async_scheduling in (True, False):
        engine = EngineConfig(
            block_size=16, num_gpu_blocks=400, max_num_seqs=16, async_scheduling=async_scheduling
        )
        single, fast = _both(_steady(), engine, "profiled")
        _assert_same(single, fast)
        ff = fast.meta["fast_forward"]
        # 8 prompts, 8 finishes: a few single steps around each; the rest runs ahead.
        assert ff["steps"] >= 0.85 * len(fast.steps), ff
        assert single.meta["fast_forward"] == {"enabled": False}


def test_a_run_goes_on_past_each_finish_when_nothing_waits() -> None:
    """The steady workload's requests end one by one with nothing waiting: after the
    prompts, one run decodes to the last finish, its batch one smaller at each, under
    either scheduling; the results stay exact. In a cluster (a router reads each step's
    report) a run ends at each finish instead."""
    for async_scheduling in (True, False):
        engine = EngineConfig(
            block_size=16, num_gpu_blocks=400, max_num_seqs=16, async_scheduling=async_scheduling
        )
        single, fast = _both(_steady(), engine, "analytic")
        _assert_same(single, fast)
        assert fast.meta["fast_forward"]["runs"] <= 2, fast.meta["fast_forward"]


def test_a_run_stops_at_each_arrival_and_at_blocks_the_cache_lacks() -> None:
    """Arrivals every few steps and a cache that runs out: runs are short, preemptions
    happen between them, and the results stay exact."""
    trace = Trace(
        "tight", "python",
        [TraceRequest(f"r{i}", 0.004 * i, 30, 120) for i in range(12)],
    )  # fmt: skip
    engine = EngineConfig(block_size=8, num_gpu_blocks=60, max_num_seqs=8)
    single, fast = _both(trace, engine, "unit")
    _assert_same(single, fast)
    assert sum(r.num_preemptions for r in single.requests) > 0  # the state it was written for
    assert 0 < fast.meta["fast_forward"]["steps"] < len(fast.steps)


def test_a_host_tier_fills_in_a_run_as_in_single_steps() -> None:
    """Requests sharing prefixes in a cache that runs out: decode runs evict into the host
    tier, later prompts load from it, and the results stay exact."""
    trace = Trace(
        "tiers", "python",
        [TraceRequest(f"r{i}", 0.004 * i, 48, 120, (i % 3, 10 + i % 3, 20 + i), 16)
         for i in range(12)],
    )  # fmt: skip
    engine = EngineConfig(block_size=8, num_gpu_blocks=60, max_num_seqs=8, kv_host_cache_gib=0.01)
    single, fast = _both(trace, engine, "unit")
    _assert_same(single, fast)
    tiers = fast.meta["kv_tiers"]
    assert tiers["hit_blocks"]["host"] > 0 and tiers["bytes_saved"]["host"] > 0
    assert 0 < fast.meta["fast_forward"]["steps"] < len(fast.steps)


def test_speculation_runs_single_steps() -> None:
    """Drafts' acceptance is drawn per step: no run is certain, so none is taken."""
    spec = load_model_config(MODEL).replace(num_nextn_predict_layers=1)
    engine = EngineConfig(block_size=16, num_gpu_blocks=400, num_speculative_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = simulate(_steady(), spec, "h200", engine, "analytic")
    assert fast.meta["fast_forward"] == {"enabled": True, "runs": 0, "steps": 0}


def test_a_cost_model_that_overrides_its_parents_hooks_gets_single_steps() -> None:
    """A user's model derived from the unit one, pricing context: the parent's run
    pricing is not its own, so every step goes through its hooks, and the results are
    those of single steps."""

    class ContextCost(UnitCostModel):
        def step_time(self, out: SchedulerOutput) -> float:
            return 0.001 + 1e-6 * sum(r.num_computed_tokens for r in out.scheduled)

    engine = EngineConfig(block_size=16, num_gpu_blocks=400, async_scheduling=False)
    single = simulate(_steady(), MODEL, "h200", engine, ContextCost(), fast_forward=False)
    fast = simulate(_steady(), MODEL, "h200", engine, ContextCost())
    _assert_same(single, fast)
    assert fast.meta["fast_forward"]["steps"] == 0
    assert "ContextCost" in fast.meta["fast_forward"]["single_steps_only"]


def test_data_parallel_ranks_run_single_steps_and_say_so() -> None:
    engine = EngineConfig(block_size=16, num_gpu_blocks=400, data_parallel_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = simulate(_steady(), MODEL, "h200", engine, "unit")
    assert fast.meta["fast_forward"]["steps"] == 0
    assert "lock-step" in fast.meta["fast_forward"]["single_steps_only"]

"""simulate(): the shared engine in simulated time, end to end."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import PRESETS_DIR
from deepinfer.outputs import SchedulerOutput
from executors.demo import DEMO_MODEL_DIR
from sim import load_trace, simulate
from sim.cost_model import UnitCostModel
from sim.hardware import HardwareSpec, get_hardware
from sim.profiled_cost_model import PROFILES_DIR
from sim.sim_executor import SimExecutor
from sim.simulator import build_requests
from sim.traces import Trace, TraceRequest
from tests.factories import StepClock, make_config, make_request, run_to_completion
from tests.property.strategies import sim_token

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_bundled_trace_runs_with_the_analytic_cost_model() -> None:
    trace = load_trace(TRACES / "azure_code_small.json", max_requests=60)
    result = simulate(trace, engine=EngineConfig(num_gpu_blocks=400), check_invariants=True)
    assert len(result.requests) == 60
    assert all(r.status == "finished" for r in result.requests)
    for rec, tr in zip(result.requests, trace.requests):
        assert rec.num_output_tokens == tr.output_len
        assert rec.arrival == tr.arrival
        assert rec.first_token is not None and rec.first_token > rec.arrival
    assert result.summary["num_completed"] == 60
    assert result.summary["ttft_ms_mean"] > 0


def test_shared_prefix_blocks_produce_prefix_cache_hits() -> None:
    trace = load_trace(TRACES / "mooncake_conversation_small.jsonl", max_requests=80)
    cfg = EngineConfig(num_gpu_blocks=3000, max_model_len=32768)
    on = simulate(trace, "deepseek-v2-lite", engine=cfg, cost_model="unit")
    off = simulate(
        trace,
        "deepseek-v2-lite",
        engine=cfg.replace(enable_prefix_caching=False),
        cost_model="unit",
    )
    assert on.summary["prefix_cache_hit_rate"] > 0.02
    assert off.summary["prefix_cache_hit_rate"] == 0.0
    assert on.summary["total_input_tokens"] == off.summary["total_input_tokens"]


def test_an_unfittable_request_is_rejected_and_counted() -> None:
    reqs = [TraceRequest("ok", 0.0, 100, 5), TraceRequest("huge", 0.0, 10_000, 5)]
    result = simulate(
        reqs, engine=EngineConfig(num_gpu_blocks=20, block_size=16), cost_model="unit"
    )
    by_id = {r.req_id: r for r in result.requests}
    assert by_id["ok"].status == "finished"
    assert by_id["huge"].status == "rejected" and "20 blocks" in by_id["huge"].reason
    assert result.summary["num_rejected"] == 1


def test_a_run_whose_last_arrivals_are_all_rejected_ends() -> None:
    """Regression: once the last pending request was rejected with nothing running, the
    simpy process waited for the next arrival of an empty queue (IndexError)."""
    reqs = [TraceRequest("ok", 0.0, 100, 5), TraceRequest("huge", 1.0, 10_000, 5)]
    result = simulate(
        reqs, engine=EngineConfig(num_gpu_blocks=20, block_size=16), cost_model="unit"
    )
    assert [r.status for r in result.requests] == ["finished", "rejected"]
    only = simulate(reqs[1:], engine=EngineConfig(num_gpu_blocks=20, block_size=16))
    assert only.summary["num_rejected"] == 1 and only.summary["num_completed"] == 0


def test_unit_cost_model_prices_every_step_the_same() -> None:
    reqs = [TraceRequest(f"r{i}", 0.0, 10, 3) for i in range(3)]
    result = simulate(
        reqs,
        engine=EngineConfig(num_gpu_blocks=50, block_size=4, async_scheduling=False),
        cost_model=UnitCostModel(0.001),
    )
    assert result.summary["duration_s"] == pytest.approx(0.001 * len(result.steps))


def mtp_model(tmp_path: Path) -> str:
    """Moonlight's shapes with one MTP layer and a 32k context (speculation needs MTP)."""
    raw = json.loads((PRESETS_DIR / "moonlight-16b-a3b.json").read_text())
    raw.update(num_nextn_predict_layers=1, max_position_embeddings=32768)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_same_trace_same_results_twice(tmp_path: Path) -> None:
    trace = load_trace(TRACES / "mooncake_conversation_small.jsonl", max_requests=40)
    cfg = EngineConfig(num_gpu_blocks=600, max_model_len=32768, num_speculative_tokens=2)
    model = mtp_model(tmp_path)
    a = simulate(trace, model, engine=cfg)
    b = simulate(trace, model, engine=cfg)
    assert [r.to_dict() for r in a.requests] == [r.to_dict() for r in b.requests]


def test_async_scheduling_overlaps_cpu_time() -> None:
    trace = load_trace(TRACES / "azure_code_small.json", max_requests=30)
    sync = simulate(trace, engine=EngineConfig(num_gpu_blocks=400, async_scheduling=False))
    overlap = simulate(trace, engine=EngineConfig(num_gpu_blocks=400, async_scheduling=True))
    assert overlap.summary["tpot_ms_mean"] < sync.summary["tpot_ms_mean"]
    assert all(r.status == "finished" for r in overlap.requests)


def test_async_scheduling_overlaps_nothing_where_the_device_is_the_host() -> None:
    """On a CPU the launch runs the step before it returns, so the host's scheduling and
    output processing follow it, async or not (measured: the demo model's async steps on
    this machine's CPU took as long as its synchronous ones)."""
    trace = [TraceRequest(f"r{i}", 0.0, 48 + 8 * i, 24) for i in range(12)]
    engine = EngineConfig(block_size=16, num_gpu_blocks=512, max_num_seqs=64,
                          max_num_batched_tokens=1024)  # fmt: skip
    cpu = get_hardware("cpu")
    assert cpu.runs_on_host

    def makespan(hw: HardwareSpec, overlap: bool) -> float:
        cfg = engine.replace(async_scheduling=overlap)
        result = simulate(trace, str(DEMO_MODEL_DIR), hw, cfg)
        assert all(r.status == "finished" for r in result.requests)
        return max(r.finish for r in result.requests)

    assert makespan(cpu, True) >= 0.99 * makespan(cpu, False)


@pytest.mark.parametrize("on_host", [True, False])
def test_the_loop_overlaps_host_and_step_only_on_a_separate_device(on_host: bool) -> None:
    """The loop itself, with host time equal to step time: on a separate device async
    scheduling hides the host's half, on the host's CPU it hides nothing."""
    trace = [TraceRequest(f"r{i}", 0.0, 32, 16) for i in range(8)]
    hw = replace(get_hardware("h200"), runs_on_host=on_host)
    cost = UnitCostModel(step_seconds=0.002, cpu_seconds=0.002)

    def makespan(overlap: bool) -> float:
        cfg = EngineConfig(num_gpu_blocks=64, async_scheduling=overlap)
        result = simulate(trace, hardware=hw, engine=cfg, cost_model=cost)
        return max(r.finish for r in result.requests)

    ratio = makespan(True) / makespan(False)
    assert ratio >= 0.99 if on_host else ratio < 0.7


def test_sim_executor_token_depends_only_on_request_and_position_under_speculation() -> None:
    """Tokens are documented as a function of (request, position): speculation must not
    change them (all drafts accepted here, so every step verifies 2)."""
    cfg = make_config(num_speculative_tokens=2, num_gpu_blocks=40)
    engine = EngineCore(
        cfg, SimExecutor(cfg, acceptance_rate=1.0), clock=StepClock(), check_invariants=True
    )
    r = make_request("s", 6, max_tokens=10)
    engine.add_request(r)
    run_to_completion(engine)
    assert r.output_token_ids == [sim_token("s", 6 + i) for i in range(10)]


def test_simulated_async_scheduling_keeps_speculating() -> None:
    """With async scheduling drafts are still verified (placeholders the executor fills),
    and tokens stay the SimExecutor tokens of their positions."""
    cfg = make_config(num_speculative_tokens=2, num_gpu_blocks=40, async_scheduling=True)
    ex = SimExecutor(cfg, acceptance_rate=0.7)
    engine = EngineCore(cfg, ex, clock=StepClock(), check_invariants=True)
    r = make_request("s", 6, max_tokens=30)
    engine.add_request(r)
    run_to_completion(engine)
    assert ex.num_draft_tokens > 20 and 0 < ex.num_accepted_tokens < ex.num_draft_tokens
    assert r.output_token_ids == [sim_token("s", 6 + i) for i in range(30)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_simulator_runs_the_engines_own_loop(async_scheduling: bool) -> None:
    """One engine loop: simulate() and EngineCore.step() over the same requests and
    executor make the very same steps; only the clock differs."""
    reqs = [TraceRequest(f"r{i}", 0.0, 7 + 5 * i, 3 + i) for i in range(6)]
    cfg = EngineConfig(
        num_gpu_blocks=30,
        block_size=4,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    simulated = simulate(reqs, engine=cfg, cost_model=UnitCostModel(0.001, 0.0002))
    engine = EngineCore(cfg, SimExecutor(cfg), clock=StepClock())
    for req in build_requests(Trace("t", "test", reqs), vocab_size=32000):
        engine.add_request(req)
    run_to_completion(engine)
    shape = [
        (s.num_batched_tokens, s.num_scheduled_reqs, s.num_prompt_tokens) for s in simulated.steps
    ]
    assert shape == [
        (s.num_batched_tokens, s.num_scheduled_reqs, s.num_prompt_tokens) for s in engine.steps
    ]
    # A step's recorded time runs from its launch, after the host scheduled it (as the
    # real engine's clock starts it), to its result: the device's time, sync or async
    durations = [s.duration for s in simulated.steps]
    assert durations == pytest.approx([0.001] * len(durations))
    n = len(simulated.steps)
    end = simulated.steps[-1].time
    if async_scheduling:  # host time of step N+1 hides under step N's device time
        assert end == pytest.approx(0.0002 + 0.001 * n)
    else:
        assert end == pytest.approx(0.0012 * n)


class CountingCostModel(UnitCostModel):
    """The unit model, counting which steps each hook priced."""

    def __init__(self) -> None:
        super().__init__(0.001, 0.0002)
        self.priced: list[int] = []  # step ids, one per step_time or launch_cost call
        self.hosted: list[int] = []  # step ids, one per cpu_time call

    def step_time(self, out: SchedulerOutput) -> float:
        self.priced.append(out.step_id)
        return super().step_time(out)

    def launch_cost(self, out: SchedulerOutput) -> tuple[float, float]:
        self.priced.append(out.step_id)
        return super().step_time(out), 0.0

    def cpu_time(self, out: SchedulerOutput) -> float:
        self.hosted.append(out.step_id)
        return super().cpu_time(out)


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_step_is_priced_once(async_scheduling: bool, on_host: bool) -> None:
    """The simulator asks the cost model for a step's device time once, at its launch
    (`launch_cost` carries the idle-launch extra with it), and for its host time once,
    after its schedule: in steps a few arrivals apart, with idle gaps between. (A subclass
    that overrides the hooks gets single steps: its parent's run pricing is not its own.)"""
    reqs = [TraceRequest(f"r{i}", 0.05 * (i // 3), 7 + 5 * i, 3 + i) for i in range(9)]
    cfg = EngineConfig(
        num_gpu_blocks=30, block_size=4, max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    cost = CountingCostModel()
    hw = replace(get_hardware("h200"), runs_on_host=on_host)
    result = simulate(reqs, hardware=hw, engine=cfg, cost_model=cost)
    steps = [s.step_id for s in result.steps]
    assert len(steps) > 9 and result.summary["num_completed"] == 9
    assert cost.priced == steps and cost.hosted == steps


def test_speculation_without_mtp_layers_and_a_context_past_the_models_are_refused() -> None:
    reqs = [TraceRequest("a", 0.0, 10, 2)]
    with pytest.raises(ValueError, match="moonlight-16b-a3b has none"):
        simulate(reqs, engine=EngineConfig(num_gpu_blocks=100, num_speculative_tokens=2))
    with pytest.raises(ValueError, match="max_model_len=32768 exceeds"):
        simulate(reqs, engine=EngineConfig(num_gpu_blocks=1000, max_model_len=32768))


def test_the_engines_budgets_size_the_activation_reserve_and_fcfs_refuses_priorities() -> None:
    """Two options the simulator accepted and ignored (an audit): the KV cache it sizes
    from the GPU's memory kept the default budgets' activation reserve whatever
    max_num_batched_tokens and max_num_seqs said (the torch executor measures its reserve
    with a forward over the whole budget), and a trace's priorities under fcfs were
    dropped silently (LLM refuses them; a trace may be replayed under both policies, so
    the simulator warns)."""

    reqs = [TraceRequest("a", 0.0, 64, 4)]
    blocks = {
        budget: simulate(
            reqs, "moonlight-16b-a3b", "h200",
            EngineConfig(max_num_batched_tokens=budget[0], max_num_seqs=budget[1]),
        ).meta["num_gpu_blocks"]
        for budget in ((512, 4), (8192, 256), (65536, 1024))
    }  # fmt: skip
    assert blocks[(512, 4)] > blocks[(8192, 256)] > blocks[(65536, 1024)]
    ranked = [TraceRequest("a", 0.0, 64, 4), TraceRequest("b", 0.0, 64, 4, priority=5)]
    with pytest.warns(UserWarning, match="1 request.s. carry a priority, which the engine"):
        simulate(ranked, "moonlight-16b-a3b", "h200")
    done = simulate(ranked, "moonlight-16b-a3b", "h200", EngineConfig(policy="priority"))
    assert done.summary["num_completed"] == 2


def test_a_profile_measured_at_another_block_size_is_named() -> None:
    """The profile's step times were measured with its own block size; a simulation at
    another one is priced from them, and says so (an audit found it silent)."""
    reqs = [TraceRequest("a", 0.0, 64, 4)]
    with pytest.warns(UserWarning, match="block_size=16: profile .*moonlight-16b-a3b__h200.json"):
        simulate(reqs, "moonlight-16b-a3b", "h200", EngineConfig(block_size=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate(reqs, "moonlight-16b-a3b", "h200", EngineConfig(block_size=64))


def test_a_profile_measured_with_other_kernels_is_named(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A profile records the kernels its steps ran; the simulator warns when the engine it
    predicts would run others (DEEPINFER_KERNEL_BACKEND)."""
    doc = json.loads((PROFILES_DIR / "moonlight-16b-a3b__h200.json").read_text())
    doc["meta"]["kernel_backend"] = "torch"
    path = tmp_path / "torch_kernels.json"
    path.write_text(json.dumps(doc))
    reqs = [TraceRequest("a", 0.0, 64, 4)]
    monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND", raising=False)
    with pytest.warns(UserWarning, match="measured with the torch kernels.*runs the triton"):
        simulate(reqs, "moonlight-16b-a3b", "h200", EngineConfig(), profile=path)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate(reqs, "moonlight-16b-a3b", "h200", EngineConfig(), profile=path)

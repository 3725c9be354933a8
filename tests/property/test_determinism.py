"""Determinism: one seed and workload, one result."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hypothesis import given

from deepinfer.engine import EngineCore
from deepinfer.errors import SchedulerStalled
from deepinfer.request import Request
from sim.sim_executor import SimExecutor
from tests.factories import StepClock
from tests.property.harness import CORE_CHECKS, run_case, step_bound, submit_due
from tests.property.sim_text import TextStops
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


def _run_with_step(case: EngineCase, workload: Workload) -> dict[str, Any]:
    """The workload through EngineCore.step() (the real loop, async included)."""
    cfg = case.config
    ex = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)
    engine = EngineCore(cfg, ex, clock=StepClock(), check_invariants=CORE_CHECKS)
    arrivals = sorted(workload, key=lambda s: s.arrival_step)
    aborts = sorted((s for s in workload if s.abort_step is not None), key=lambda s: s.abort_step)  # type: ignore[arg-type,return-value]
    reqs: dict[str, Request] = {}
    clock = steps = 0
    stalled = None
    stops = TextStops()  # stop strings end requests as LLM._run does, as in run_case
    while True:
        submit_due(engine, arrivals, aborts, clock, reqs)
        for req in reqs.values():
            stops.track(req)
        if not engine.has_unfinished():
            if not arrivals:
                break
            clock = arrivals[0].arrival_step
            continue
        try:
            stops.after_update(engine, engine.step())
        except SchedulerStalled:  # a liveness bug (test_liveness); it must repeat too
            stalled = engine.scheduler.step_id
            break
        clock, steps = clock + 1, steps + 1
        assert steps <= step_bound(case, workload), "did not finish"
    return {
        "records": [r.to_dict() for r in engine.records],
        "outputs": {rid: r.output_token_ids for rid, r in reqs.items()},
        "steps": [asdict(s) for s in engine.steps],
        "stalled": stalled,
        "drafts": (ex.num_draft_tokens, ex.num_accepted_tokens),
    }


def _results(records: list[dict[str, Any]], outputs: dict[str, list[int]]) -> dict[str, tuple]:
    """Per-request results without timestamps (the two drivers read the clock differently)."""
    return {
        r["req_id"]: (
            r["status"],
            r["finish_reason"],
            r["num_output_tokens"],
            r["num_preemptions"],
            r["num_cached_tokens"],
            outputs[r["req_id"]],
        )
        for r in records
    }


@scaled(1.0)
@given(any_case_and_workload())
def test_the_same_seed_and_workload_give_identical_results_twice(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Two runs of one engine configuration (seed included) over one workload give
    identical request records (timestamps included), output tokens, step records and
    draft acceptance; and driving schedule()/process() by hand gives the same
    per-request results as EngineCore.step() (without varlen, whose lengths follow the
    clock)."""
    case, workload = cw
    first, second = _run_with_step(case, workload), _run_with_step(case, workload)
    assert first == second
    # Varlen prices its draft lengths by the steps' measured durations, and the two
    # drivers' clocks time steps differently: their draft lengths, so their batches and
    # preemptions, may differ. Outputs are lossless either way; the loops compare alike
    # without varlen.
    if first["stalled"] is None and not case.config.enable_mtp_varlen:
        d = run_case(case, workload)
        by_hand = {rid: r.output_token_ids for rid, r in d.reqs.items()}
        assert _results([r.to_dict() for r in d.engine.records], by_hand) == _results(
            first["records"], first["outputs"]
        )

"""Generated workloads through the data-parallel front-end (docs/design.md, "Data
parallelism"): the combined generator's engines (speculation fixed and varlen, async
scheduling, priorities, prefix caching, small caches, every stop condition, stop
strings included) as 2-3 in-process ranks behind `DataParallelEngine`, stepped as
`LLM._run` steps it, ending stop strings through the output processor as it does.

The oracle is the spec alone (oracle.expected_end with text, SimExecutor's token rule):
whichever rank a request lands on, an admissible request that nobody aborts ends
finished with exactly the tokens and the reason its first stop condition gives, and an
inadmissible one is rejected.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.config import EngineRole
from deepinfer.data_parallel.front_end import DataParallelEngine
from deepinfer.engine import EngineCore
from deepinfer.request import FinishReason, Request, RequestStatus
from sim.sim_executor import SimExecutor
from tests.factories import StepClock, rank_info
from tests.property.harness import CORE_CHECKS, note
from tests.property.oracle import admissible, expected_end, make_request, step_bound
from tests.property.sim_text import TextStops
from tests.property.strategies import (
    EngineCase,
    Workload,
    any_case_and_workload,
    scaled,
    sim_token,
)
from tests.property.test_balancer_model import ObservedRank


def _run(case: EngineCase, workload: Workload, num_ranks: int) -> dict[str, Request]:
    cfg = case.config
    ranks = []
    for r in range(num_ranks):
        ex = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)
        engine = EngineCore(cfg, ex, clock=StepClock(), check_invariants=CORE_CHECKS)
        ranks.append(ObservedRank(r, engine))
    dp = DataParallelEngine(ranks, [rank_info(r.rank, r.engine) for r in ranks])
    arrivals = sorted(workload, key=lambda s: s.arrival_step)
    aborts = sorted((s for s in workload if s.abort_step is not None), key=lambda s: s.abort_step)  # type: ignore[arg-type,return-value]
    reqs: dict[str, Request] = {}
    stops = TextStops()
    placed: set[int] = set()  # the ranks requests went to
    clock = steps = 0
    bound = step_bound(case, workload) + 2
    while True:
        while arrivals and arrivals[0].arrival_step <= clock:
            spec = arrivals.pop(0)
            reqs[spec.req_id] = make_request(spec)
            stops.track(reqs[spec.req_id])
            dp.add_request(reqs[spec.req_id])
            placed.add(dp.rank_of[spec.req_id])
        while aborts and aborts[0].abort_step <= clock:  # type: ignore[operator]
            dp.finish(aborts.pop(0).req_id, FinishReason.ABORT)
        if not dp.has_unfinished():
            if not arrivals:
                break
            clock = arrivals[0].arrival_step
            continue
        finished, restated = stops.after_update(dp, dp.step())
        if finished or restated:
            note("a stop string ended a request on a rank")
        clock, steps = clock + 1, steps + 1
        assert steps <= bound, f"unfinished after {steps} rounds (bound {bound})"
    if len(placed) > 1:
        note("requests on several ranks")
    return reqs


@scaled(0.6)
@given(any_case_and_workload(roles=(EngineRole.NORMAL,)), st.integers(2, 3))
def test_every_request_ends_as_its_stop_conditions_say_on_whichever_rank(
    cw: tuple[EngineCase, Workload], num_ranks: int
) -> None:
    """Over 2-3 ranks, each request not aborted ends once: rejected when no rank can
    ever serve it, else finished with the outputs SimExecutor makes for its positions,
    as many as its first stop condition (stop strings included) allows, for that
    condition's reason."""
    case, workload = cw
    reqs = _run(case, workload, num_ranks)
    for spec in workload:
        req = reqs[spec.req_id]
        if spec.abort_step is not None and req.status is RequestStatus.ABORTED:
            continue
        if not admissible(case, spec):
            assert req.status is RequestStatus.REJECTED, f"{spec} can never be served: {req!r}"
            continue
        want, reason = expected_end(case, spec, text=True)
        n = len(spec.prompt)
        tokens = [sim_token(spec.req_id, n + i) for i in range(want)]
        got = req.finish_reason.value if req.finish_reason is not None else None
        assert (req.status, req.output_token_ids, got) == (
            RequestStatus.FINISHED,
            tokens,
            reason,
        ), (
            f"{spec} ended {req.status.value} with {req.num_output_tokens} tokens ({got}); want {want} ({reason})"
        )

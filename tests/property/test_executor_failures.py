"""Executor failures: whatever step fails, and however, every request ends exactly once.

The workload runs through the real loop (`EngineCore.step()`) over a SimExecutor that
fails chosen calls, at launch (`execute_async` raises) or when the result is awaited
(`handle.result()` raises, also with the next step already scheduled under async
scheduling), either naming some of the step's requests (`RequestFailed`) or naming
nobody (any other exception). The rules (DESIGN.md, fault isolation):

- a named request that is still live ends ABORTED with its reason; with an anonymous
  error every live request of the failed step does, with "<type>: <message>";
- the step's other requests are requeued, and every request that no failure and no
  client aborted ends as its stop conditions say (`expected_end`), as if nothing failed;
- every submitted request reaches exactly one terminal state and writes exactly one
  record, which agrees with it (status, reason, finish time); the step() call of the
  failure returns the requests it aborted; idle, the engine holds no block;
- each failure is logged once, naming the failed step: a warning with the requests'
  reasons, or an error with the traceback and the number of requests it aborts.

Broken copies that fail it: `EngineCore._fail` leaving `_in_flight` set (the next step
unpacks it), aborting the requests of the step scheduled after the failed one
(`outs[1].scheduled`), stamping no finish time, writing no record, or logging without
the traceback (`exc_info` dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.engine import EngineCore
from deepinfer.errors import RequestFailed
from deepinfer.executor import StepHandle
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason, Request, RequestStatus
from sim.sim_executor import SimExecutor
from tests.factories import StepClock
from tests.property.harness import (
    CORE_CHECKS,
    admissible,
    expected_end,
    note,
    step_bound,
    submit_due,
)
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled

S = RequestStatus
MAX_FAULTY_CALLS = 40  # calls of the executor that may fail (later ones never do)


@dataclass
class Fault:
    """One failure the executor raised: the step, the error, and the requests it must
    abort (those it names, or all the step's, that were live when it was raised)."""

    out: SchedulerOutput
    exc: Exception
    victims: dict[str, str]  # req_id -> reason


class _Raises:
    """A handle whose result is the failure (recorded when it is raised)."""

    def __init__(self, raise_: Callable[[], NoReturn]) -> None:
        self.raise_ = raise_

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.raise_()


class FailingExecutor:
    """A SimExecutor whose calls fail where hypothesis picks: not at all, at launch or at
    result, naming a nonempty subset of the step's requests or nobody."""

    needs_token_ids = False

    def __init__(self, case: EngineCase, data: st.DataObject) -> None:
        cfg = case.config
        self.sim = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)
        self.data = data
        self.engine: EngineCore | None = None
        self.calls = 0
        self.faults: list[Fault] = []

    def num_kv_blocks(self) -> int:
        return self.sim.num_kv_blocks()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(out).result()

    def shutdown(self) -> None:
        self.sim.shutdown()

    def victims(self) -> dict[str, str]:
        return {rid: why for f in self.faults for rid, why in f.victims.items()}

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        self.calls += 1
        where = "none"
        if self.calls <= MAX_FAULTY_CALLS:
            where = self.data.draw(st.sampled_from(["none"] * 4 + ["launch", "result"]))
        if where == "none":
            return self.sim.execute_async(out)
        ids = sorted({sr.req_id for sr in out.scheduled})
        if self.data.draw(st.booleans(), label="names requests"):
            named = self.data.draw(st.sets(st.sampled_from(ids), min_size=1), label="named")
            reasons = {rid: f"{rid}: bad token in step" for rid in named}
            exc: Exception = RequestFailed(reasons)
        else:
            exc = IndexError(f"index out of range in step {out.step_id}")
            reasons = {rid: f"{type(exc).__name__}: {exc}" for rid in ids}

        def raise_() -> NoReturn:
            # _fail runs as soon as this raises: the requests live now are those it aborts.
            assert self.engine is not None
            live = self.engine.scheduler.requests
            victims = {r: why for r, why in reasons.items() if r in live}
            self.faults.append(Fault(out, exc, victims))
            raise exc

        note(f"a step failed at {where}, {type(exc).__name__}")
        if where == "launch":
            raise_()
        return _Raises(raise_)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _interrupt(engine: EngineCore) -> set[str]:
    """Ctrl-C between two steps, cleaned up as LLM.generate does: abort every live
    request, forget the step in flight. The engine is then idle and holds no block."""
    note("interrupted" + (" with a step in flight" if engine._in_flight is not None else ""))
    live = set(engine.scheduler.requests)
    for rid in live:
        engine.abort(rid)
    engine.discard_in_flight()
    assert not engine.has_unfinished(), "interrupted and cleaned up, yet not idle"
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "interrupted: blocks still held"
    return live


def _run(
    case: EngineCase, workload: Workload, ex: FailingExecutor, interrupt_at: int | None
) -> tuple[EngineCore, dict]:
    """The workload through EngineCore.step(), interrupted before step `interrupt_at`;
    the requests each step() returned are checked to include those its failures aborted."""
    engine = EngineCore(case.config, ex, clock=StepClock(), check_invariants=CORE_CHECKS)
    ex.engine = engine
    arrivals = sorted(workload, key=lambda s: s.arrival_step)
    aborts = sorted((s for s in workload if s.abort_step is not None), key=lambda s: s.abort_step)  # type: ignore[arg-type,return-value]
    reqs: dict[str, Request] = {}
    client_aborted: set[str] = set()
    clock = steps = 0
    # Each failure may undo at most every request's progress: a whole run's work again.
    bound = (MAX_FAULTY_CALLS + 1) * step_bound(case, workload)
    while True:
        client_aborted |= submit_due(engine, arrivals, aborts, clock, reqs)
        if steps == interrupt_at and engine.has_unfinished():
            client_aborted |= _interrupt(engine)
            interrupt_at = None
        if not engine.has_unfinished():
            if not arrivals:
                break
            clock = arrivals[0].arrival_step
            continue
        before = len(ex.faults)
        changed = {r.request_id for r in engine.step()}
        for f in ex.faults[before:]:
            missing = set(f.victims) - changed
            assert not missing, f"step {f.out.step_id} failed ({f.exc!r}); step() omits {missing}"
        clock, steps = clock + 1, steps + 1
        assert steps <= bound, f"unfinished after {steps} steps\n{engine.scheduler.diagnose()}"
    return engine, {"reqs": reqs, "client_aborted": client_aborted}


@scaled(0.3)
@given(any_case_and_workload(), st.data())
def test_every_request_ends_exactly_once_whichever_steps_fail(
    cw: tuple[EngineCase, Workload], data: st.DataObject
) -> None:
    """The rules of the module docstring, over any engine and workload, with failures
    at up to MAX_FAULTY_CALLS executor calls and at most one interrupt."""
    case, workload = cw
    ex = FailingExecutor(case, data)
    logger, log = logging.getLogger("deepinfer.engine"), _Collect()
    logger.addHandler(log)
    try:
        interrupt_at = data.draw(st.none() | st.integers(0, 6), label="interrupt before step")
        engine, run = _run(case, workload, ex, interrupt_at)
    finally:
        logger.removeHandler(log)

    _check_ends(case, workload, engine, run, ex.victims())
    assert sum(len(f.victims) for f in ex.faults) == len(ex.victims()), "aborted twice"
    _check_log(log.records, ex.faults)


def _check_ends(
    case: EngineCase, workload: Workload, engine: EngineCore, run: dict, victims: dict[str, str]
) -> None:
    reqs: dict[str, Request] = run["reqs"]
    for spec in workload:
        rid, req = spec.req_id, reqs[spec.req_id]
        recs = [r for r in engine.records if r.req_id == rid]
        assert len(recs) == 1, f"{rid} ended {req.status.value} with {len(recs)} records"
        rec = recs[0]
        assert req.is_finished, f"{rid} never ended: {req.status.value}"
        # (a request rejected on arrival never started: it has no finish time)
        assert req.status is S.REJECTED or req.times.finish is not None, f"{rid}: no finish"
        assert (rec.status, rec.reason, rec.finish) == (
            req.status.value,
            req.reject_reason,
            req.times.finish,
        ), f"{rid}'s record disagrees with it: {rec}"
        if rid in victims:
            assert (req.status, req.finish_reason, req.reject_reason) == (
                S.ABORTED,
                FinishReason.ABORT,
                victims[rid],
            ), f"{rid} failed ({victims[rid]!r}) yet ended {req.status.value}: {req.reject_reason}"
        elif not admissible(case, spec):
            assert req.status is S.REJECTED, f"{spec} can never be served: {req.status}"
        elif rid in run["client_aborted"]:
            assert req.status is S.ABORTED
        else:
            want, reason = expected_end(case, spec)
            got = req.finish_reason.value if req.finish_reason is not None else None
            assert (req.status, req.num_output_tokens, got) == (S.FINISHED, want, reason), (
                f"{spec}, not failed, ended {req.status.value} with {req.num_output_tokens} "
                f"tokens ({got}); want finished with {want} ({reason})"
            )
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "idle, yet blocks are held"


def _check_log(entries: list[logging.LogRecord], faults: list[Fault]) -> None:
    """One entry a failure: a warning with the named requests' reasons, or an error with
    the traceback and how many requests the failed step had."""
    assert len(entries) == len(faults), [e.getMessage() for e in entries]
    for f, entry in zip(faults, entries):
        want: tuple[int, str, Exception | None]
        if isinstance(f.exc, RequestFailed):
            want = (logging.WARNING, f"step {f.out.step_id}: {f.exc}", None)
        else:
            n = len({sr.req_id for sr in f.out.scheduled})
            msg = f"step {f.out.step_id} failed; aborting its {n} requests"
            want = (logging.ERROR, msg, f.exc)
        exc = entry.exc_info[1] if entry.exc_info else None
        assert (entry.levelno, entry.getMessage(), exc) == want

"""Executor failures: whatever step fails, and however, every request ends exactly once.

The workload runs through the real loop (`EngineCore.step()`) over a SimExecutor that
fails chosen calls, at launch (`execute_async` raises) or when the result is awaited
(`handle.result()` raises, also with the next step already scheduled under async
scheduling), either naming some of the step's requests (`RequestFailed`) or naming
nobody (any other exception). The rules (docs/design.md, "Executor failures"):

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

from hypothesis import example, given
from hypothesis import strategies as st

from deepinfer.engine import EngineCore
from deepinfer.errors import RequestFailed
from deepinfer.executor import Executor, StepHandle
from deepinfer.kv_cache.manager import cdiv
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler_checks import diagnose_stall
from sim.sim_executor import SimExecutor
from tests.factories import StepClock, make_config, make_engine
from tests.property.harness import (
    CORE_CHECKS,
    admissible,
    expected_end,
    note,
    step_bound,
    submit_due,
)
from tests.property.oracle import make_request
from tests.property.strategies import (
    EngineCase,
    ReqSpec,
    Workload,
    any_case_and_workload,
    scaled,
)

S = RequestStatus
MAX_FAULTY_CALLS = 40  # calls of the executor that may fail (later ones never do)


@dataclass
class Fault:
    """One failure the executor raised: the step, the error, and the requests it must
    abort (those it names, or all the step's, that were live when it was raised)."""

    out: SchedulerOutput
    exc: Exception
    victims: dict[str, str]  # req_id -> reason
    at_launch: bool = False


class _Raises(StepHandle):
    """A handle whose result is the failure (recorded when it is raised)."""

    def __init__(self, raise_: Callable[[], NoReturn]) -> None:
        self.raise_ = raise_

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.raise_()


class _OverSim(Executor):
    """The Executor contract over a SimExecutor; subclasses decide `execute_async`."""

    needs_token_ids = False

    def __init__(self, case: EngineCase) -> None:
        cfg = case.config
        self.sim = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)

    def num_kv_blocks(self) -> int:
        return self.sim.num_kv_blocks()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(out).result()

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        return self.sim.execute_async(out)


class FailingExecutor(_OverSim):
    """A SimExecutor whose calls fail where hypothesis picks: not at all, at launch or at
    result, naming a nonempty subset of the step's requests or nobody."""

    def __init__(self, case: EngineCase, data: st.DataObject) -> None:
        super().__init__(case)
        self.data = data
        self.engine: EngineCore | None = None
        self.calls = 0
        self.faults: list[Fault] = []

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
            self.faults.append(Fault(out, exc, victims, where == "launch"))
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
        new = ex.faults[before:]
        for f in new:
            if f.at_launch and case.config.async_scheduling:
                # Launched while the step before ran, the failed step is handled with that
                # one's result: the requests it finished stay finished, and when it failed
                # too its error's reasons come first.
                first = {r for g in new if not g.at_launch for r in g.victims}
                f.victims = {
                    r: why
                    for r, why in f.victims.items()
                    if reqs[r].status is not S.FINISHED and r not in first
                }
        for f in new:
            missing = set(f.victims) - changed
            assert not missing, f"step {f.out.step_id} failed ({f.exc!r}); step() omits {missing}"
        clock, steps = clock + 1, steps + 1
        assert steps <= bound, f"unfinished after {steps} steps\n{diagnose_stall(engine.scheduler)}"
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


class MidChunkFailure(_OverSim):
    """A SimExecutor that fails (at launch, or when its result is awaited) the first step
    in which a prompt is mid-chunk beside other requests, naming one of the others; it
    records every step launched after the engine handled that failure."""

    def __init__(self, case: EngineCase, at_launch: bool) -> None:
        super().__init__(case)
        self.at_launch = at_launch
        self.failed: SchedulerOutput | None = None
        self.handled = False  # the failure was raised (so the engine has handled it)
        self.mid_chunk: dict[str, int] = {}  # prompt lengths of those mid-chunk then
        self.named = ""
        self.after: list[SchedulerOutput] = []
        self.calls = 0

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        if self.failed is not None:
            if self.handled:  # (async: the step launched before the failure fails with it)
                self.after.append(out)
            return self.sim.execute_async(out)
        self.calls += 1
        mid = {sr.req_id: sr.num_prompt_tokens for sr in out.scheduled
               if sr.is_prompt and sr.num_computed_tokens + sr.num_tokens < sr.num_prompt_tokens}  # fmt: skip
        others = sorted({sr.req_id for sr in out.scheduled} - set(mid))
        # Not the first launch: an async engine's first step() launches two steps and
        # awaits the first, so only a later failed step is in flight between step() calls.
        if not mid or not others or self.calls == 1:
            return self.sim.execute_async(out)
        self.failed, self.mid_chunk, self.named = out, mid, others[0]
        exc = RequestFailed({self.named: f"{self.named}: bad token in step"})

        def raise_() -> NoReturn:
            self.handled = True
            raise exc

        if self.at_launch:
            raise_()
        return _Raises(raise_)


# Pinned: r3's first chunk (1 of its 2 tokens) fails beside three decodes; its restart
# fits the budget whole, so a restart that kept a stale computed count takes a block more.
_RESTART_EXAMPLE = (4, 2, [1, 2], "sync, launch")


@scaled(0.3)
@example(*_RESTART_EXAMPLE)
@given(
    st.integers(4, 12),  # token budget
    st.sampled_from([2, 4]),  # block size
    st.lists(st.integers(1, 30), min_size=1, max_size=4),  # prompt lengths, after 1 and 2
    # scheduling, where the step fails, and whether the client ends one of its requests
    # while it is in flight
    st.sampled_from(
        [
            "sync, launch",
            "sync, result",
            "async, launch",
            "async, result",
            "async, result, client abort",
        ]
    ),  # fmt: skip
)
def test_a_failed_step_restarts_its_mid_chunk_prompts_and_skips_requests_ended_meanwhile(
    budget: int, block: int, lengths: list[int], mode: str
) -> None:
    """A prompt mid-chunk in a failed step that the failure does not name goes back to
    the start: the next step lists it as preempted, its whole prompt is computed again,
    and it ends as if nothing had failed; so does every other request not named, also
    when one of the step's requests ended (a client abort while the step was in flight)
    before the failure was handled. No block the failed step would have filled stays in
    the prefix cache (they were cached when it was scheduled). Broken copies that fail
    it: fail_step keeping those blocks cached (found by this test: a requeued prompt hit
    its own unwritten blocks), restarting the prompt at token 1 (its restart's allocation
    adds that token to the prompt's and takes a block more: the pinned example), leaving
    it out of the next step's preempted set, or stopping at a request that ended
    meanwhile (`break` for `continue`: when it comes first)."""
    lengths = [1, 2, *lengths]  # two short prompts decode beside the longer ones' chunks
    async_, at_launch, abort = mode.startswith("async"), "launch" in mode, "abort" in mode
    cfg = make_config(block_size=block, num_gpu_blocks=64, max_num_seqs=8,
                      max_num_batched_tokens=budget, async_scheduling=async_)  # fmt: skip
    case = EngineCase(cfg, 0.0)
    # Prompts share no prefix: a hit after the failure could only be a block it never wrote.
    specs = [ReqSpec(f"r{i}", 0, tuple(range(100 * i + 1, 100 * i + n + 1)), 3)
             for i, n in enumerate(lengths)]  # fmt: skip
    ex = MidChunkFailure(case, at_launch)
    engine = EngineCore(cfg, ex, clock=StepClock(), check_invariants=CORE_CHECKS)
    reqs = {s.req_id: make_request(s) for s in specs}
    for r in reqs.values():
        engine.add_request(r)
    client_aborted = ""
    for _ in range(4 * step_bound(case, tuple(specs)) + 8):
        if not engine.has_unfinished():
            break
        engine.step()
        if abort and ex.failed is not None and not ex.handled and not client_aborted:
            # The failed step is in flight: the client ends one of its other requests.
            live = [sr.req_id for sr in ex.failed.scheduled
                    if sr.req_id not in ex.mid_chunk and sr.req_id != ex.named
                    and not reqs[sr.req_id].is_finished]  # fmt: skip
            if live:
                client_aborted = live[0]
                engine.abort(client_aborted)
                note("the client ended a request of the failed step in flight")
    else:
        raise AssertionError(f"unfinished\n{diagnose_stall(engine.scheduler)}")
    if ex.failed is None:
        assert (budget, block, lengths[2:], mode) != _RESTART_EXAMPLE, "pinned: no failure"
        return  # no step had a prompt mid-chunk beside another request
    note("a step with a prompt mid-chunk failed")
    before = {sr.req_id: sr.num_computed_tokens for sr in ex.failed.scheduled}
    for rid, n in ex.mid_chunk.items():
        if rid == client_aborted:
            continue
        preempted_next = next(o.preempted_req_ids for o in ex.after if o.scheduled)
        assert rid in preempted_next, f"{rid}: not reported preempted after the failure"
        redone = sum(sr.num_tokens for o in ex.after for sr in o.scheduled
                     if sr.req_id == rid and sr.is_prompt)  # fmt: skip
        # Whole blocks written by earlier steps may be hit again; nothing else may.
        written = before[rid] // block * block
        hit = n - redone
        assert 0 <= hit <= written and hit % block == 0, (
            f"{rid}: {redone} of its {n} prompt tokens computed after the failure, "
            f"{written} were in blocks written before it"
        )
        # Its restart is a start (docs/design.md, "Starting a waiting request"): one
        # allocation of its whole prompt's blocks, hits included, and not one more.
        table = next(sr.block_table for o in ex.after for sr in o.scheduled
                     if sr.req_id == rid and sr.block_table is not None)  # fmt: skip
        assert len(table) == cdiv(n, block), (
            f"{rid}: restarted with {len(table)} blocks of {block} for its {n} prompt tokens"
        )
    for spec in specs:
        req = reqs[spec.req_id]
        # (async: a failed step was launched before the step before it was applied, which
        # may have finished the request it names: that request ends as it would have)
        ended_first = async_ and req.status is S.FINISHED
        if spec.req_id in (ex.named, client_aborted) and not ended_first:
            assert req.status is S.ABORTED, f"{spec.req_id}: {req.status}"
            continue
        want, reason = expected_end(case, spec)
        got = req.finish_reason.value if req.finish_reason is not None else None
        assert (req.status, req.num_output_tokens, got) == (S.FINISHED, want, reason), spec
    # The requests that ended in the failure keep no block of the failed step in the
    # prefix cache: it was cached when scheduled and never written.
    kv = engine.scheduler.kv
    for spec in specs:
        if spec.req_id in (ex.named, client_aborted):
            hits = len(kv.find_cached_prefix(make_request(spec)))
            valid = before[spec.req_id] // block
            assert hits <= valid, f"{spec.req_id}: {hits} cached blocks, {valid} written"
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "idle, yet blocks are held"


def test_an_interrupt_forgets_the_blocks_its_unapplied_step_cached() -> None:
    """Ctrl-C with a step in flight (async scheduling), cleaned up as LLM.generate does:
    that step's results are never applied, so the prompt block it filled (cached when it
    was scheduled) holds nothing written. The prefix cache forgets it: the same prompt
    submitted again hits only the block of the step that was applied. Pinned: a 12-token
    prompt in chunks of 4 over blocks of 4, prefix caching on; one step() applies the
    first chunk with the second in flight. (Kills `forget_unapplied_steps__mutmut_1`,
    which raises on any block to forget, and a cleanup that forgets nothing: a hit of 8.)"""
    engine = make_engine(block_size=4, num_gpu_blocks=16, max_num_seqs=2,
                         max_num_batched_tokens=4, async_scheduling=True,
                         enable_prefix_caching=True)  # fmt: skip
    prompt = tuple(range(1, 13))
    first = make_request(ReqSpec("r0", 0, prompt, 2))
    engine.add_request(first)
    engine.step()
    assert engine._in_flight is not None and first.num_computed_tokens == 8, (
        f"pinned: the second chunk in flight, not {first.num_computed_tokens} computed"
    )
    _interrupt(engine)
    again = make_request(ReqSpec("r1", 0, prompt, 2))
    engine.add_request(again)
    engine.step()
    assert again.num_cached_tokens == 4, (
        f"the same prompt after the interrupt hit {again.num_cached_tokens} tokens: "
        "only the applied step's block (4) holds its content"
    )

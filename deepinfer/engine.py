"""EngineCore: add requests, step, abort; the clock is injected.

The same object runs under the simulator (clock = simulated time) and the
real executor (clock = wall time). It stamps every request's arrival,
first schedule, each output step and finish, so metrics come out the same way
from both. `step_events()` is the one engine loop: `step()` runs it in wall-clock
time, the simulator drives the same coroutine in simulated time.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Generator
from concurrent import futures
from itertools import accumulate, repeat
from operator import sub
from typing import TYPE_CHECKING, NamedTuple

from deepinfer import scheduler_checks
from deepinfer.config import EngineConfig
from deepinfer.decode_run import DecodeRun
from deepinfer.errors import RequestFailed
from deepinfer.executor import Executor, StepHandle
from deepinfer.kv_cache.tiers import KVTiers
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.request import FinishReason, Request
from deepinfer.scheduler import Scheduler
from deepinfer.step_log import StepLog

if TYPE_CHECKING:  # (a writer is built only by a run that writes a step log)
    from deepinfer.step_log_file import StepLogWriter

logger = logging.getLogger(__name__)


class StepEventKind(enum.Enum):
    SCHEDULED = "scheduled"  # the host has scheduled `out` (its host work is done)
    LAUNCHED = "launched"  # `out` was handed to the executor
    AWAIT = "await"  # the loop now waits for `out`'s results


# (kind, the step it concerns): a plain tuple, made three times per step.
StepEvent = tuple[StepEventKind, SchedulerOutput]
_SCHEDULED, _LAUNCHED, _AWAIT = StepEventKind.SCHEDULED, StepEventKind.LAUNCHED, StepEventKind.AWAIT


class _InFlight(NamedTuple):
    """A launched step."""

    out: SchedulerOutput
    handle: StepHandle
    start: float  # the clock at its launch
    ended: float | None  # the clock when the launch returned, if the launch did the work


class _Applied(NamedTuple):
    """What waiting for the step in flight came to."""

    changed: list[Request]  # the requests it changed, or those its failure aborted
    ok: bool  # its results were applied (False: it failed)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.monotonic,
        model_max_len: int | None = None,
        check_invariants: bool = False,
        record_steps: bool = True,
        kv_tiers: KVTiers | None = None,
        step_writer: StepLogWriter | None = None,
    ) -> None:
        """kv_tiers: the KV cache's tiers below HBM (kv_cache/tiers.py), which whoever
        runs the executor builds (the simulator sizes them from the model's KV bytes), or
        the executor does (`Executor.kv_tiers`: the torch executor's host memory);
        config.kv_host_cache_gib > 0 needs a host tier among them.
        step_writer: writes every applied step, its shape and host seconds, to a step log
        file (deepinfer/step_log_file.py); each step then runs on its own (no decode
        runs), whether or not the steps are kept in `steps`."""
        kv_tiers = executor.kv_tiers(kv_tiers)
        if config.kv_host_cache_gib > 0 and (kv_tiers is None or kv_tiers.host is None):
            raise ValueError(
                f"kv_host_cache_gib={config.kv_host_cache_gib}: this engine was given no "
                f"host KV tier to hold it (the {type(executor).__name__} executor keeps "
                "none; the simulator builds one)"
            )
        self.config = config
        self.executor = executor
        self.clock = clock
        self.scheduler = Scheduler(
            config,
            executor.num_kv_blocks(),
            model_max_len=model_max_len,
            emit_token_ids=executor.needs_token_ids,
            vocab_size=executor.vocab_size,
            kv_tiers=kv_tiers,
        )
        self.check = check_invariants
        self.record_steps = record_steps
        self.records: list[RequestRecord] = []  # one per request that reached a terminal state
        self.steps = StepLog()
        self.step_writer = step_writer
        self._in_flight: _InFlight | None = None
        self._last_step_end: float | None = None
        # Structured requests whose grammar is compiling (req_id -> request, its compile),
        # and those rejected since the last step() because it failed.
        self._compiling: dict[str, tuple[Request, futures.Future]] = {}
        self._grammar_rejected: list[Request] = []
        # Role decode: (request id, when) for each request whose blocks were reserved
        # for its KV on its way, since the sender last took them (`take_kv_reserved`).
        self._kv_reserved: list[tuple[str, float]] = []
        # (request id, when) of each first schedule since `take_started`, kept once a
        # caller asked (a prefill instance's handovers begin there), else None.
        self._started: list[tuple[str, float]] | None = None

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ---- requests --------------------------------------------------------------------

    def add_request(self, req: Request) -> str | None:
        """Queue `req`; returns the rejection reason if it can never be served.

        A structured request (so_args) on an executor that samples real tokens has its
        grammar compiled by the executor in a worker (`prepare_grammar`, cached by
        schema); until it is ready the request waits and the scheduler passes it over.
        The simulator's executor samples no tokens: there a request is only priced.
        """
        reason = self.scheduler.add_request(req)
        if reason is None and req.structured and self.executor.needs_token_ids:
            reason = self._prepare_grammar(req)
        if reason is not None:
            self.records.append(_record(req))
        return reason

    def _prepare_grammar(self, req: Request) -> str | None:
        so_args = req.sampling_params.so_args
        assert so_args is not None  # (only a simulated trace marks a request structured)
        try:
            compile_ = self.executor.prepare_grammar(so_args)
        except ValueError as e:
            self.scheduler.reject(req.request_id, str(e))
            return str(e)
        if not compile_.done():
            req.awaiting_grammar = True
            self._compiling[req.request_id] = (req, compile_)
            return None
        error = _compile_error(compile_)  # cached: ready (or failed) at once
        if error is not None:
            self.scheduler.reject(req.request_id, error)
        return error

    def _poll_grammars(self) -> None:
        """Settle finished compiles: the request may start, or is rejected with the error."""
        for req_id, (req, compile_) in list(self._compiling.items()):
            if not compile_.done():
                continue
            del self._compiling[req_id]
            req.awaiting_grammar = False
            error = _compile_error(compile_)
            if error is not None and not req.is_finished:  # (not aborted meanwhile)
                self.scheduler.reject(req_id, error)
                req.times.finish = self.clock()
                self.records.append(_record(req))
                self._grammar_rejected.append(req)

    def _wait_for_a_grammar(self) -> None:
        """Nothing else can run: block until some compile ends (it runs in a worker)."""
        futures.wait([c for _, c in self._compiling.values()], return_when=futures.FIRST_COMPLETED)
        self._poll_grammars()

    def take_kv_reserved(self) -> list[tuple[str, float]]:
        """The requests awaiting their KV (`Request.awaiting_kv`) whose blocks were
        reserved since the last call, with the time of each reservation: the sender may
        send each KV from then on, and calls `kv_arrived` once it is here."""
        taken, self._kv_reserved = self._kv_reserved, []
        return taken

    def take_started(self) -> list[tuple[str, float]]:
        """The requests first scheduled since the last call (none before the first
        call: it starts the record), with when."""
        taken, self._started = self._started or [], []
        return taken

    def kv_arrived(self, req_id: str) -> None:
        """The KV of a reserved request is in its blocks: it is scheduled from the next
        step on."""
        self.scheduler.kv_arrived(req_id)

    def abort(self, req_id: str) -> Request | None:
        return self.finish(req_id, FinishReason.ABORT)

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a live request from outside (abort, or a stop string found in its text)."""
        req = self.scheduler.finish_request(req_id, reason)
        if req is not None:
            req.times.finish = self.clock()
            self.records.append(_record(req))
            self._compiling.pop(req_id, None)  # nothing waits on its compile any more
        return req

    def restate_record(self, req: Request) -> None:
        """The output processor cut an ended request's tokens at a stop string completed
        before the token the engine ended it on (accepted drafts of one update): its
        record becomes that of the tokens it kept, with their reason (stop)."""
        for i in range(len(self.records) - 1, -1, -1):
            if self.records[i].req_id == req.request_id:
                self.records[i] = _record(req)
                return

    def discard_in_flight(self) -> None:
        """Forget a launched step whose results will never be applied (its requests were
        aborted: an interrupted `generate`)."""
        self._in_flight = None
        self.scheduler.forget_unapplied_steps()
        self.executor.discard_pending()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the engine loop -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, its requests' first schedule stamped."""
        host_t0 = time.perf_counter() if self.step_writer is not None else 0.0
        out = self.scheduler.schedule()
        if self.check:
            scheduler_checks.check_output(self.scheduler, out)
            scheduler_checks.check_invariants(self.scheduler)
        if out.kv_reserved:
            now = self.clock()
            self._kv_reserved += [(req_id, now) for req_id in out.kv_reserved]
        if out.scheduled:
            now = self.clock()
            requests = self.scheduler.requests
            started = self._started
            for sr in out.scheduled:
                times = requests[sr.req_id].times
                if times.first_scheduled is None:
                    times.first_scheduled = now
                    if started is not None:
                        started.append((sr.req_id, now))
        if self.step_writer is not None:
            self.step_writer.scheduled(out, time.perf_counter() - host_t0)
        return out

    def apply_results(
        self,
        out: SchedulerOutput,
        res: ModelRunnerOutput,
        duration: float | None = None,
        *,
        overlapped: bool = False,
        handle: StepHandle | None = None,
    ) -> list[Request]:
        """Apply a step's results, stamp times, record ended requests and the step.
        overlapped: it was launched while the step before it ran (the step log file
        says so: its duration is then a pipelined step's). handle: the step's launch,
        whose device time the step log reads (`StepHandle.device_seconds`)."""
        host_t0 = time.perf_counter() if self.step_writer is not None else 0.0
        changed = self.scheduler.update_from_output(out, res)
        now = self.clock()
        for req in changed:
            times = req.times
            if times.first_token is None:
                times.first_token = now
            times.token_times.append(now)
            if req.is_finished:
                times.finish = now
                self.records.append(_record(req))
        if duration is None:
            duration = now - (self._last_step_end if self._last_step_end is not None else now)
        self.scheduler.observe_step_time(out.step_id, duration)
        if self.record_steps or self.step_writer is not None:
            record = self._step_record(out, now, duration)
            if self.record_steps:
                self.steps.append(record)
            if self.step_writer is not None:
                seconds = time.perf_counter() - host_t0
                self.step_writer.applied(out, record, seconds, overlapped, handle)
        self._last_step_end = now
        if self.check:
            scheduler_checks.check_invariants(self.scheduler)
        return changed

    def step(self) -> list[Request]:
        """One step of the engine loop in wall-clock time; returns the requests that changed."""
        events = self.step_events()
        while True:
            try:
                next(events)  # a real executor's handle blocks in .result(): nothing to wait for
            except StopIteration as done:
                return done.value

    def step_events(self) -> Generator[StepEvent, None, list[Request]]:
        """One step of the engine loop, as a coroutine that yields at its time points;
        returns the requests that changed, with those rejected meanwhile because their
        grammar failed to compile.

        The loop is the same for every executor; only the driver differs. `step()` runs
        it in wall-clock time and ignores the events; the simulator advances simulated
        time at each: host time after `SCHEDULED`, the step's device time from
        `LAUNCHED`, and it resumes an `AWAIT` once that time has passed.
        """
        if self._compiling:
            self._poll_grammars()
        if self.config.async_scheduling:
            changed = yield from self._pipelined_step()
        else:
            changed = yield from self._sync_step()
        if self.step_writer is not None and self._in_flight is None:
            self.step_writer.flush()  # (nothing queued behind the last step: no wait)
        if not self._grammar_rejected:
            return changed
        rejected, self._grammar_rejected = self._grammar_rejected, []
        return rejected + changed

    def _sync_step(self) -> Generator[StepEvent, None, list[Request]]:
        """One step at a time: schedule step N, launch it, wait for it, apply its results."""
        ended = yield from self._start_step()
        if ended is not None:
            return ended
        assert self._in_flight is not None
        yield _AWAIT, self._in_flight.out
        return self._apply_in_flight().changed

    def _pipelined_step(self) -> Generator[StepEvent, None, list[Request]]:
        """Async scheduling's two-step pipeline: while step N runs, step N+1 is scheduled
        and launched; then N's results are applied, and N+1 is the step in flight.

        The scheduler schedules N+1 on N's tokens assumed (placeholders); an executor
        that overlaps (the torch one) feeds N's sampled tokens to N+1 on the device, so
        the host's work for N+1 and for N's results hides behind the device's (a
        speculating one chains N+1's drafts and positions on N's too). A step the
        executor cannot overlap (`Executor.can_overlap`: grammars, history-reading
        samplers) runs after N instead: launched once N is applied, as without async
        scheduling (its scheduling still overlapped N). With nothing in flight (the
        first step, after the engine idled or a step failed) N is launched first.

        The events past N's launch: N+1 beside N: SCHEDULED N+1, LAUNCHED N+1, AWAIT N;
        N+1 after N: SCHEDULED N+1, AWAIT N, LAUNCHED N+1; nothing to schedule: AWAIT N.
        """
        if self._in_flight is None:
            ended = yield from self._start_step()
            if ended is not None:
                return ended
        assert self._in_flight is not None
        current = self._in_flight.out
        following = self.schedule()  # N+1, on N's tokens assumed
        if following.is_empty:
            yield _AWAIT, current
            return self._apply_in_flight().changed
        yield _SCHEDULED, following
        if self.executor.can_overlap(following):
            return (yield from self._run_beside(current, following))
        return (yield from self._run_after(current, following))

    def _run_beside(
        self, current: SchedulerOutput, following: SchedulerOutput
    ) -> Generator[StepEvent, None, list[Request]]:
        """Launch `following` while `current` runs, then apply `current`'s results."""
        try:
            launched = self._launch(following)
        except Exception as exc:  # failed before its device work: `current` still runs
            yield _AWAIT, current
            applied = self._apply_in_flight(following, following_error=exc)
            if not applied.ok:
                return applied.changed
            return applied.changed + self._fail([following], exc)
        yield _LAUNCHED, following
        yield _AWAIT, current
        applied = self._apply_in_flight(following)
        if applied.ok:
            self._in_flight = launched
        return applied.changed

    def _run_after(
        self, current: SchedulerOutput, following: SchedulerOutput
    ) -> Generator[StepEvent, None, list[Request]]:
        """Apply `current`'s results, then launch `following` (it needs them on the host):
        its results are not held back by `following`'s work, and each step's time is its
        own."""
        yield _AWAIT, current
        applied = self._apply_in_flight(following)
        if not applied.ok:
            return applied.changed
        failed = self._launch_in_flight(following)
        if failed is not None:
            return applied.changed + failed
        yield _LAUNCHED, following
        return applied.changed

    # ---- decode runs (fast-forward) -----------------------------------------------

    def decode_run(self, through_finishes: bool = False) -> DecodeRun | None:
        """Steps from here the scheduler can prove (`Scheduler.decode_run`), for a driver
        that times them without running them, or None: the executor cannot return a
        run's tokens, grammars are compiling, or the step in flight is not one of them.
        through_finishes: the driver reads nothing of the engine between the run's steps
        (a request's end is reported with the run), so a run may go on past it."""
        if self._compiling or self._grammar_rejected or not self.executor.can_fast_forward:
            return None
        if self.step_writer is not None:  # (it writes each step's shape and host time)
            return None
        flight = self._in_flight
        if self.config.async_scheduling:
            if flight is None or flight.ended is not None:
                return None
            return self.scheduler.decode_run(flight.out, through_finishes)
        return None if flight is not None else self.scheduler.decode_run(None, through_finishes)

    def advance_decode(self, run: DecodeRun, launched: list[float], applied: list[float]) -> None:
        """Take len(applied) steps of `run` at once (at most its horizon), as `step_events`
        one step after another would: the scheduler's and the executor's state, each
        request's token times, the step records. launched[s] / applied[s]: the clock when
        the run's step s was launched, and when the loop applied results in that step's
        turn (under async scheduling, those of the step before it). A launch must pass no
        time on the clock (a simulated one)."""
        k = len(applied)
        reqs = run.requests
        ids = [r.request_id for r in reqs]
        flight = self._in_flight
        pipelined = run.in_flight_step is not None
        # Request i's tokens, one per step applied to it (up to its limit): the step in
        # flight's, then the run's.
        counts = [h if h < k else k for h in run.limits]
        num_run = [c - 1 for c in counts] if pipelined else counts
        sampled = self.executor.execute_decode_run(ids, run.contexts, num_run, run.dropped_req_ids)
        if pipelined:
            assert flight is not None
            first = flight.handle.result().sampled_token_ids
            for i, rid in enumerate(ids):
                token = first.get(rid)
                if token is None or len(token) != 1:
                    raise RuntimeError(
                        f"step {flight.out.step_id}: the executor returned {token!r} for "
                        f"{rid!r}, scheduled to decode one token"
                    )
                sampled[i] = token + sampled[i]
        following, usages, finished = self.scheduler.advance_decode(run, k, sampled)
        for req, count in zip(reqs, counts):
            times = req.times
            if times.first_token is None:  # (a decode engine's request: its first step)
                times.first_token = applied[0]
            times.token_times.extend(applied if count == k else applied[:count])
        limit = dict(zip(ids, run.limits))
        for req in finished:
            req.times.finish = applied[limit[req.request_id] - 1]
            self.records.append(_record(req))
        if self.record_steps:
            self._record_run(run, launched, applied, usages, len(finished))
        self._last_step_end = applied[-1]
        if following is not None:
            self._in_flight = _InFlight(
                following, self.executor.execute_async(following), launched[-1], None
            )
        if self.check:
            scheduler_checks.check_invariants(self.scheduler)

    def _record_run(
        self,
        run: DecodeRun,
        launched: list[float],
        applied: list[float],
        usages: list[float],
        num_finished: int,
    ) -> None:
        """The step log's records of a run's applied steps, appended as columns. Each
        step's duration is as _apply_in_flight measures it: from its launch, or from the
        end of the step before where that is later, to its results (max and min as the
        single step takes them). Under async scheduling the first is the step in flight,
        scheduled before the run; the run's first step reports the preemptions made
        since the step before it; the others schedule the run's requests still in its
        batch (run.limits), one token each.
        """
        k, n = len(applied), run.num_reqs
        if min(run.limits) < k:  # requests ended within the run
            self._record_batches(run, launched, applied, usages)
            return
        first_id, head, durations, preempted_col = self._run_head(run, launched, applied)
        batched, num_reqs, prompt, _ = head
        self.steps.extend(
            (
                range(first_id, first_id + k), applied, durations,
                [n] * (k - 1) + [n - num_finished], repeat(self.scheduler.num_waiting, k),
                [batched] + [n] * (k - 1), [prompt] + [0] * (k - 1),
                [num_reqs] + [n] * (k - 1), usages, preempted_col, repeat(None, k),
            )
        )  # fmt: skip

    def _record_batches(
        self, run: DecodeRun, launched: list[float], applied: list[float], usages: list[float]
    ) -> None:
        """`_record_run` where requests end within the run: the run's step s schedules
        those whose limit is past s, and each record counts those running after it."""
        k = len(applied)
        ends = [0] * (k + 1)  # [s]: the requests whose limit is s (their last step s - 1)
        for h in run.limits:
            if h <= k:
                ends[h] += 1
        # [s]: the requests the run's step s schedules, those whose limit is past s
        sched = list(accumulate(ends, sub, initial=run.num_reqs))[1:]
        first_id, head, durations, preempted_col = self._run_head(run, launched, applied)
        batched, num_reqs, prompt, _ = head
        pipelined = run.in_flight_step is not None
        shapes = sched[: k - 1] if pipelined else sched[1:k]
        self.steps.extend(
            (
                range(first_id, first_id + k), applied, durations,
                sched[1:], repeat(self.scheduler.num_waiting, k),
                [batched] + shapes, [prompt] + [0] * (k - 1),
                [num_reqs] + shapes, usages, preempted_col, repeat(None, k),
            )
        )  # fmt: skip

    def _run_head(
        self, run: DecodeRun, launched: list[float], applied: list[float]
    ) -> tuple[int, tuple[int, int, int, int], list[float], list[int]]:
        """What a run's records share however its batch changes: the first record's
        step id, its shape (batched tokens, requests, prompt tokens, preemptions), the
        steps' durations, and the preemptions column."""
        k, n = len(applied), run.num_reqs
        starts, head = launched, (n, n, 0, run.num_preempted_before)
        pipelined = run.in_flight_step is not None
        if pipelined:
            flight = self._in_flight
            assert flight is not None
            starts, head = [flight.start] + launched, _shape(flight.out)
        durations = []
        last = self._last_step_end
        for start, end in zip(starts, applied):
            began = start if last is None or not last > start else last
            durations.append(end - (end if end < began else began))
            last = end
        first_id = run.first_step_id - 1 if pipelined else run.first_step_id
        preempted_col = [head[3]] + [0] * (k - 1)
        if pipelined and k > 1:
            preempted_col[1] = run.num_preempted_before
        return first_id, head, durations, preempted_col

    def _start_step(self) -> Generator[StepEvent, None, list[Request] | None]:
        """With nothing in flight, schedule a step and launch it: None once it is in
        flight. Else the engine step ends here, and this is what it returns: [] when
        there was nothing to run, the requests aborted when the launch failed."""
        out = self.schedule()
        if out.is_empty:
            self._idle()
            return []
        yield _SCHEDULED, out
        failed = self._launch_in_flight(out)
        if failed is not None:
            return failed
        yield _LAUNCHED, out
        return None

    def _idle(self) -> None:
        """Nothing was scheduled with nothing in flight: wait for a grammar to compile,
        or return to the driver while reserved requests await their KV (not stalls); or
        raise SchedulerStalled when requests wait that no step serves."""
        if self._compiling:
            if not self._grammar_rejected:  # (else hand those back first)
                self._wait_for_a_grammar()
        elif self.scheduler.has_unfinished() and not self.scheduler.num_awaiting_kv:
            scheduler_checks.raise_stalled(self.scheduler)

    def _launch_in_flight(self, out: SchedulerOutput) -> list[Request] | None:
        """Launch `out` as the step in flight; when the launch raises, the requests it
        aborted (one request's bad work must not stop the engine)."""
        try:
            self._in_flight = self._launch(out)
        except Exception as exc:
            return self._fail([out], exc)
        return None

    def _launch(self, out: SchedulerOutput) -> _InFlight:
        start = self.clock()  # before the call: a synchronous executor returns when done
        host_t0 = time.perf_counter() if self.step_writer is not None else 0.0
        handle = self.executor.execute_async(out)
        if self.step_writer is not None:
            self.step_writer.launched(out, time.perf_counter() - host_t0)
        returned = self.clock()
        # Done on return, or run by the launch (an executor on the host's CPU), with time
        # passed (a simulated clock passes none in a launch): the launch did the work.
        ran = handle.done() or handle.ran_in_launch
        ended = returned if returned > start and ran else None
        return _InFlight(out, handle, start, ended)

    def _apply_in_flight(
        self, following: SchedulerOutput | None = None, following_error: Exception | None = None
    ) -> _Applied:
        """Wait for the step in flight and apply its results. When it fails, `following`
        (scheduled on its tokens) fails with it; `following_error`: `following`'s own
        launch failed too."""
        flight = self._in_flight
        assert flight is not None
        self._in_flight = None
        try:
            res = flight.handle.result()
        except Exception as exc:
            outs = [flight.out] if following is None else [flight.out, following]
            return _Applied(self._fail(outs, exc, following_error), ok=False)
        # A pipelined step's device work began when the step before it ended, and ended
        # when its result came, unless its launch did the work (then N+1's launch, before
        # this, may have done N+1's too).
        start, last = flight.start, self._last_step_end
        began = start if last is None else max(start, last)
        overlapped = began > start  # launched while the step before ran
        end = self.clock() if flight.ended is None else flight.ended
        changed = self.apply_results(
            flight.out, res, end - min(began, end), overlapped=overlapped, handle=flight.handle
        )
        self._last_step_end = end
        return _Applied(changed, ok=True)

    def _fail(
        self, outs: list[SchedulerOutput], exc: Exception, launch_error: Exception | None = None
    ) -> list[Request]:
        """The executor raised: abort the requests it names (RequestFailed) or, when it
        names none, every request of the failed step; requeue the rest; go on.
        launch_error: the step after it (outs[1]) failed at its launch too; the same rule
        aborts its requests, unless `exc` names them."""
        self._in_flight = None
        self.executor.discard_pending()
        errors: dict[str, str] = {}
        if launch_error is not None:
            errors.update(_errors(outs[1], launch_error))
        errors.update(_errors(outs[0], exc))
        for out in outs:  # the KV their schedules moved down a tier still gets there
            if out.kv_saves:
                self.executor.settle_kv_saves(out)
        aborted = self.scheduler.fail_step(outs, errors)
        now = self.clock()
        for req in aborted:
            req.times.finish = now
            self.records.append(_record(req))
        if self.check:
            scheduler_checks.check_invariants(self.scheduler)
        return aborted

    def _step_record(self, out: SchedulerOutput, now: float, duration: float) -> StepRecord:
        s = self.scheduler
        batched, num_reqs, prompt, preempted = _shape(out)
        return StepRecord(
            step_id=out.step_id,
            time=now,
            duration=duration,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_batched_tokens=batched,
            num_prompt_tokens=prompt,
            num_scheduled_reqs=num_reqs,
            kv_usage=s.kv.usage,
            num_preempted=preempted,
            num_proposals=out.num_proposals,
        )


def _shape(out: SchedulerOutput) -> tuple[int, int, int, int]:
    """What a step record reads of `out`: batched tokens, requests, prompt tokens, and
    the preemptions it reports."""
    prompt = sum(r.num_tokens for r in out.scheduled if r.is_prompt)
    return out.num_batched_tokens, len(out.scheduled), prompt, len(out.preempted_req_ids)


def _errors(out: SchedulerOutput, exc: Exception) -> dict[str, str]:
    """req_id -> reason of the requests a failure of `out` aborts (logged)."""
    if isinstance(exc, RequestFailed):
        logger.warning("step %d: %s", out.step_id, exc)
        return exc.reasons
    errors = {sr.req_id: f"{type(exc).__name__}: {exc}" for sr in out.scheduled}
    logger.error("step %d failed; aborting its %d requests", out.step_id, len(errors), exc_info=exc)
    return errors


def _compile_error(compile_: futures.Future) -> str | None:
    error = compile_.exception()
    return None if error is None else f"so_args: the grammar failed to compile: {error}"


def _record(req: Request) -> RequestRecord:
    t = req.times
    return RequestRecord(
        req_id=req.request_id,
        status=req.status.value,
        arrival=t.arrival,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        first_scheduled=t.first_scheduled,
        first_token=t.first_token,
        finish=t.finish,
        token_times=t.token_times,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        reason=req.reject_reason,
    )

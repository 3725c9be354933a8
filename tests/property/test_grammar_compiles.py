"""Structured requests whose grammars compile in a worker (docs/design.md, "Structured outputs").

The workload runs through `EngineCore.step()` over a model-less executor that samples
tokens, so the engine asks it to compile each structured request's grammar
(`prepare_grammar`, one future per schema). Hypothesis picks each schema's fate (it
compiles, it fails to compile, or the executor refuses it at once), whether its compile
is already done when first asked, when pending compiles end (between steps, or from
another thread while the engine waits with nothing else to run), and client aborts. The
rules:

- a request is never scheduled before its grammar is ready; the others run meanwhile;
- a refused grammar rejects its request in `add_request`, with the executor's reason; a
  failed compile rejects only its requests, with "so_args: the grammar failed to
  compile: <error>": in `add_request` if it had failed already, else with a finish time
  in the `step()` that notices, which returns them;
- every other request ends as its stop conditions say (finished with max_tokens), or
  aborted if the client aborted it; every request ends exactly once, with one record
  that agrees with it;
- an engine with only compiles pending waits for one instead of reporting a stall.

Broken copies that fail it: `_poll_grammars` not clearing `awaiting_grammar` (the
request never starts) and `step()` dropping the rejected requests from its return. It
found that an abort left the request's compile in `EngineCore._compiling`: an engine
with nothing else to do then blocked in `step()` until that compile ended (now `finish`
drops it). Its deep profile then found that a step which noticed a failed compile
waited for another compile before it returned the rejection (now it returns first), and
two flaws of its own: it ended an aborted request's compile to unblock an engine that
rightly waited for another one, and a timer started before the step made the number of
steps, hence the draws, depend on timing (the compile now ends once the engine waits).
"""

from __future__ import annotations

import threading
from concurrent import futures
from concurrent.futures import Future
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.engine import EngineCore
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler_checks import diagnose_stall
from tests.factories import ScriptedExecutor, StepClock, make_config
from tests.property.harness import CORE_CHECKS, note
from tests.property.strategies import scaled

S = RequestStatus
SCHEMAS = ("[0-9]", "[a-z]+", "(x|y)z", "q{2}")
FATES = ("compiles", "fails", "refused")


class TokensOnly(ScriptedExecutor):
    """Samples tokens but compiles no grammar (`prepare_grammar` keeps its default)."""

    needs_token_ids = True


class CompilingExecutor(ScriptedExecutor):
    """ScriptedExecutor's tokens, plus one compile future per schema whose fate the test
    decides; it checks that no structured request is scheduled before its grammar."""

    needs_token_ids = True

    def __init__(self, fates: dict[str, tuple[str, bool]], schema_of: dict[str, str]) -> None:
        super().__init__(num_blocks=64)
        self.fates = fates  # schema -> (fate, done before it is first asked)
        self.schema_of = schema_of  # req_id -> its schema (structured requests)
        self.compiles: dict[str, Future] = {}

    def prepare_grammar(self, so_args: dict) -> Future:
        schema = so_args["schema"]
        fate, done_at_once = self.fates[schema]
        if fate == "refused":
            raise ValueError(f"SamplingParams.so_args.schema={schema!r}: refused here")
        if schema not in self.compiles:
            self.compiles[schema] = Future()
            if done_at_once:
                self.settle(schema)
        return self.compiles[schema]

    def settle(self, schema: str) -> None:
        fut = self.compiles[schema]
        if fut.done():
            return
        if self.fates[schema][0] == "fails":
            fut.set_exception(RuntimeError(f"no grammar for {schema}"))
        else:
            fut.set_result(object())

    def pending(self) -> list[str]:
        return sorted(s for s, f in self.compiles.items() if not f.done())

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for sr in out.scheduled:
            schema = self.schema_of.get(sr.req_id)
            if schema is not None:
                fut = self.compiles.get(schema)
                assert fut is not None and fut.done() and fut.exception() is None, (
                    f"{sr.req_id} scheduled before its grammar {schema!r} compiled"
                )
        return super().execute(out)


WAIT = futures.wait


def _ending_one(ex: CompilingExecutor, idle: bool):  # noqa: ANN202
    """futures.wait for one step: when the engine waits with nothing else to run (`idle`),
    the first pending compile it waits for ends from another thread; else nothing ends
    (the watchdog then says the engine blocked while it had work)."""

    def wait(fs, timeout=None, return_when=futures.ALL_COMPLETED):  # noqa: ANN001, ANN202
        pending = [f for f in fs if not f.done()]
        if idle and pending:
            note("the engine waited for a compile")
            schema = next(s for s, f in ex.compiles.items() if f is pending[0])
            threading.Timer(0.001, ex.settle, [schema]).start()
        return WAIT(fs, timeout=timeout, return_when=return_when)

    return wait


def _unblock(ex: CompilingExecutor, stuck: threading.Event) -> None:
    stuck.set()
    for schema in ex.pending():
        ex.settle(schema)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, tuple[str, bool]], list[tuple[str, str | None]]]:
    """Each schema's (fate, done at once), and requests (id, schema or None)."""
    fates = {s: (draw(st.sampled_from(FATES)), draw(st.booleans())) for s in SCHEMAS}
    n = draw(st.integers(1, 8))
    schemas = st.none() | st.sampled_from(SCHEMAS)
    return fates, [(f"r{i}", draw(schemas)) for i in range(n)]


@scaled(3.0)
@given(workloads(), st.booleans(), st.data())
def test_a_request_waits_for_its_grammar_and_a_failed_compile_rejects_it_alone(
    wl: tuple[dict[str, tuple[str, bool]], list[tuple[str, str | None]]],
    async_: bool,
    data: st.DataObject,
) -> None:
    """The rules of the module docstring; and on an executor that compiles no grammar,
    every structured request is rejected in `add_request`, naming the executor."""
    fates, specs = wl
    schema_of = {rid: s for rid, s in specs if s is not None}
    ex = CompilingExecutor(fates, schema_of)
    cfg = make_config(num_gpu_blocks=64, max_num_seqs=4, async_scheduling=async_)
    if data.draw(st.integers(0, 9), label="executor without grammars") == 0:
        _check_refused_by_an_executor_without_grammars(cfg, specs)
        return
    engine = EngineCore(cfg, ex, clock=StepClock(), check_invariants=CORE_CHECKS)
    reqs: dict[str, Request] = {}
    refused: dict[str, str] = {}
    for rid, schema in specs:
        so = {"schema_type": "regex", "schema": schema} if schema else None
        reqs[rid] = Request(
            rid, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, so_args=so)
        )
        reason = engine.add_request(reqs[rid])
        if reason is not None:
            refused[rid] = reason
    client_aborted: set[str] = set()
    returned: set[str] = set()  # requests some step() returned
    for _ in range(200):
        if not engine.has_unfinished():
            break
        pending = ex.pending()
        if pending and data.draw(st.booleans(), label="a compile ends now"):
            ex.settle(data.draw(st.sampled_from(pending), label="which"))
        live = sorted(r for r, q in reqs.items() if not q.is_finished)
        if live and data.draw(st.integers(0, 9), label="client abort") == 0:
            rid = data.draw(st.sampled_from(live), label="aborted")
            engine.abort(rid)
            client_aborted.add(rid)
        # Nothing else to run: the engine may block on the compiles, and one ends
        # elsewhere, once it waits (a timer started before the step could end it before
        # the step looked, and the step count, hence the draws, would hang on timing).
        # (Not idle when a live request's compile has ended: the step must notice it and
        # return, whatever it found, without waiting for another compile.)
        live = [r for r, q in reqs.items() if not q.is_finished]
        idle = all(reqs[r].awaiting_grammar for r in live) and not any(
            ex.compiles[schema_of[r]].done()
            for r in live
            if r in schema_of and schema_of[r] in ex.compiles
        )
        # Should the engine block on a compile while other work is ready, end every
        # compile after a while so that the test fails instead of hanging.
        stuck = threading.Event()
        watchdog = threading.Timer(5.0, _unblock, [ex, stuck])
        watchdog.start()
        before = {r for r, q in reqs.items() if q.status is S.REJECTED}
        ready = [r for r, sc in schema_of.items() if sc in ex.compiles and ex.compiles[sc].done()]
        try:
            with mock.patch.object(futures, "wait", _ending_one(ex, idle)):
                changed = engine.step()
        finally:
            watchdog.cancel()
        assert not stuck.is_set(), "step() blocked on a compile while other requests could run"
        for rid in ready:  # a compile that had ended is noticed by the next step()
            req = reqs[rid]
            assert req.is_finished or not req.awaiting_grammar, f"{rid} waits for a ready grammar"
        returned |= {r.request_id for r in changed}
        for rid in {r for r, q in reqs.items() if q.status is S.REJECTED} - before:
            assert rid in returned, f"{rid} was rejected in a step() that did not return it"
    else:
        raise AssertionError(f"unfinished\n{diagnose_stall(engine.scheduler)}")

    for rid, req in reqs.items():
        recs = [r for r in engine.records if r.req_id == rid]
        assert len(recs) == 1, f"{rid} ended {req.status.value} with {len(recs)} records"
        assert (recs[0].status, recs[0].reason) == (req.status.value, req.reject_reason), rid
        schema = schema_of.get(rid)
        fate = fates[schema][0] if schema else "none"
        if fate == "refused":
            assert rid in refused and req.status is S.REJECTED, (rid, req.status)
            assert refused[rid] == req.reject_reason and "refused here" in refused[rid]
        elif rid in client_aborted:
            assert req.status is S.ABORTED, (rid, req.status)
            if fate == "fails" and schema in ex.compiles:
                note("a request aborted while its grammar compiled, which then failed")
        elif fate == "fails":
            want = f"so_args: the grammar failed to compile: no grammar for {schema}"
            assert (req.status, req.reject_reason) == (S.REJECTED, want), (rid, req.status)
            if rid in refused:  # failed before it was asked: rejected on arrival
                note("a compile had failed before the request came")
                assert refused[rid] == want
            else:
                note("a compile failed while its request waited")
                assert req.times.finish is not None, f"{rid}: rejected without a finish time"
        else:
            assert (req.status, req.num_output_tokens) == (S.FINISHED, 3), (rid, req.status)


def _check_refused_by_an_executor_without_grammars(
    cfg: object, specs: list[tuple[str, str | None]]
) -> None:
    engine = EngineCore(cfg, TokensOnly(64), clock=StepClock(), check_invariants=CORE_CHECKS)  # type: ignore[arg-type]
    want = "SamplingParams.so_args: the TokensOnly executor does not support structured outputs"
    reqs = {}
    for rid, schema in specs:
        so = {"schema_type": "regex", "schema": schema} if schema else None
        reqs[rid] = Request(
            rid, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, so_args=so)
        )
        reason = engine.add_request(reqs[rid])
        assert reason == (want if schema else None), (rid, reason)
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    for rid, schema in specs:
        req = reqs[rid]
        want_status = S.REJECTED if schema else S.FINISHED
        assert req.status is want_status and req.reject_reason == (want if schema else None), rid
        assert [r.reason for r in engine.records if r.req_id == rid] == [req.reject_reason]

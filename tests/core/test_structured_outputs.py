"""Structured outputs in the core: so_args is checked at SamplingParams, a request waits for
its grammar without holding up the others, a failed compile rejects it alone, a complete
grammar ends it, and the simulator prices the masks instead of refusing them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import pytest

from deepinfer.config import EngineConfig
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler_checks import diagnose_stall
from tests.factories import ScriptedExecutor, make_config, make_engine, make_request

REGEX = {"schema_type": "regex", "schema": "[0-9]{3}"}


@pytest.mark.parametrize(
    ("so_args", "message"),
    [
        ("[0-9]", "so_args='\\[0-9\\]': must be a dict"),
        ({"schema_type": "regex", "schema": "a", "strict": 1}, "unknown keys"),
        ({"schema_type": "yaml", "schema": "x"}, "so_args.schema_type='yaml'"),
        ({"schema_type": "regex"}, "so_args.schema=None: is required"),
        ({"schema_type": "regex", "schema": 5}, "a regex must be a string"),
        ({"schema_type": "json", "schema": [1]}, "must be an object"),
        ({"schema_type": "json", "schema": {"type": int}}, "is not JSON: Object of type type"),
        ({"schema_type": "choice", "schema": []}, "non-empty list of strings"),
        ({"schema_type": "choice", "schema": ["a", 1]}, "every choice must be a string"),
    ],
)
def test_the_shape_of_so_args_is_checked_at_construction(so_args: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(so_args=so_args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "schema", "reason"),
    [
        ("json", {"type": "foo"}, 'invalid JSON Schema at /: Unsupported type "foo"'),
        (
            "json",
            {"type": "object", "properties": {"a": {"items": {"type": "foo"}}}},
            'invalid JSON Schema at /properties/a/items: Unsupported type "foo"',
        ),
        (
            "json",
            {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 5, "maximum": 2}]},
            "invalid JSON Schema at /anyOf/1: Invalid range: minimum greater than maximum",
        ),
        ("json", '{"type": ', "is not valid JSON: Expecting value: line 1 column 10"),
        ("regex", "[0-9", "invalid regex: Regex parsing error at position 5: Unclosed '\\['"),
        ("regex", "(ab", "invalid regex: .*position 4: The parenthesis is not closed"),
        (
            "ebnf",
            'root ::= "a" | b',
            'invalid EBNF grammar: .*line 1, column 16: Rule "b" is not defined',
        ),
        (
            "ebnf",
            'start ::= "a"',
            'invalid EBNF grammar: .*The root rule with name "root" is not found',
        ),
    ],
)
def test_an_invalid_schema_names_so_args_schema_and_the_position(
    kind: str, schema: object, reason: str
) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(ValueError, match=r"^SamplingParams\.so_args\.schema=.*: " + reason):
        SamplingParams(so_args={"schema_type": kind, "schema": schema})


@pytest.mark.parametrize(
    "so_args",
    [
        {"schema_type": "json", "schema": {"type": "object"}},
        {"schema_type": "json", "schema": '{"type": "array", "items": {"type": "integer"}}'},
        REGEX,
        {"schema_type": "ebnf", "schema": 'root ::= "yes" | "no"'},
        {"schema_type": "choice", "schema": ["a", 'quote"d', "ü"]},
    ],
)
def test_valid_so_args_are_accepted(so_args: dict) -> None:
    assert SamplingParams(so_args=so_args).so_args == so_args


class GrammarExecutor(ScriptedExecutor):
    """A model-less executor that samples 'real' tokens, so the engine compiles grammars:
    `prepare_grammar` hands out futures the test completes (or fails) when it likes.
    `completes_after`: outputs after which a structured request's grammar is complete."""

    needs_token_ids = True

    def __init__(self, num_blocks: int, completes_after: int | None = None) -> None:
        super().__init__(num_blocks)
        self.compiles: dict[str, Future] = {}
        self.completes_after = completes_after

    def prepare_grammar(self, so_args: dict) -> Future:
        return self.compiles.setdefault(so_args["schema"], Future())

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = super().execute(out)
        for sr in out.scheduled:
            n_out = sr.num_computed_tokens + sr.num_tokens - sr.num_prompt_tokens + 1
            if sr.will_sample and sr.structured and n_out == self.completes_after:
                res.completed_req_ids.add(sr.req_id)
        return res


def _engine(executor: ScriptedExecutor, **overrides: object):  # type: ignore[no-untyped-def]
    engine = make_engine(make_config(**overrides))
    engine.executor = executor
    engine.scheduler.emit_token_ids = executor.needs_token_ids
    return engine


def _drain(engine, max_steps: int = 200) -> None:  # type: ignore[no-untyped-def]
    """Step until idle; a loop that makes no progress fails instead of hanging."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError(f"unfinished after {max_steps} steps\n{diagnose_stall(engine.scheduler)}")


def _only_record(engine, req: Request):  # type: ignore[no-untyped-def]
    recs = [r for r in engine.records if r.req_id == req.request_id]
    assert len(recs) == 1, recs
    return recs[0]


def test_a_request_waits_for_its_grammar_while_the_others_run() -> None:
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    constrained = make_request("c", 3, max_tokens=2, so_args=REGEX)
    free = make_request("f", 3, max_tokens=2)
    engine.add_request(constrained)
    engine.add_request(free)
    assert constrained.awaiting_grammar
    while not free.is_finished:
        engine.step()
    assert free.status is RequestStatus.FINISHED
    assert constrained.status is RequestStatus.WAITING and constrained.times.first_scheduled is None
    ex.compiles["[0-9]{3}"].set_result("compiled")
    _drain(engine)
    assert constrained.status is RequestStatus.FINISHED and constrained.num_output_tokens == 2


def test_an_idle_engine_waits_for_a_grammar_instead_of_reporting_a_stall() -> None:
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    req = make_request("c", 3, max_tokens=1, so_args=REGEX)
    engine.add_request(req)
    timer = threading.Timer(0.05, lambda: ex.compiles["[0-9]{3}"].set_result("compiled"))
    timer.start()
    assert engine.step() == []  # waited for the compile: nothing else could run
    engine.step()
    assert req.status is RequestStatus.FINISHED


def test_a_grammar_that_fails_to_compile_rejects_its_request_alone() -> None:
    ex = GrammarExecutor(10)
    engine = _engine(ex, async_scheduling=True)
    bad = make_request("bad", 3, max_tokens=2, so_args=REGEX)
    others = [make_request(f"ok{i}", 4, max_tokens=3) for i in range(3)]
    for r in [bad, *others]:
        engine.add_request(r)
    engine.step()
    ex.compiles["[0-9]{3}"].set_exception(RuntimeError("out of memory in the compiler"))
    changed = engine.step()
    assert bad in changed  # LLM.generate learns of it from step()
    _drain(engine)
    assert bad.status is RequestStatus.REJECTED and bad.finish_reason.value == "rejected"
    assert bad.reject_reason == (
        "so_args: the grammar failed to compile: out of memory in the compiler"
    )
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == 3 for r in others)
    assert engine.scheduler.num_rejected == 1
    rec = _only_record(engine, bad)
    assert (rec.status, rec.reason) == ("rejected", bad.reject_reason)
    assert rec.finish == bad.times.finish is not None  # it ended at the step that saw it


def test_an_executor_that_samples_tokens_without_grammars_refuses_so_args() -> None:
    class NoGrammars(ScriptedExecutor):
        needs_token_ids = True

    engine = _engine(NoGrammars(10))
    req = make_request("c", 3, so_args=REGEX)
    reason = engine.add_request(req)
    assert reason == (
        "SamplingParams.so_args: the NoGrammars executor does not support structured outputs"
    )
    assert (req.status, req.reject_reason) == (RequestStatus.REJECTED, reason)
    assert _only_record(engine, req).reason == reason and not engine.has_unfinished()


def test_a_schema_compiled_before_is_ready_at_once_and_one_that_failed_rejects_at_once() -> None:
    """The executor caches compiles by schema: a request whose grammar is already compiled
    never waits; one whose schema failed before is rejected on arrival, with the error."""
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    ready: Future = Future()
    ex.compiles["[0-9]{3}"] = ready
    ready.set_result("compiled")
    failed: Future = Future()
    ex.compiles["b"] = failed
    failed.set_exception(RuntimeError("out of memory in the compiler"))
    good = make_request("good", 3, max_tokens=2, so_args=REGEX)
    bad = make_request("bad", 3, max_tokens=2, so_args={"schema_type": "regex", "schema": "b"})
    assert engine.add_request(good) is None and not good.awaiting_grammar
    error = "so_args: the grammar failed to compile: out of memory in the compiler"
    assert engine.add_request(bad) == error
    assert (bad.status, bad.reject_reason) == (RequestStatus.REJECTED, error)
    assert _only_record(engine, bad).reason == error and engine.scheduler.num_rejected == 1
    assert [sr.req_id for sr in engine.schedule().scheduled] == ["good"]


def test_a_grammar_ready_first_starts_first() -> None:
    """Compiles end in any order: a request starts when its own grammar is ready, even
    while one added before it still compiles."""
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    slow = make_request("slow", 3, max_tokens=2, so_args=REGEX)
    fast = make_request("fast", 3, max_tokens=2, so_args={"schema_type": "regex", "schema": "a"})
    engine.add_request(slow)
    engine.add_request(fast)
    ex.compiles["a"].set_result("compiled")
    engine.step()  # (stepping once nothing but `slow` is left would wait for its compile)
    assert fast.times.first_scheduled is not None and slow.awaiting_grammar
    while not fast.is_finished:
        engine.step()
    assert fast.status is RequestStatus.FINISHED and slow.awaiting_grammar
    assert slow.times.first_scheduled is None
    ex.compiles["[0-9]{3}"].set_result("compiled")
    _drain(engine)
    assert slow.status is RequestStatus.FINISHED


def _compiling_apart(engine, first: str, second: str) -> tuple[Request, Request]:  # type: ignore[no-untyped-def]
    """Two one-token structured requests added in turn, compiling apart: `first` on the
    schema "a", `second` on REGEX."""
    a = make_request(first, 3, max_tokens=1, so_args={"schema_type": "regex", "schema": "a"})
    b = make_request(second, 3, max_tokens=1, so_args=REGEX)
    engine.add_request(a)
    engine.add_request(b)
    return a, b


def test_an_idle_engine_wakes_at_the_first_compile_that_ends_not_the_last() -> None:
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    soon, late = _compiling_apart(engine, "soon", "late")
    soon_timer = threading.Timer(0.05, lambda: ex.compiles["a"].set_result("compiled"))
    # Only a safety net: the engine must not wait for this one (it would, 10 s, if it
    # waited for every compile rather than the first).
    late_timer = threading.Timer(10.0, lambda: ex.compiles["[0-9]{3}"].set_result("compiled"))
    soon_timer.start()
    late_timer.start()
    try:
        assert engine.step() == []  # waited for a compile: nothing else could run
        assert not ex.compiles["[0-9]{3}"].done()
        assert not soon.awaiting_grammar and late.awaiting_grammar
        engine.step()
        assert soon.status is RequestStatus.FINISHED
    finally:
        late_timer.cancel()
    engine.abort("late")


def test_a_step_that_finds_a_failed_compile_returns_it_before_waiting_for_others() -> None:
    """Its only other work a compile still running: the step hands the rejection back
    at once (a server tells that client now) and the next step waits. It used to wait
    first, so the rejection came back only when some other compile ended (found by the
    property suite's deep profile, whose test then hung on its watchdog)."""
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    bad, slow = _compiling_apart(engine, "bad", "slow")
    ex.compiles["a"].set_exception(RuntimeError("no grammar"))
    # A safety net: the step must not wait for this compile (it did, 10 s).
    slow_timer = threading.Timer(10.0, lambda: ex.compiles["[0-9]{3}"].set_result("compiled"))
    slow_timer.start()
    try:
        t0 = time.perf_counter()
        assert engine.step() == [bad]
        assert time.perf_counter() - t0 < 5.0 and not ex.compiles["[0-9]{3}"].done()
        assert bad.status is RequestStatus.REJECTED and slow.awaiting_grammar
    finally:
        slow_timer.cancel()
    ex.compiles["[0-9]{3}"].set_result("compiled")
    _drain(engine)
    assert slow.status is RequestStatus.FINISHED


def test_a_round_driven_through_step_events_returns_its_rejections() -> None:
    """The simulator and benchmarks/replay.py drive step_events() without step(): a round
    hands back the requests rejected meanwhile as well (it returned only the others, and
    the rejection stayed behind, unreported, until some step() drained it)."""
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    bad, slow = _compiling_apart(engine, "bad", "slow")
    ex.compiles["a"].set_exception(RuntimeError("no grammar"))
    events = engine.step_events()
    with pytest.raises(StopIteration) as done:
        while True:
            next(events)
    assert done.value.value == [bad] and bad.status is RequestStatus.REJECTED
    ex.compiles["[0-9]{3}"].set_result("compiled")
    _drain(engine)
    assert slow.status is RequestStatus.FINISHED


def test_a_request_aborted_while_its_grammar_compiles_ends_once() -> None:
    """Its compile failing afterwards neither rejects it again nor writes a second record."""
    ex = GrammarExecutor(10)
    engine = _engine(ex)
    req = make_request("c", 3, max_tokens=2, so_args=REGEX)
    other = make_request("o", 3, max_tokens=2)
    engine.add_request(req)
    engine.add_request(other)
    engine.abort("c")
    ex.compiles["[0-9]{3}"].set_exception(RuntimeError("compiler crashed"))
    assert req not in engine.step()
    _drain(engine)
    assert (req.status, req.reject_reason) == (RequestStatus.ABORTED, None)
    assert _only_record(engine, req).status == "aborted"


def test_a_complete_grammar_ends_the_request_with_stop_before_max_tokens() -> None:
    ex = GrammarExecutor(10, completes_after=3)
    engine = _engine(ex, async_scheduling=True)
    req = make_request("c", 3, max_tokens=8, so_args=REGEX)
    engine.add_request(req)
    ex.compiles["[0-9]{3}"].set_result("compiled")
    _drain(engine)
    assert req.finish_reason.value == "stop" and req.num_output_tokens == 3


def test_the_simulator_prices_masks_of_structured_requests_and_refuses_none() -> None:
    from deepinfer.model_config import load_model_config
    from sim.analytic_cost_model import AnalyticCostModel
    from sim.cost_coefficients import load_cost_coefficients
    from sim.cost_model import mask_time
    from sim.hardware import get_hardware
    from sim.simulator import simulate
    from sim.traces import Trace, TraceRequest

    engine = make_engine()  # the scripted executor samples no real tokens: nothing compiles
    req = make_request("c", 3, max_tokens=2, so_args=REGEX)
    assert engine.add_request(req) is None and not req.awaiting_grammar
    out = engine.schedule()
    assert [sr.structured for sr in out.scheduled] == [True]
    assert mask_time(out, 1e-4) == pytest.approx(1e-4)
    out.scheduled[0].draft_token_ids = [5, 6]  # each verified draft gets a mask too
    assert mask_time(out, 1e-4) == pytest.approx(3e-4)
    coeffs = load_cost_coefficients()
    cost = AnalyticCostModel(load_model_config("moonlight-16b-a3b"), get_hardware("h200"), coeffs)
    assert cost.grammar_mask_per_token_s == coeffs.cpu_grammar_mask_per_token_s > 0

    # 8 requests, 4 structured, 32 tokens each: 32 steps that sample 4 masked tokens. The
    # masks are filled while the device runs the step: hidden while shorter than it (1 ms
    # a step here), the excess on the critical path when longer, async scheduling or not (a
    # step with structured requests is launched once the step before it is applied).
    trace = Trace("t", "test", [TraceRequest(f"r{i}", 0.0, 64, 32) for i in range(8)])
    half = Trace(
        "t", "test", [replace(r, structured=i % 2 == 0) for i, r in enumerate(trace.requests)]
    )
    for overlap in (False, True):
        cfg = EngineConfig(async_scheduling=overlap)
        base = simulate(trace, cost_model="unit", engine=cfg).summary["duration_s"]
        for per_token, extra in ((1e-4, 0.0), (1e-3, 32 * 3e-3)):
            run = simulate(half, cost_model="unit", engine=cfg, grammar_mask_per_token_s=per_token)
            assert run.summary["num_completed"] == 8
            assert run.summary["duration_s"] - base == pytest.approx(extra, abs=1e-9)
            assert run.meta["grammar_mask_per_token_s"] == per_token
    assert simulate(half, cost_model="unit").summary["duration_s"] == base  # unit: no price
    assert half.with_all_structured().requests[1].structured
    # The default coefficient (50 us a token, 160k vocabulary) hides behind a Moonlight step.
    seconds = {}
    for kind in ("analytic", "profiled"):
        priced = simulate(half, cost_model=kind).summary["duration_s"]
        unmasked = simulate(half, cost_model=kind, grammar_mask_per_token_s=0.0)
        assert priced == pytest.approx(unmasked.summary["duration_s"])
        seconds[kind] = priced, simulate(trace, cost_model=kind).summary["duration_s"]
    # Their steps are launched once the step before is applied, on an idle device: the
    # profiled model prices the host part that a pipelined step hides (launch_cost).
    assert seconds["analytic"][0] == pytest.approx(seconds["analytic"][1])
    assert seconds["profiled"][0] > seconds["profiled"][1] * 1.02


def test_request_flags_follow_so_args() -> None:
    assert Request("a", [1], SamplingParams(so_args=REGEX)).structured
    assert not Request("b", [1], SamplingParams()).structured
    assert Request("c", [1], SamplingParams(), structured=True).structured


def test_simulate_cli_prices_every_request_as_structured(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--structured` with a mask far longer than a step stretches the run by the excess."""
    import json
    from pathlib import Path

    from deepinfer.entrypoints import cli

    trace = str(Path(__file__).resolve().parents[2] / "traces" / "example.jsonl")
    runs = {}
    for extra in ([], ["--structured", "--grammar-mask-us", "20000"]):
        out = tmp_path / f"r{len(extra)}.json"
        args = ["simulate", trace, "--no-progress", "--out", str(out)]
        assert cli.main([*args, "--cost-model", "analytic", *extra]) == 0
        runs[len(extra)] = json.loads(out.read_text())
    assert runs[3]["meta"]["grammar_mask_per_token_s"] == pytest.approx(0.02)
    assert runs[3]["summary"]["duration_s"] > 2 * runs[0]["summary"]["duration_s"]


def test_generate_cli_takes_so_args_as_json() -> None:
    import argparse

    from deepinfer.entrypoints.cli.sampling_options import (
        add_sampling_options,
        sampling_params_from_args,
    )

    parser = argparse.ArgumentParser()
    add_sampling_options(parser)
    args = parser.parse_args(["--so-args", '{"schema_type": "regex", "schema": "[0-9]{3}"}'])
    assert sampling_params_from_args(args).so_args == REGEX
    for bad in ("[0-9]", "{schema"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--so-args", bad])


def test_a_native_trace_takes_so_args_or_structured(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from sim.traces import TraceError, load_trace

    rows = [
        {"id": "a", "arrival": 0.0, "prompt_len": 8, "output_len": 4},
        {"id": "b", "arrival": 0.0, "prompt_len": 8, "output_len": 4, "structured": True},
        {"id": "c", "arrival": 0.0, "prompt_len": 8, "output_len": 4, "so_args": REGEX},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [r.structured for r in load_trace(path).requests] == [False, True, True]
    path.write_text(json.dumps({**rows[2], "so_args": {"schema_type": "yaml"}}))
    with pytest.raises(TraceError, match=r"t.jsonl:1: field 'so_args': expected"):
        load_trace(path)
    path.write_text(json.dumps({**rows[1], "structured": "yes"}))
    with pytest.raises(TraceError, match=r"field 'structured': expected true or false"):
        load_trace(path)

"""Every explicit example in tests/property/examples.py still reaches the state its
comment names, so one that drifts off its boundary (a default changed, the engine
around it changed) fails here by name instead of passing silently where it is used.

Each example is replayed once (tests/property/trace.py) with the flavours of the
properties that use it, and its reach is asserted from the trace: the step, the
usage, the queue, the preemption, the hit. Usage and hits come from the KVMirror,
not from the KV manager.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deepinfer.request import RequestStatus
from tests.property import examples as E
from tests.property.harness import Checker, Driver, Flavours
from tests.property.strategies import EngineCase
from tests.property.trace import TracedStep, trace_case

Trace = list[TracedStep]


def _first(trace: Trace, what: str, cond: Callable[[TracedStep], bool]) -> TracedStep:
    hit = next((t for t in trace if cond(t)), None)
    assert hit is not None, f"never reached: {what}"
    return hit


def _restart_fills_whole_blocks(d: Driver, trace: Trace) -> None:
    bs = d.case.config.block_size
    pre = _first(trace, "b preempted", lambda t: "b" in t.out.preempted_req_ids)
    assert pre.scheduled("a") is not None, "b's preemption was not for a's decode"
    back = _first(trace, "b restarts", lambda t: "b" in t.admissions and t.step > pre.step)
    n = back.admissions["b"].num_tokens
    assert n == 8 and n % bs == 0, f"b restarts with {n} tokens, not 8 (whole blocks)"
    assert d.reqs["b"].num_preemptions == 1


def _no_work_at_max_model_len_before_another(d: Driver, trace: Trace) -> None:
    limit = d.case.config.max_model_len
    assert limit is not None

    def reached(t: TracedStep) -> bool:
        running = t.before.running
        return (
            t.in_flight
            and running[:2] == ["a", "b"]
            and t.before.state["a"].computed >= limit  # a's step in flight reaches it
            and t.order() == ["b"]
        )

    _first(trace, "a at max_model_len in flight, skipped; b after it scheduled", reached)


def _no_work_at_max_model_len_third_in_running(d: Driver, trace: Trace) -> None:
    limit = d.case.config.max_model_len
    assert limit is not None

    def reached(t: TracedStep) -> bool:
        return (
            t.in_flight
            and t.before.running == ["a", "b", "c"]
            and t.before.state["c"].computed >= limit  # c's step in flight reaches it
            and t.order() == ["a", "b"]
        )

    _first(trace, "c at max_model_len in flight, after a and b, which are scheduled", reached)


def _block_filled_by_a_decode_hit_in_the_same_step(d: Driver, trace: Trace) -> None:
    bs = d.case.config.block_size

    def reached(t: TracedStep) -> bool:
        a, b = t.scheduled("a"), t.admissions.get("b")
        fills = a is not None and not a.is_prompt and a.num_computed_tokens + a.num_tokens == bs
        return fills and b is not None and b.hits == 1 and b.start == bs

    _first(trace, "a's decode fills block 0 and b starts on it in that step", reached)


def _last_decode_on_the_budgets_last_token(d: Driver, trace: Trace) -> None:
    budget = d.case.config.max_num_batched_tokens

    def reached(t: TracedStep) -> bool:
        decodes = [sr for sr in t.out.scheduled if not sr.is_prompt]
        return (
            t.before.running == ["a", "b", "c"]
            and [sr.req_id for sr in decodes] == ["a", "b", "c"]
            and sum(sr.num_tokens for sr in t.out.scheduled) == budget
        )

    _first(trace, "a, b and c decode, c on the budget's last token", reached)


def _prompt_logprobs_over_a_cached_prompt(d: Driver, trace: Trace) -> None:
    assert d.reqs["b"].sampling_params.prompt_logprobs, "b does not ask for prompt logprobs"
    start = _first(trace, "b admitted", lambda t: "b" in t.admissions)
    b = start.admissions["b"]
    whole = (b.num_tokens - 1) // d.case.config.block_size
    assert len(b.predicted) == whole > 0, f"a's prompt cached as {b.predicted} when b starts"
    assert b.start == 0 and b.hits == 0, "b's computation did not start from its first token"


def _watermark_case(d: Driver, trace: Trace) -> tuple[TracedStep, float]:
    """The first step b is waiting in, a's first decode step; its usage before b."""
    cfg = d.case.config
    t = _first(trace, "b waiting beside a's decode", lambda t: "b" in t.before.waiting)
    a = t.scheduled("a")
    assert a is not None and not a.is_prompt and t.clock == 1, (
        "b arrived elsewhere than a's first decode"
    )
    held = t.admissions["b"].held_before if "b" in t.admissions else t.held_after
    return t, held / cfg.num_gpu_blocks  # type: ignore[operator]


def _usage_above_the_watermark(d: Driver, trace: Trace) -> None:
    t, usage = _watermark_case(d, trace)
    assert usage > d.case.config.prefill_watermark, f"usage {usage} not above the watermark"
    assert t.scheduled("b") is None, "b started above the watermark"


def _usage_at_the_watermark(d: Driver, trace: Trace) -> None:
    t, usage = _watermark_case(d, trace)
    assert usage == d.case.config.prefill_watermark, f"usage {usage} is not the watermark"
    assert "b" in t.admissions, "b did not start at usage equal to the watermark"


def _prefix_hit_of_two_blocks(d: Driver, trace: Trace) -> None:
    t = _first(trace, "b admitted", lambda t: "b" in t.admissions)
    b = t.admissions["b"]
    assert b.hits == 2 and len(b.predicted) == 2, f"b starts after {b.hits} cached blocks"
    assert d.reqs["b"].num_cached_tokens == 8


def _chunked_prompt_beside_a_waiting_one(d: Driver, trace: Trace) -> None:
    def reached(t: TracedStep) -> bool:
        return t.before.in_progress == ["a"] and "b" in t.before.waiting and t.order() == ["a"]

    _first(trace, "a's prompt continued in chunks while b waits", reached)
    t = _first(trace, "b admitted", lambda t: "b" in t.admissions)
    assert t.admissions["b"].hits == 1, "b did not start on a's cached first block"


def _accepted_drafts_fill_a_block_then_preempted(d: Driver, trace: Trace) -> None:
    bs = d.case.config.block_size

    def fills(t: TracedStep) -> bool:  # b's block 0 full only once its drafts pass
        b = t.scheduled("b")
        return (
            b is not None
            and bool(b.draft_token_ids)
            and b.num_computed_tokens + 1 < bs <= b.num_computed_tokens + b.num_tokens
        )

    verify = _first(trace, "b's verify fills block 0 with drafts", fills)
    nxt = _first(trace, "the step after it", lambda t: t.step == verify.step + 1)
    assert "b" in nxt.out.preempted_req_ids, "b was not preempted right after its verify"
    back = _first(trace, "b restarts", lambda t: "b" in t.admissions and t.step > nxt.step)
    assert back.admissions["b"].hits == 1, "b's restart did not start on its block 0"


def _seven_block_holders(d: Driver, trace: Trace) -> None:
    _first(trace, "seven requests holding blocks", lambda t: len(t.before.tables) == 7)


# name -> (the flavours of the properties that run it, the state it must reach)
REACHES: dict[str, tuple[list[Callable[[], Checker]], Callable[[Driver, Trace], None]]] = {
    "RESTART_FILLS_WHOLE_BLOCKS": ([], _restart_fills_whole_blocks),
    "NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER": ([], _no_work_at_max_model_len_before_another),
    "NO_WORK_AT_MAX_MODEL_LEN_THIRD_IN_RUNNING": ([], _no_work_at_max_model_len_third_in_running),
    "LAST_DECODE_ON_THE_BUDGETS_LAST_TOKEN": ([], _last_decode_on_the_budgets_last_token),
    "BLOCK_FILLED_BY_A_DECODE_HIT_IN_THE_SAME_STEP": (
        [],
        _block_filled_by_a_decode_hit_in_the_same_step,
    ),
    "PROMPT_LOGPROBS_OVER_A_CACHED_PROMPT": ([Flavours], _prompt_logprobs_over_a_cached_prompt),
    "USAGE_ABOVE_THE_WATERMARK": ([], _usage_above_the_watermark),
    "USAGE_AT_THE_WATERMARK": ([], _usage_at_the_watermark),
    "PREFIX_HIT_OF_TWO_BLOCKS": ([], _prefix_hit_of_two_blocks),
    "CHUNKED_PROMPT_BESIDE_A_WAITING_ONE": ([], _chunked_prompt_beside_a_waiting_one),
    "SEVEN_BLOCK_HOLDERS": ([], _seven_block_holders),
    "ACCEPTED_DRAFTS_FILL_A_BLOCK_THEN_PREEMPTED": (
        [],
        _accepted_drafts_fill_a_block_then_preempted,
    ),
}


def test_every_example_has_its_reach_asserted() -> None:
    names = {n for n, v in vars(E).items() if n.isupper() and n[0] != "_" and isinstance(v, tuple)}
    assert names == set(REACHES), f"examples without a reach assertion: {names - set(REACHES)}"


@pytest.mark.parametrize("name", sorted(REACHES))
def test_the_example_reaches_the_state_it_was_written_for(name: str) -> None:
    case, workload = getattr(E, name)
    assert isinstance(case, EngineCase)
    flavours, reaches = REACHES[name]
    d, trace = trace_case(case, workload, *(f() for f in flavours))
    assert all(r.status is RequestStatus.FINISHED for r in d.reqs.values())
    reaches(d, trace)

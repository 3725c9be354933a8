"""The output processor (`TrackedCompletion`, `TrackedPrompt`) against vLLM's output
shapes and stop rule restated (docs/design.md, "Stop conditions"; vLLM's
`RequestOutput`, `CompletionOutput`, `Logprob`, `RequestMetrics`).

Requests are driven as the engine leaves them after each update: one to three tokens
a step (a speculative step accepts several) with a logprob row per token, token times,
and possibly an end (length, a stop token, a grammar that completed, an abort, or a
rejection at arrival). The reference keeps its own copy of what the engine produced
and derives every field from it, never from the request the processor trims:
- the request ends on the first token (at or after min_tokens) whose text completes a
  stop string; tokens and logprob rows after it are dropped, its finish reason is
  "stop" even when the engine had ended it on a later token, and `stop_reason` names
  the string; otherwise `stop_reason` is the stop token or EOS that ended it with
  reason "stop", and None for any other end;
- `take_new_text` streams the final text: its concatenation, once the request has
  finished, is the completion's text;
- logprobs: per position, {token_id: Logprob(logprob, rank, decoded)} of the chosen
  token then its top ones, each id once (its first entry); the cumulative logprob sums
  the chosen tokens'; both None unless requested;
- prompt logprobs: None unless requested, else None for the first prompt token and for
  every position the engine gave no row, the position's dict otherwise;
- metrics: the earliest arrival, first schedule and first token over the completions,
  the latest last token, and the latest finish once all have finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.output_processor import TrackedCompletion, TrackedPrompt
from deepinfer.outputs import Logprob, TokenLogprob
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from tests.property.strategies import at_least
from tests.property.test_detokenizer_model import PIECES, SPECIALS, ByteTokenizer, cut_at_stop

EOS = 101  # a special token: it adds no text
STOP_TOKENS = [100, 3]  # a special token and an ordinary one (" ")
ENDS = ("length", "stop token", "grammar", "abort", "rejected", "live")


def piece(t: int) -> str:
    """The text token `t` adds (special tokens are skipped)."""
    return "" if t in SPECIALS else PIECES[t]


def row_for(t: int, draw: st.DrawFn, k: int) -> list[TokenLogprob]:
    """The chosen token's entry, then its top k; the chosen token among the top ones
    repeats its own entry, as a sampler reports it."""
    chosen = TokenLogprob(t, -draw(st.integers(0, 40)) / 8, draw(st.integers(1, 4)))
    top = []
    for rank in range(1, k + 1):
        tid = draw(st.sampled_from([t, 0, 1, 2, 4]))
        top.append(chosen if tid == t else TokenLogprob(tid, -rank / 4, rank))
    return [chosen, *top]


def want_position(row: list[TokenLogprob], tokenizer: Any) -> dict[int, Logprob]:
    """vLLM's dict for one position: each token id once, with its first entry."""
    want: dict[int, Logprob] = {}
    for lp in row:
        if lp.token_id not in want:
            text = tokenizer.decode([lp.token_id]) if tokenizer is not None else None
            want[lp.token_id] = Logprob(lp.logprob, lp.rank, text)
    return want


@dataclass
class Script:
    """What the engine does to one completion: its tokens step by step, their rows and
    times, how it ends, and its other fields."""

    steps: list[list[int]]
    rows: list[list[TokenLogprob]]
    end: str
    arrival: float
    first_scheduled: float | None
    step_times: list[float]
    finish: float | None
    cached: int
    reject: str | None

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s]


@st.composite
def scripts(draw: st.DrawFn, logprobs: int | None) -> Script:
    end = draw(st.sampled_from(ENDS))
    steps = [
        [
            draw(st.sampled_from([0, 1, 2, 4, 5, 6, 7, 3, 100]))
            for _ in range(draw(st.integers(1, 3)))
        ]
        for _ in range(0 if end == "rejected" else draw(st.integers(0 if end == "abort" else 1, 5)))
    ]
    if end == "stop token":
        steps[-1][-1] = draw(st.sampled_from([EOS, *STOP_TOKENS]))
    elif end == "grammar":
        steps[-1] = [t for t in steps[-1] if t not in (EOS, *STOP_TOKENS)] or [0]
    elif end == "length" and draw(st.booleans()):
        steps[-1][-1] = EOS  # ignore_eos: an EOS that did not end it
    tokens = [t for s in steps for t in s]
    rows = [row_for(t, draw, logprobs) for t in tokens] if logprobs is not None else []
    times = sorted(draw(st.lists(st.integers(1, 50), min_size=len(steps), max_size=len(steps))))
    return Script(
        steps=steps,
        rows=rows,
        end=end,
        arrival=float(draw(st.integers(0, 5))),
        first_scheduled=(
            float(draw(st.integers(5, 8)))
            if steps or (end == "abort" and draw(st.booleans()))
            else None
        ),
        step_times=[float(t) + 8 for t in times],
        finish=float(draw(st.integers(60, 70))) if end != "live" else None,
        cached=draw(st.integers(-1, 4)),
        reject=(
            "too long"
            if end == "rejected"
            else draw(st.sampled_from([None, "failed"]))
            if end == "abort"
            else None
        ),
    )


def reference_stop(
    tokens: list[int], stops: list[str], min_tokens: int, include: bool
) -> tuple[int, str | None, str]:
    """(tokens kept, stop string, text): the first token k >= min_tokens whose text
    completes a stop string, token by token, and the text cut before the
    earliest-starting one it completes (after it with `include`)."""
    text = ""
    for k, t in enumerate(tokens, start=1):
        before, text = text, text + piece(t)
        if len(text) == len(before) or k < min_tokens:
            continue
        cut = cut_at_stop(text, len(before), stops, include)
        if cut is not None:
            return k, cut[0], cut[1]
    return len(tokens), None, text


@pytest.mark.parametrize("with_tokenizer", [True, False])
@at_least(300)
@given(data=st.data())
def test_completions_and_their_prompt_come_out_in_vllms_shapes(
    with_tokenizer: bool, data: Any
) -> None:
    """Every field of the RequestOutput and of each CompletionOutput is the reference's,
    after the engine's steps were fed one update at a time (see the module docstring)."""
    draw = data.draw
    n = draw(st.integers(1, 3), label="n")
    logprobs = draw(st.sampled_from([None, 0, 1, 2]), label="logprobs")
    prompt_lp = draw(st.sampled_from([None, 0, 2]), label="prompt_logprobs")
    min_tokens = draw(st.integers(0, 6), label="min_tokens")
    include = draw(st.booleans(), label="include_stop_str_in_output")
    stops = draw(
        st.lists(st.sampled_from(["a", "ab", "ba", "b b", " a", "aa", "x"]), max_size=2),
        label="stop",
    )
    prompt = draw(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=6), label="prompt")
    sp = SamplingParams(
        n=n,
        logprobs=logprobs,
        prompt_logprobs=prompt_lp,
        min_tokens=min_tokens,
        stop=stops,
        stop_token_ids=list(STOP_TOKENS),
        include_stop_str_in_output=include,
        max_tokens=20,
    )
    tokenizer = ByteTokenizer() if with_tokenizer else None
    plans = [draw(scripts(logprobs), label=f"completion {i}") for i in range(n)]
    prompt_rows = {
        p: row_for(prompt[p], draw, prompt_lp or 0)
        for p in range(1, len(prompt))
        if prompt_lp is not None and draw(st.booleans())
    }
    tracked = TrackedPrompt("p", "the prompt", list(prompt))
    for i, plan in enumerate(plans):
        req = Request(f"p-{i}", list(prompt), sp, arrival_time=plan.arrival, eos_token_id=EOS)
        req.num_cached_tokens = plan.cached
        req.times.first_scheduled = plan.first_scheduled
        req.prompt_logprobs = dict(prompt_rows) if i == 0 else {}
        detok = (
            IncrementalDetokenizer(
                ByteTokenizer(),
                list(prompt),
                stop=stops,
                min_tokens=min_tokens,
                include_stop_str_in_output=include,
            )
            if with_tokenizer
            else None
        )
        tracked.completions.append(TrackedCompletion(req, i, detok))

    ended_by_engine: list[int] = []  # the completions whose plan's end was applied
    for i, (plan, c) in enumerate(zip(plans, tracked.completions, strict=True)):
        req = c.req
        keep, hit, want_text = reference_stop(plan.tokens, stops, min_tokens, include)
        if not with_tokenizer:  # no text: no stop string
            keep, hit, want_text = len(plan.tokens), None, ""
        streamed = ""
        done = 0
        ended_by_string = False
        for s, (step, at) in enumerate(zip(plan.steps, plan.step_times, strict=True)):
            if ended_by_string:
                break
            req.append_output_tokens(step)
            if plan.rows:
                req.logprobs.extend(plan.rows[done : done + len(step)])
            done += len(step)
            req.times.token_times.append(at)
            req.times.first_token = req.times.first_token or at
            last = s == len(plan.steps) - 1
            if last and plan.end != "live":  # the engine ends it with this update
                end(req, plan)
                ended_by_engine.append(i)
            ended = c.feed()
            assert ended == (hit is not None and keep <= done), f"step {s}: feed said {ended}"
            if ended:
                ended_by_string = True
                if not req.is_finished:  # as LLM._run: the engine finishes it on the stop string
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
                    req.times.finish = plan.finish or 99.0
            streamed += c.take_new_text()
        if plan.end in ("abort", "rejected") and not plan.steps:
            end(req, plan)
            ended_by_engine.append(i)
            streamed += c.take_new_text()

        out = c.output(tokenizer)
        tokens = plan.tokens[:keep]
        where = f"completion {i}: {plan}, stops {stops}, min_tokens {min_tokens}: {out}"
        assert out.index == i
        assert out.token_ids == tokens, where
        assert out.text == want_text, where
        if req.is_finished:
            assert streamed == out.text, where
        if hit is not None:
            want_reason, want_stop = "stop", hit
        else:
            want_reason = {
                "length": "length",
                "stop token": "stop",
                "grammar": "stop",
                "abort": "abort",
                "rejected": "rejected",
                "live": None,
            }[plan.end]
            want_stop = tokens[-1] if plan.end == "stop token" else None
        assert (out.finish_reason, out.stop_reason) == (want_reason, want_stop), where
        if logprobs is None:
            assert (out.logprobs, out.cumulative_logprob) == (None, None), where
        else:
            rows = plan.rows[:keep]
            assert out.logprobs == [want_position(r, tokenizer) for r in rows], where
            assert out.cumulative_logprob == sum(r[0].logprob for r in rows), where

    result = tracked.output(tokenizer)
    reqs = [c.req for c in tracked.completions]
    assert (result.request_id, result.prompt, result.prompt_token_ids) == (
        "p",
        "the prompt",
        prompt,
    )
    if prompt_lp is None:
        assert result.prompt_logprobs is None
    else:
        want_plp = [None] + [
            want_position(prompt_rows[p], tokenizer) if p in prompt_rows else None
            for p in range(1, len(prompt))
        ]
        assert result.prompt_logprobs == want_plp
    assert result.outputs == [c.output(tokenizer) for c in tracked.completions]
    assert result.finished == all(
        p.end != "live" or c.req.is_finished
        for p, c in zip(plans, tracked.completions, strict=True)
    )
    assert result.num_cached_tokens == max(plans[0].cached, 0)
    rejects = [plans[i].reject for i in ended_by_engine if plans[i].reject]
    assert result.error == (rejects[0] if rejects else None)
    m = result.metrics
    assert m is not None
    assert m.arrival_time == min(p.arrival for p in plans)
    known = [p.first_scheduled for p in plans if p.first_scheduled is not None]
    assert m.first_scheduled_time == (min(known) if known else None)
    firsts = [r.times.token_times[0] for r in reqs if r.times.token_times]
    assert m.first_token_time == (min(firsts) if firsts else None)
    lasts = [r.times.token_times[-1] for r in reqs if r.times.token_times]
    assert m.last_token_time == (max(lasts) if lasts else None)
    finishes = [r.times.finish for r in reqs]
    all_done = all(r.is_finished for r in reqs)
    assert m.finished_time == (max(f for f in finishes if f is not None) if all_done else None)


def end(req: Request, plan: Script) -> None:
    """The engine's end of the request, by the plan's kind."""
    status, reason = {
        "length": (RequestStatus.FINISHED, FinishReason.LENGTH),
        "stop token": (RequestStatus.FINISHED, FinishReason.STOP),
        "grammar": (RequestStatus.FINISHED, FinishReason.STOP),
        "abort": (RequestStatus.ABORTED, FinishReason.ABORT),
        "rejected": (RequestStatus.REJECTED, FinishReason.REJECTED),
    }[plan.end]
    req.status, req.finish_reason = status, reason
    req.reject_reason = plan.reject
    req.times.finish = plan.finish

"""`deepinfer.metrics`: hand-computed cases for every figure, and its properties."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.metrics import (
    LATENCY_METRICS,
    MAX_REASON_GROUPS,
    SLO,
    STATS,
    parse_slo,
    summarize,
)
from deepinfer.records import RequestRecord, StepRecord


def finished(req_id: str, arrival: float, token_times: list[float], **kw: object) -> RequestRecord:
    """A finished request whose first token and finish are its first and last token times."""
    kw.setdefault("num_output_tokens", len(token_times))
    return RequestRecord(
        req_id=req_id,
        status="finished",
        arrival=arrival,
        num_prompt_tokens=kw.pop("num_prompt_tokens", 10),  # type: ignore[arg-type]
        first_scheduled=arrival,
        first_token=token_times[0],
        finish=token_times[-1],
        token_times=list(token_times),
        **kw,  # type: ignore[arg-type]
    )


def rejected(req_id: str, arrival: float, reason: str | None = "too long") -> RequestRecord:
    return RequestRecord(req_id, "rejected", arrival, 10_000, 0, reason=reason)


# A: arrives 0.0, 5 tokens 0.1 s apart -> TTFT 100, E2EL 500, TPOT 400/4 = 100, ITL 4 x 100.
# B: arrives 1.0, 3 tokens at 1.3, 1.5, 1.9 -> TTFT 300, E2EL 900, TPOT 600/2 = 300, ITL 200, 400.
A = finished("a", 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], num_prompt_tokens=100)
B = finished("b", 1.0, [1.3, 1.5, 1.9], num_prompt_tokens=50)


def test_ttft_e2el_tpot_statistics_match_hand_computation() -> None:
    s = summarize([A, B])
    # Two samples 100 and 300: population std 100; linear-interpolated percentiles.
    assert s["ttft_ms_mean"] == pytest.approx(200)
    assert s["ttft_ms_p50"] == pytest.approx(200)
    assert s["ttft_ms_std"] == pytest.approx(100)
    assert s["ttft_ms_p90"] == pytest.approx(280)
    assert s["ttft_ms_p99"] == pytest.approx(298)
    assert (s["ttft_ms_min"], s["ttft_ms_max"]) == pytest.approx((100, 300))
    assert s["e2el_ms_mean"] == pytest.approx(700)
    assert s["e2el_ms_p90"] == pytest.approx(500 + 0.9 * 400)
    assert s["tpot_ms_mean"] == pytest.approx(200)
    assert (s["tpot_ms_min"], s["tpot_ms_max"]) == pytest.approx((100, 300))


def test_itl_flattens_every_gap_of_every_request() -> None:
    s = summarize([A, B])
    # Gaps: 100, 100, 100, 100 (A) and 200, 400 (B) -> one list of six samples.
    assert s["itl_ms_mean"] == pytest.approx(1000 / 6)
    assert s["itl_ms_p50"] == pytest.approx(100)
    assert s["itl_ms_p90"] == pytest.approx(300)  # sorted[4.5] between 200 and 400
    assert s["itl_ms_max"] == pytest.approx(400)


def test_itl_never_spans_two_requests() -> None:
    """No gap from one request's last token to the next one's first, nor across a
    finished request without token times (a record built by hand) or with one."""
    empty = RequestRecord("e", "finished", 0.0, 10, 1, 0.0, 0.05, 0.05, [])
    one = finished("one", 2.0, [2.9])
    s = summarize([one, A, empty, one, B, one])
    assert s["itl_ms_mean"] == pytest.approx(1000 / 6)
    assert (s["itl_ms_min"], s["itl_ms_max"]) == pytest.approx((100, 400))


def test_tpot_counts_tokens_while_itl_counts_timestamps() -> None:
    """With speculative decoding a step emits several tokens: one timestamp, many tokens."""
    r = finished("s", 0.0, [0.1, 0.3, 0.5], num_output_tokens=5)
    s = summarize([r])
    assert s["tpot_ms_mean"] == pytest.approx(400 / 4)
    assert s["itl_ms_mean"] == pytest.approx(200)


def test_tpot_skips_single_token_outputs_but_ttft_counts_them() -> None:
    one = finished("one", 2.0, [2.9])
    s = summarize([A, B, one])
    assert s["tpot_ms_mean"] == pytest.approx(200)  # unchanged by the 1-token request
    assert s["ttft_ms_mean"] == pytest.approx((100 + 300 + 900) / 3)
    assert summarize([one])["tpot_ms_mean"] is None
    assert summarize([one])["itl_ms_mean"] is None


def test_rejected_and_aborted_are_counted_but_excluded_from_latency() -> None:
    aborted = RequestRecord(
        "x", "aborted", 0.5, 20, 2, 0.5, 0.6, 2.5, [0.6, 2.5], num_preemptions=3
    )
    s = summarize([A, B, aborted, rejected("r", 0.2)])
    assert (s["num_submitted"], s["num_completed"]) == (4, 2)
    assert (s["num_aborted"], s["num_rejected"]) == (1, 1)
    assert s["ttft_ms_mean"] == pytest.approx(200)
    assert s["itl_ms_max"] == pytest.approx(400)  # the aborted 1.9 s gap is not an ITL
    # The aborted request's finish still ends the run: 2.5 - 0.0.
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["total_preemptions"] == 3 and s["num_preempted_requests"] == 1


def test_throughput_over_completed_requests_and_makespan() -> None:
    s = summarize([A, B, rejected("r", 0.3)])
    assert s["duration_s"] == s["makespan_s"] == pytest.approx(1.9)
    assert s["total_input_tokens"] == 150 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(2 / 1.9)
    assert s["output_throughput"] == pytest.approx(8 / 1.9)
    assert s["total_token_throughput"] == pytest.approx(158 / 1.9)


def test_goodput_requires_every_given_slo() -> None:
    s = summarize([A, B], slo=SLO(ttft_ms=150))
    assert s["num_good"] == 1 and s["request_goodput"] == pytest.approx(1 / 1.9)
    assert s["slo"] == {"ttft_ms": 150}
    # B meets TTFT 400 but not TPOT 200; A meets both.
    assert summarize([A, B], slo=SLO(ttft_ms=400, tpot_ms=200))["num_good"] == 1
    assert summarize([A, B], slo=SLO(e2el_ms=1000))["num_good"] == 2
    assert summarize([A, B], slo=SLO(e2el_ms=499))["num_good"] == 0


def test_goodput_treats_tpot_of_a_one_token_output_as_met() -> None:
    one = finished("one", 0.0, [0.05])
    assert summarize([one], slo=SLO(tpot_ms=0.001))["num_good"] == 1


def test_goodput_is_none_without_an_slo() -> None:
    for slo in (None, SLO()):
        s = summarize([A, B], slo=slo)
        assert s["num_good"] is None and s["request_goodput"] is None


def test_rejection_reasons_are_grouped_by_numbers_shown_whole_and_capped() -> None:
    recs = [
        rejected("1", 0, "prompt of 5000 tokens exceeds cache of 4096 tokens"),
        rejected("2", 0, "prompt of 7000 tokens exceeds cache of 4096 tokens"),
        rejected("3", 0, None),
        rejected("4", 0, "x" * 500),
    ]
    reasons = summarize(recs)["rejected_reasons"]
    # One group, shown by its first reason with its numbers, never cut short.
    key = "prompt of 5000 tokens exceeds cache of 4096 tokens (and others like it)"
    assert reasons[key] == 2
    assert reasons["unspecified"] == 1
    assert reasons["x" * 500] == 1
    many = [rejected(str(i), 0, f"reason {chr(97 + i)}") for i in range(20)]
    capped = summarize(many)["rejected_reasons"]
    assert len(capped) == MAX_REASON_GROUPS and sum(capped.values()) == 20
    assert capped["other"] == 20 - (MAX_REASON_GROUPS - 1)


def test_prefix_cache_hit_rate_over_scheduled_requests() -> None:
    a = finished("a", 0.0, [0.1, 0.2], num_prompt_tokens=100, num_cached_tokens=64)
    b = finished("b", 0.0, [0.1, 0.2], num_prompt_tokens=300, num_cached_tokens=36)
    s = summarize([a, b, rejected("r", 0.0)])  # the never-scheduled prompt is not in the base
    assert s["prefix_cache_hit_rate"] == pytest.approx(100 / 400)
    assert summarize([rejected("r", 0.0)])["prefix_cache_hit_rate"] is None


def test_step_statistics() -> None:
    steps = [
        StepRecord(0, 0.1, 0.1, 1, 3, 512, 500, 1, 0.2, 0),
        StepRecord(1, 0.2, 0.1, 2, 2, 100, 0, 2, 0.4, 1),
        StepRecord(2, 0.3, 0.1, 3, 0, 300, 100, 3, 0.9, 0),
    ]
    s = summarize([A], steps)
    assert s["num_steps"] == 3
    assert s["kv_usage_mean"] == pytest.approx(0.5) and s["kv_usage_max"] == pytest.approx(0.9)
    assert s["batch_tokens_mean"] == pytest.approx(304)
    assert s["prompt_tokens_mean"] == pytest.approx(200)
    assert (s["running_mean"], s["running_max"]) == (pytest.approx(2), 3)
    assert (s["waiting_mean"], s["waiting_max"]) == (pytest.approx(5 / 3), 3)
    assert summarize([A])["num_steps"] == 0 and summarize([A])["kv_usage_mean"] is None


@pytest.mark.parametrize("records", [[], [rejected("r", 1.0)]], ids=["empty", "all-rejected"])
def test_degenerate_input_gives_the_same_keys_and_no_nan(records: list[RequestRecord]) -> None:
    s = summarize(records, steps=[], slo=SLO(ttft_ms=1))
    assert s.keys() == summarize([A, B], steps=[], slo=SLO(ttft_ms=1)).keys()
    json.dumps(s, allow_nan=False)  # raises on NaN or inf
    assert s["num_completed"] == 0 and s["duration_s"] == 0.0
    assert s["request_throughput"] == 0.0 and s["request_goodput"] == 0.0
    for m in LATENCY_METRICS:
        assert all(s[f"{m}_ms_{stat}"] is None for stat in STATS)


def test_parse_slo_accepts_cli_strings() -> None:
    assert parse_slo("ttft:500,tpot:50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo(" TTFT: 250.5 , e2el:2000, ") == SLO(ttft_ms=250.5, e2el_ms=2000)
    assert parse_slo("") == SLO()


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("ttft", "'ttft'"),
        ("ttft:500,foo:3", "'foo:3'"),
        ("tpot:fast", "'fast'"),
        ("e2el:-1", "'e2el:-1'"),
        ("ttft:nan", "'ttft:nan'"),
        ("ttft:1,ttft:2", "given twice"),
    ],
)
def test_parse_slo_names_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse_slo(text)


times = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
gaps = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def finished_records(draw: st.DrawFn) -> RequestRecord:
    arrival = draw(times)
    first = arrival + draw(gaps)
    token_times = [first]
    for g in draw(st.lists(gaps, max_size=8)):
        token_times.append(token_times[-1] + g)
    return finished("r", arrival, token_times)


@settings(max_examples=200, deadline=None)
@given(st.lists(finished_records(), min_size=1, max_size=30))
def test_percentiles_are_ordered_and_means_lie_within_min_max(recs: list[RequestRecord]) -> None:
    """For every latency metric: min <= p50 <= p90 <= p99 <= max and min <= mean <= max."""
    s = summarize(recs)
    for m in LATENCY_METRICS:
        if s[f"{m}_ms_mean"] is None:
            continue
        lo, hi = s[f"{m}_ms_min"], s[f"{m}_ms_max"]
        assert lo <= s[f"{m}_ms_p50"] <= s[f"{m}_ms_p90"] <= s[f"{m}_ms_p99"] <= hi
        assert lo <= s[f"{m}_ms_mean"] <= hi
        assert s[f"{m}_ms_std"] >= 0 and math.isfinite(s[f"{m}_ms_std"])

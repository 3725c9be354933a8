"""`sim.report`: the printed table, the JSON report and the PNG figure."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from deepinfer.metrics import SLO, summarize
from deepinfer.records import RequestRecord, StepRecord
from sim.report import downsample, format_summary, plot_report, print_summary, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_records() -> list[RequestRecord]:
    return [
        RequestRecord("a", "finished", 0.0, 100, 5, 0.0, 0.1, 0.5, [0.1, 0.2, 0.3, 0.4, 0.5]),
        RequestRecord("b", "finished", 1.0, 50, 3, 1.0, 1.3, 1.9, [1.3, 1.5, 1.9],
                      num_cached_tokens=16, num_preemptions=2),
        RequestRecord("c", "aborted", 0.5, 20, 1, 0.5, 0.6, 0.7, [0.6], finish_reason="abort"),
        RequestRecord("d", "rejected", 0.2, 99_999, 0, finish_reason="rejected",
                      reason="prompt of 99999 tokens [cap 4096] exceeds the cache"),
    ]  # fmt: skip


def make_steps(n: int) -> list[StepRecord]:
    return [
        StepRecord(i, 0.01 * (i + 1), 0.01, i % 5, (3 * i) % 7, 256, 128 * (i % 2), 4, i / n, 0)
        for i in range(n)
    ]


def test_format_summary_reads_like_the_vllm_printout() -> None:
    text = format_summary(summarize(make_records(), make_steps(10)), "Serving Benchmark Result")
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for header in ("Time to First Token", "Inter-token Latency", "End-to-end Latency", "Cache"):
        assert any(header in ln and ln.startswith("-") for ln in lines)
    assert "Successful requests:                     2" in lines
    assert "Mean TTFT (ms):                          200.00" in lines
    assert "Median TPOT (ms):                        200.00" in lines


def test_print_summary_prints_the_key_figures() -> None:
    buf = io.StringIO()
    summary = summarize(make_records(), make_steps(10), slo=SLO(ttft_ms=150))
    print_summary(summary, "sim run", console=Console(file=buf, width=200))
    out = buf.getvalue()
    for needle in (
        "sim run",
        "Rejected requests:                       1",
        "prompt of 99999 tokens [cap 4096] exceeds the cache",  # brackets and numbers survive
        "Benchmark duration (s):                  1.90",
        "Request throughput (req/s):              1.05",
        "Request goodput (req/s):                 0.53",
        "ttft <= 150 ms",
        "P99 TTFT (ms):                           298.00",
        "Mean ITL (ms):                           166.67",
        "Mean E2EL (ms):                          700.00",
        "Prefix cache hit rate (%):               9.41",  # 16 / (100 + 50 + 20)
        "Total preemptions:                       2",
        "Engine steps:                            10",
    ):
        assert needle in out, needle


def test_print_summary_of_an_empty_run_shows_not_available() -> None:
    buf = io.StringIO()
    print_summary(summarize([]), console=Console(file=buf, width=200))
    assert "Mean TTFT (ms):                          n/a" in buf.getvalue()
    assert "Request goodput" not in buf.getvalue()


@dataclass(frozen=True)
class FakeEngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256


def test_write_report_round_trips_json(tmp_path: Path) -> None:
    records, steps = make_records(), make_steps(50)
    summary = summarize(records, steps, SLO(ttft_ms=150))
    meta = {"trace": "t.json", "model": "m", "hardware": "h200", "engine": {"block_size": 16}}
    path = tmp_path / "sub" / "report.json"
    write_report(path, summary, records, steps, meta)
    doc = json.loads(path.read_text())
    assert doc["meta"] == meta
    assert doc["summary"] == summary
    assert [r["req_id"] for r in doc["requests"]] == ["a", "b", "c", "d"]
    assert all("token_times" not in r for r in doc["requests"])
    assert [StepRecord(**s) for s in doc["timeline"]] == steps


def test_write_report_includes_token_times_on_request(tmp_path: Path) -> None:
    records = make_records()
    path = tmp_path / "r.json"
    write_report(path, summarize(records), records, None, {}, include_token_times=True)
    doc = json.loads(path.read_text())
    assert [RequestRecord(**r) for r in doc["requests"]] == records
    assert doc["timeline"] == []


def test_write_report_caps_the_timeline_and_writes_strict_json(tmp_path: Path) -> None:
    steps = make_steps(12_000)
    path = tmp_path / "r.json"
    meta = {"rate": float("inf"), "engine": FakeEngineConfig(), "path": tmp_path}
    write_report(path, summarize([], steps), [], steps, meta, max_timeline_points=5000)
    text = path.read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert len(doc["timeline"]) == 5000
    assert doc["timeline"][0]["step_id"] == 0 and doc["timeline"][-1]["step_id"] == 11_999
    assert doc["meta"] == {"rate": "inf", "engine": {"block_size": 16, "max_num_seqs": 256},
                           "path": str(tmp_path)}  # fmt: skip


@pytest.mark.parametrize("n", [0, 1, 2, 5, 10, 11, 1000])
def test_downsample_keeps_ends_order_and_the_cap(n: int) -> None:
    items = list(range(n))
    out = downsample(items, 10)
    assert len(out) == min(n, 10)
    assert out == sorted(set(out))  # strictly increasing: no duplicates, order kept
    if n:
        assert out[0] == 0 and out[-1] == n - 1


@pytest.mark.parametrize("n_steps", [0, 3, 20_000])
def test_plot_report_writes_a_png(tmp_path: Path, n_steps: int) -> None:
    path = tmp_path / "plots" / "report.png"
    plot_report(path, make_records(), make_steps(n_steps), "test run")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_plot_report_handles_no_requests(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    plot_report(path, [], None, "empty")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_timelines_break_across_idle_gaps_and_not_between_busy_steps() -> None:
    from deepinfer.records import StepRecord
    from sim.report import timeline_with_breaks

    def step(i: int, end: float, dur: float, running: int = 1) -> StepRecord:
        return StepRecord(i, end, dur, running, 0, 10, 0, 1, 0.5, 0)

    busy = [step(0, 1.0, 1.0), step(1, 2.0, 1.0), step(2, 3.0, 1.0)]
    assert timeline_with_breaks(busy, [0, 1, 2]) == [1.0, 2.0, 3.0]
    # synchronous: the host schedules between steps (a gap), with requests running
    sync = [step(0, 1.0, 0.9), step(1, 2.0, 0.9), step(2, 3.0, 0.9)]
    assert timeline_with_breaks(sync, [0, 1, 2]) == [1.0, 2.0, 3.0]
    idle = [step(0, 1.0, 1.0, running=0), step(1, 11.0, 1.0), step(2, 12.0, 1.0)]  # 1 to 10
    t = timeline_with_breaks(idle, [0, 1, 2])
    assert t[0] == 1.0 and t[1] != t[1] and t[2:] == [11.0, 12.0]
    assert timeline_with_breaks(idle, [0, 2])[1] != timeline_with_breaks(idle, [0, 2])[1]


def test_the_progress_panel_counts_rejected_requests_as_ended(tmp_path) -> None:
    from sim.report import progress_curves

    recs = make_records()
    assert any(r.status == "rejected" for r in recs)
    arrivals, ended = progress_curves(recs)
    assert len(arrivals) == len(ended) == len(recs)  # the curves meet once all have ended
    rejected = next(r for r in recs if r.status == "rejected")
    assert rejected.arrival in ended
    plot_report(tmp_path / "p.png", recs, make_steps(10), "t")

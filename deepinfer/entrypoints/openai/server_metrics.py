"""The server's /metrics: Prometheus text exposition of the engine's records and state.

The engine thread observes every request that reached a terminal state (its
`RequestRecord`, the same record the simulator's report is computed from: TTFT, TPOT and
E2E as deepinfer/metrics.py defines them) and, after each step, the scheduler's
state; the HTTP side reads a consistent copy under one lock. Names follow Prometheus'
conventions (`_total` counters, `_seconds` histograms) under the `deepinfer_` prefix.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from deepinfer.records import RequestRecord

# vLLM's buckets for the same histograms, so dashboards built for it read these.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TERMINAL_STATES = ("finished", "aborted", "rejected")


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for le, n in zip((*(f"{b:g}" for b in self.buckets), "+Inf"), self.counts):
            running += n
            out.append(f'{name}_bucket{{{labels}le="{le}"}} {running}')
        out.append(f"{name}_sum{{{labels.rstrip(',')}}} {self.total}")
        out.append(f"{name}_count{{{labels.rstrip(',')}}} {self.count}")
        return out


class ServerMetrics:
    """Counters, histograms and gauges of one served model."""

    def __init__(self, model_name: str) -> None:
        # A label value escapes backslash, quote and newline (Prometheus' text format): a
        # served name is the user's (--served-model-name, a checkpoint path).
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self._labels = f'model_name="{escaped}",'
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(TERMINAL_STATES, 0)
        self.overloaded = 0  # answered 503 (--max-waiting): never queued
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens of requests that were scheduled
        self.prefix_hits = 0  # of those, served from the prefix cache
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0

    def observe(self, records: list[RequestRecord]) -> None:
        """Requests that reached a terminal state (the engine thread)."""
        with self._lock:
            for r in records:
                self.requests[r.status] = self.requests.get(r.status, 0) + 1
                self.generation_tokens += r.num_output_tokens
                if r.first_scheduled is not None:
                    self.prompt_tokens += r.num_prompt_tokens
                    self.prefix_queries += r.num_prompt_tokens
                    self.prefix_hits += r.num_cached_tokens
                if r.status != "finished" or r.first_token is None or r.finish is None:
                    continue
                self.ttft.observe(r.first_token - r.arrival)
                self.e2e.observe(r.finish - r.arrival)
                if r.num_output_tokens > 1:
                    self.tpot.observe((r.finish - r.first_token) / (r.num_output_tokens - 1))

    def set_state(self, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        """The scheduler's state after a step or a command (the engine thread)."""
        with self._lock:
            self.running, self.waiting = running, waiting
            self.kv_usage, self.preemptions = kv_usage, preemptions

    def count_overloaded(self) -> None:
        with self._lock:
            self.overloaded += 1

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lb = self._labels
        one = lb.rstrip(",")
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, values: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *values])

        with self._lock:
            metric(
                "deepinfer_requests_total",
                "counter",
                "Requests that reached a terminal state, by state.",
                [
                    f'deepinfer_requests_total{{{lb}state="{s}"}} {n}'
                    for s, n in self.requests.items()
                ],
            )
            metric(
                "deepinfer_requests_overloaded_total",
                "counter",
                "Requests answered 503 because the waiting queue was past --max-waiting.",
                [f"deepinfer_requests_overloaded_total{{{one}}} {self.overloaded}"],
            )
            for name, hist, what in (
                ("deepinfer_time_to_first_token_seconds", self.ttft, "Time to first token"),
                ("deepinfer_time_per_output_token_seconds", self.tpot, "Time per output token"),
                ("deepinfer_e2e_request_latency_seconds", self.e2e, "End-to-end latency"),
            ):
                metric(name, "histogram", f"{what} of finished requests.", hist.lines(name, lb))
            for name, kind, help_, value in (
                ("deepinfer_prompt_tokens_total", "counter", "Prompt tokens scheduled.",
                 self.prompt_tokens),
                ("deepinfer_generation_tokens_total", "counter", "Output tokens generated.",
                 self.generation_tokens),
                ("deepinfer_prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache.", self.prefix_queries),
                ("deepinfer_prefix_cache_hits_total", "counter",
                 "Prompt tokens served from the prefix cache.", self.prefix_hits),
                ("deepinfer_prefix_cache_hit_rate", "gauge",
                 "Prefix-cache hits over queries since start.",
                 self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0),
                ("deepinfer_num_preemptions_total", "counter", "Preemptions.", self.preemptions),
                ("deepinfer_num_requests_running", "gauge", "Requests running.", self.running),
                ("deepinfer_num_requests_waiting", "gauge", "Requests waiting.", self.waiting),
                ("deepinfer_kv_cache_usage_perc", "gauge",
                 "Fraction of KV blocks held by requests (1 = full).", self.kv_usage),
            ):  # fmt: skip
                metric(name, kind, help_, [f"{name}{{{one}}} {value}"])
        return "\n".join(lines) + "\n"

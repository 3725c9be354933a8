"""Per-request and per-step records, written by the engine for both executors.

Metrics (`deepinfer.metrics`) are computed from these alone, so the simulator
and the real engine report the same figures the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's life on the engine clock (seconds)."""

    req_id: str
    status: str  # "finished" | "aborted" | "rejected"
    arrival: float
    num_prompt_tokens: int
    num_output_tokens: int
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    # One timestamp per step that produced output tokens (ITL is taken between these).
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected"
    reason: str | None = None  # why it was rejected, or the error that aborted it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepRecord:
    """The engine's state at the end of one step."""

    step_id: int
    time: float  # engine clock when the step's results were applied
    duration: float  # seconds the step took (simulated or measured)
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_prompt_tokens: int  # of num_batched_tokens, those that were prompt tokens
    num_scheduled_reqs: int
    kv_usage: float  # fraction of blocks held by requests (evictable cached blocks count as free)
    num_preempted: int  # preemptions made while scheduling this step
    # drafts the drafter proposes after the step (varlen; None: num_speculative_tokens,
    # or a data-parallel round, whose ranks propose apart)
    num_proposals: int | None = None

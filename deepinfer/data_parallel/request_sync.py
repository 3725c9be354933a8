"""Keeping the front-end's copy of a request in step with the rank that serves it.

A rank sends, for each request a step changed, what changed since it last sent that
request: its state, its new output tokens, logprobs and token times (never the prompt,
nor what the front-end already has), so a step's reply stays small however long the
requests grow. The front-end applies it to its own `Request`, which is what `LLM`
detokenizes and returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.request import FinishReason, Request, RequestStatus


@dataclass
class RequestDelta:
    req_id: str
    status: RequestStatus
    finish_reason: FinishReason | None
    reject_reason: str | None
    num_computed_tokens: int
    num_preemptions: int
    num_cached_tokens: int
    first_scheduled: float | None
    first_token: float | None
    finish: float | None
    first_new: int  # index in output_token_ids of new_tokens[0]
    new_tokens: list[int]
    new_logprobs: list[Any]
    new_token_times: list[float]
    new_prompt_logprobs: dict[int, Any] = field(default_factory=dict)


class DeltaTracker:
    """On a rank: how much of each request the front-end has; forgets finished ones."""

    def __init__(self) -> None:
        # req_id -> (output tokens, logprob rows, token times, prompt logprob rows) sent
        self._sent: dict[str, tuple[int, int, int, int]] = {}

    def delta(self, req: Request) -> RequestDelta:
        n_tok, n_lp, n_times, n_plp = self._sent.get(req.request_id, (0, 0, 0, 0))
        t = req.times
        plp = {}
        if len(req.prompt_logprobs) > n_plp:  # rows arrive in position order, chunk by chunk
            plp = dict(list(req.prompt_logprobs.items())[n_plp:])
        d = RequestDelta(
            req.request_id, req.status, req.finish_reason, req.reject_reason,
            req.num_computed_tokens, req.num_preemptions, req.num_cached_tokens,
            t.first_scheduled, t.first_token, t.finish,
            n_tok, req.output_token_ids[n_tok:], req.logprobs[n_lp:], t.token_times[n_times:],
            plp,
        )  # fmt: skip
        if req.is_finished:
            self._sent.pop(req.request_id, None)
        else:
            self._sent[req.request_id] = (
                len(req.output_token_ids), len(req.logprobs), len(t.token_times),
                len(req.prompt_logprobs),
            )  # fmt: skip
        return d


def apply_delta(req: Request, d: RequestDelta) -> None:
    """Bring the front-end's `req` up to the rank's state."""
    if d.first_new != len(req.output_token_ids):
        raise RuntimeError(
            f"request {d.req_id!r}: the rank sent output tokens from index {d.first_new}, "
            f"the front-end holds {len(req.output_token_ids)}"
        )
    req.status = d.status
    req.finish_reason = d.finish_reason
    req.reject_reason = d.reject_reason
    req.num_computed_tokens = d.num_computed_tokens
    req.num_preemptions = d.num_preemptions
    req.num_cached_tokens = d.num_cached_tokens
    req.output_token_ids.extend(d.new_tokens)
    req.logprobs.extend(d.new_logprobs)
    req.prompt_logprobs.update(d.new_prompt_logprobs)
    t = req.times
    t.first_scheduled, t.first_token, t.finish = d.first_scheduled, d.first_token, d.finish
    t.token_times.extend(d.new_token_times)

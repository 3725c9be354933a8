"""From engine requests to what `LLM.generate` returns: text, logprobs, metrics.

One `TrackedPrompt` per prompt holds its `n` completions (one engine request each).
Each completion detokenizes incrementally (stop strings, held back until `min_tokens`)
and, once finished, becomes a vLLM-shaped `CompletionOutput`: text, token ids, the
cumulative logprob, per-position `{token_id: Logprob}` dicts and the stop reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.request import FinishReason, Request


@dataclass
class TrackedCompletion:
    req: Request
    index: int
    detok: Any  # IncrementalDetokenizer, or None without a tokenizer
    num_fed: int = 0
    # Text made final since the last `take_new_text` (a server streams it).
    new_text: str = ""

    def feed(self) -> bool:
        """Detokenize new tokens; True once a stop string ended the text.

        Token by token: a speculative step can add several, and the ones after the token
        that completes a stop string (accepted drafts) are dropped, as for a stop token.
        If the engine ended the request on one of those dropped tokens (its length or a
        stop token), the stop string still came first: the reason becomes stop.
        """
        req = self.req
        new = req.output_token_ids[self.num_fed :]
        if self.detok is None or not new:
            self.num_fed += len(new)
            return False
        for i, t in enumerate(new):
            self.new_text += self.detok.append([t])
            if self.detok.stop_hit is not None:
                self.num_fed += i + 1
                del req.output_token_ids[self.num_fed :]
                del req.logprobs[self.num_fed :]
                if req.is_finished:
                    req.finish_reason = FinishReason.STOP
                return True
        self.num_fed += len(new)
        return False

    def take_new_text(self) -> str:
        """The text made final since the last call; once the request has finished, the
        text the detokenizer held back too (it may have started a stop string)."""
        text, self.new_text = self.new_text, ""
        if self.detok is not None and self.req.is_finished:
            text += self.detok.flush()
        return text

    def output(self, tokenizer: Any) -> CompletionOutput:
        req = self.req
        text = ""
        if self.detok is not None:
            self.detok.flush()
            text = self.detok.text
        reason = req.finish_reason.value if req.finish_reason is not None else None
        logprobs = cumulative = None
        if req.sampling_params.logprobs is not None:
            logprobs = [_position(row, tokenizer) for row in req.logprobs]
            cumulative = sum(row[0].logprob for row in req.logprobs if row)
        return CompletionOutput(
            self.index,
            text,
            list(req.output_token_ids),
            cumulative,
            logprobs,
            reason,
            self.stop_reason(),
        )

    def stop_reason(self) -> int | str | None:
        """The stop string found, or the stop token that ended the request (vLLM's
        `stop_reason`); None otherwise (a structured output that ended with its grammar
        has none)."""
        req = self.req
        if self.detok is not None and self.detok.stop_hit is not None:
            return str(self.detok.stop_hit)
        last = req.output_token_ids[-1] if req.output_token_ids else None
        ends = {req.eos_token_id, *req.sampling_params.stop_token_ids}
        if req.finish_reason is FinishReason.STOP and last in ends:
            return last
        return None


@dataclass
class TrackedPrompt:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[TrackedCompletion] = field(default_factory=list)

    def output(self, tokenizer: Any) -> RequestOutput:
        reqs = [c.req for c in self.completions]
        errors = [r.reject_reason for r in reqs if r.reject_reason]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=_prompt_logprobs(reqs[0], len(self.prompt_token_ids), tokenizer),
            outputs=[c.output(tokenizer) for c in self.completions],
            finished=all(r.is_finished for r in reqs),
            metrics=_metrics(reqs),
            num_cached_tokens=max(reqs[0].num_cached_tokens, 0),
            error=errors[0] if errors else None,
        )


def _position(row: list[Any], tokenizer: Any) -> dict[int, Logprob]:
    """One position's [chosen, top 1..k] TokenLogprobs as vLLM's {token_id: Logprob}."""
    out: dict[int, Logprob] = {}
    for lp in row:
        if lp.token_id not in out:
            decoded = tokenizer.decode([lp.token_id]) if tokenizer is not None else None
            out[lp.token_id] = Logprob(lp.logprob, lp.rank, decoded)
    return out


def _prompt_logprobs(
    req: Request, n: int, tokenizer: Any
) -> list[dict[int, Logprob] | None] | None:
    """vLLM's shape: None for the first prompt token (nothing predicts it), then one
    {token_id: Logprob} per position."""
    if req.sampling_params.prompt_logprobs is None:
        return None
    rows = req.prompt_logprobs
    return [None] + [_position(rows[p], tokenizer) if p in rows else None for p in range(1, n)]


def _metrics(reqs: list[Request]) -> RequestMetrics:
    times = [r.times for r in reqs]

    def first(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    def last(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    return RequestMetrics(
        arrival_time=min(t.arrival for t in times),
        first_scheduled_time=first([t.first_scheduled for t in times]),
        first_token_time=first([t.first_token for t in times]),
        last_token_time=last([t.token_times[-1] if t.token_times else None for t in times]),
        finished_time=last([t.finish for t in times]) if all(r.is_finished for r in reqs) else None,
    )

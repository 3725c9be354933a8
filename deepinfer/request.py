"""Request: one generation tracked by token counts.

A request has no prefill phase: each step the scheduler gives it some tokens,
and `num_computed_tokens` catches up with `num_tokens`. The prompt may be a
plain list of token ids or any `PromptTokens` (the simulator's synthetic
prompts describe their content without materialising millions of ids).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from deepinfer.sampling_params import SamplingParams


@runtime_checkable
class PromptTokens(Protocol):
    """A prompt that can describe a span of its content without listing it.

    `content_key(start, end)` must return equal keys exactly when the token ids
    of the two spans are equal; prefix caching hashes these keys, a run of blocks'
    at a time (`block_keys`).
    """

    def __len__(self) -> int: ...

    def content_key(self, start: int, end: int) -> Hashable: ...

    def block_keys(self, first: int, stop: int, block_size: int) -> list[Hashable]:
        """`content_key` of each span [b * block_size, (b + 1) * block_size), b in
        [first, stop)."""
        ...

    def token_ids(self, start: int, end: int) -> list[int]: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # A chunked prefill between chunks: it holds the blocks of its whole prompt and
    # sits at the very front of waiting until its last chunk makes it RUNNING.
    PREFILLING = "prefilling"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in waiting after losing its blocks
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


# Made once: a member read off the enum's class goes through its metaclass, and
# `is_terminal` runs for every request of every step.
_TERMINAL = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    REJECTED = "rejected"


@dataclass
class RequestTimes:
    """Timestamps on the engine's clock (seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    # One entry per step that produced output tokens (a speculative step may
    # produce several tokens at once, as one streamed chunk would).
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None


_uid = itertools.count()


class Request:
    """One request and everything the scheduler knows about it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | PromptTokens,
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        *,
        priority: int = 0,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        structured: bool | None = None,
    ) -> None:
        self.request_id = request_id
        self.uid = next(_uid)  # tie-breaker for priority ordering
        self.prompt: Sequence[int] | PromptTokens = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.priority = priority
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        # Sampling is constrained by a grammar (so_args); the simulator sets it from a
        # trace to price the mask without any schema.
        self.structured = (
            self.sampling_params.so_args is not None if structured is None else structured
        )
        # Its grammar is still compiling: it stays in waiting and the scheduler passes it
        # over (EngineCore clears this when the compile is done).
        self.awaiting_grammar = False
        # Its prompt's KV is on its way to this (decode) engine: the scheduler reserves
        # its blocks when it would start it, then passes it over until the KV has arrived
        # (Scheduler.kv_arrived).
        self.awaiting_kv = False
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens scheduled whose sampled value is not known yet (async scheduling).
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step
        self.spec_confidences: list[float] = []  # the drafter's probability of each
        # The running mean, by position j, of c_1 * ... * c_j (spec_policy.smooth_chances):
        # what varlen reads when the next drafts come from the step in flight, unseen. It
        # outlives a preemption: it describes the request's text, not its drafts.
        self.spec_chance_means: list[float] = []
        self.num_pending_drafts = 0  # drafts scheduled whose verification is not back yet
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.reject_reason: str | None = None  # why rejected, or the error that aborted it
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.max_computed_tokens = 0  # highest num_computed_tokens ever reached
        self.block_hashes: list[int] = []  # chain hashes of its full blocks, grown lazily
        self.logprobs: list[Any] = []  # per output token, when sampling_params.logprobs is set
        self.prompt_logprobs: dict[int, Any] = {}  # prompt position -> its logprob rows
        self.times = RequestTimes(arrival=arrival_time)

    @property
    def arrival_time(self) -> float:
        return self.times.arrival

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_terminal

    def content_key(self, start: int, end: int) -> Hashable:
        """A key equal for equal token spans (used by prefix-cache hashing)."""
        n = self.num_prompt_tokens
        if end <= n:
            return _prompt_key(self.prompt, start, end)
        if start >= n:
            return tuple(self.output_token_ids[start - n : end - n])
        head = _prompt_key(self.prompt, start, n)
        tail = tuple(self.output_token_ids[: end - n])
        if isinstance(head, tuple) and isinstance(self.prompt, (list, tuple, range)):
            # Token ids either side: the same ids as a later prompt that repeats them.
            return head + tail
        return (head, tail)

    def block_keys(self, first: int, stop: int, block_size: int) -> list[Hashable]:
        """`content_key` of each block [b * block_size, (b + 1) * block_size), b in
        [first, stop): one call for the run of blocks that prefix-cache hashing covers."""
        n, bs = self.num_prompt_tokens, block_size
        keys: list[Hashable] = []
        in_prompt = min(stop, n // bs)  # the blocks wholly in the prompt end here
        if first < in_prompt:
            prompt = self.prompt
            if isinstance(prompt, (list, tuple, range)):  # (as _prompt_key)
                keys = [tuple(prompt[s : s + bs]) for s in range(first * bs, in_prompt * bs, bs)]
            else:
                keys = prompt.block_keys(first, in_prompt, bs)  # type: ignore[union-attr]
            first = in_prompt
        outputs = self.output_token_ids
        for s in range(first * bs, stop * bs, bs):
            if s >= n:
                keys.append(tuple(outputs[s - n : s - n + bs]))
            else:  # the block that holds the prompt's end and the first outputs
                keys.append(self.content_key(s, s + bs))
        return keys

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) over prompt + output."""
        n = self.num_prompt_tokens
        out: list[int] = []
        if start < n:
            out.extend(_prompt_ids(self.prompt, start, min(end, n)))
        if end > n:
            out.extend(self.output_token_ids[max(start - n, 0) : end - n])
        return out

    def append_output_tokens(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


def _prompt_key(prompt: Sequence[int] | PromptTokens, start: int, end: int) -> Hashable:
    # Plain sequences first: a Protocol isinstance check is slow on the hot path.
    if isinstance(prompt, (list, tuple, range)):
        return tuple(prompt[start:end])
    return prompt.content_key(start, end)  # type: ignore[union-attr]


def _prompt_ids(prompt: Sequence[int] | PromptTokens, start: int, end: int) -> list[int]:
    if isinstance(prompt, (list, tuple, range)):
        return list(prompt[start:end])
    return prompt.token_ids(start, end)  # type: ignore[union-attr]

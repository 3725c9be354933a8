"""The typed boundaries of a step: SchedulerOutput in, ModelRunnerOutput out.

Plain dataclasses of ints and lists (no tensors), so a simulated or remote
executor can consume them, plus the user-facing RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams

# A draft the scheduler cannot know yet (async scheduling: the step that proposes it is
# still in flight); the executor verifies its own latest proposal in its place.
DRAFT_PLACEHOLDER = -1


@dataclass
class ScheduledRequest:
    """One request's work in one step."""

    req_id: str
    num_tokens: int  # tokens to compute this step (prompt chunk, 1 decode token, or 1 + drafts)
    num_computed_tokens: int  # tokens already in the KV cache before this step (context length)
    is_prompt: bool  # the step computes prompt tokens (a prefill chunk)
    will_sample: bool  # the step ends at the request's last known token, so a token is sampled
    new_block_ids: list[int]  # blocks appended to the request's block table this step
    # Length of the request's table before new_block_ids (None: unchanged since the last
    # step). Shorter than the executor's copy after rejected drafts' slots were freed.
    num_prior_blocks: int | None = None
    # Whole block table, sent when the executor holds no state for the request
    # (first schedule, or resumed after preemption); None otherwise.
    block_table: list[int] | None = None
    # Token ids of positions [num_computed_tokens, num_computed_tokens + num_tokens),
    # filled only for executors that need them (the simulator does not). Under
    # async scheduling the last output token may be unknown yet: it is then
    # omitted and the executor uses the token it sampled itself.
    token_ids: list[int] | None = None
    # Drafts to verify (end of the step); DRAFT_PLACEHOLDER entries (async scheduling) are
    # the executor's own proposals from the step in flight, and are not in token_ids.
    # Such a step's num_computed_tokens assumes every draft in flight is accepted: the
    # executor starts it after the tokens it really accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    sampling_params: SamplingParams | None = None  # sent with block_table
    # Token ids of positions [0, num_computed_tokens), sent with block_table to executors
    # that need token ids: a resumed request's prefix-cache hit skips tokens whose ids the
    # sampler still needs (penalties, seeded sampling).
    prior_token_ids: list[int] | None = None
    # The whole prompt, sent with block_table to requests that asked for prompt logprobs
    # (a chunk's last row predicts the next chunk's first token).
    prompt_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    # Sent with block_table: its leading blocks whose content was there before the step
    # (prefix-cache hits, tier loads). A decode engine's request counts more tokens as
    # computed than these hold: the rest of its prompt comes by KV import.
    num_cached_blocks: int = 0
    # Its sampling is constrained by a grammar (so_args): the simulator prices the mask.
    structured: bool = False


@dataclass(frozen=True, slots=True)
class KVLoad:
    """A prefix block read back from a lower KV tier (deepinfer/kv_cache/tiers.py) into an
    HBM block, before the step that carries it runs."""

    tier: str  # "host" or "store"
    block_id: int  # the HBM block it is loaded into
    block_hash: int  # the content, by chain hash
    slot: int  # where the tier holds it (TierLRU.slot)


@dataclass(frozen=True, slots=True)
class KVSave:
    """A prefix block HBM evicted, written down to a lower KV tier: the executor copies
    HBM block `block_id` (its content as it stands before the step that carries the save
    runs: that step may overwrite it) to the tier's `slot`."""

    tier: str  # "host" or "store"
    block_id: int  # the HBM block it is copied from
    block_hash: int  # the content, by chain hash
    slot: int  # where the tier holds it from now on (TierLRU.slot)


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    # Requests that finished, aborted or were preempted since the last step:
    # the executor drops whatever it holds for them.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Drafts per request the drafter proposes after this step (varlen: what the next
    # step may verify, spec_policy.proposals); None: the engine's num_speculative_tokens.
    num_proposals: int | None = None
    # Blocks this step loads from the lower KV tiers first (its requests' prefix hits
    # there); empty without tiers.
    kv_loads: tuple[KVLoad, ...] = ()
    # Blocks this schedule's allocations evicted from HBM into a lower tier (each first
    # written there; a block the tier held already is not listed), in eviction order;
    # empty without tiers. A load and a save of one slot in one step: the load reads the
    # save's block where their hashes match (the block was evicted, then found again),
    # else the slot as it was before the step (tiers.py: loads read first).
    kv_saves: tuple[KVSave, ...] = ()
    # Requests whose prompt's KV is on its way (role decode, `Request.awaiting_kv`) and
    # whose blocks this schedule reserved: the sender may send it now. They are not in
    # `scheduled`: each is, once its KV has arrived.
    kv_reserved: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprob:
    """A token's logprob as the executor reports it (rank 1: the most likely token)."""

    token_id: int
    logprob: float
    rank: int


@dataclass
class ModelRunnerOutput:
    # req_id -> token ids sampled this step: one, or 1 + accepted drafts; absent
    # (or empty) for a prompt chunk that does not end the prompt.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> next draft proposal (speculation).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the drafter's probability of each draft (its confidence).
    draft_confidences: dict[str, list[float]] = field(default_factory=dict)
    # req_id -> per sampled token: the chosen token's logprob plus the top ones.
    logprobs: dict[str, list[list[TokenLogprob]]] | None = None
    # req_id -> prompt position -> [that prompt token's logprob, then the top ones]
    prompt_logprobs: dict[str, dict[int, list[TokenLogprob]]] | None = None
    # Structured outputs whose grammar is complete after this step's tokens: it accepts
    # them and allows nothing more (they finish with reason "stop").
    completed_req_ids: set[str] = field(default_factory=set)


# ---- user-facing outputs (vLLM's names and shapes) -----------------------------------


@dataclass
class Logprob:
    """One token's entry in a position's logprobs dict (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1: the most likely token
    decoded_token: str | None = None


# Per output position: token id -> Logprob (the sampled token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """When things happened to a request, on the engine's clock (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs (with logprobs)
    logprobs: SampleLogprobs | None
    finish_reason: str | None  # "stop", "length", "abort", "rejected" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why it was rejected, or the error that aborted it

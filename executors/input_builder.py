"""How one SchedulerOutput becomes one flattened batch of inputs (`InputBuilder`).

`InputBuilder.collect` checks the block tables, records each request's history and
flattens the scheduled rows (the absorbed decode rows first) into a HostBatch of lists;
`to_device` moves them with one copy (the eager path: graphs load the lists into their
own buffers). Under async scheduling a token that the step in flight samples is not known
yet: its row is `deferred` and filled in on the device (a verify step's drafts too:
executors/spec_chain.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.errors import RequestFailed
from deepinfer.outputs import DRAFT_PLACEHOLDER, ScheduledRequest
from executors import prompt_logprobs
from executors.attention import AttentionMetadata, build_attention_metadata
from executors.request_states import RequestState, RequestStates
from executors.step_handle import PendingStep
from executors.structured_outputs import GrammarViolation


@dataclass
class _Segment:
    """Consecutive rows of one request in a step, all on one attention path."""

    req_id: str
    start: int  # position of the first row
    tokens: list[int]
    absorbed: bool  # the absorbed (decode) MLA path
    samples: bool  # ends with the request's sampled rows
    drafts: list[int]  # drafts verified at its end (when it samples)
    deferred: int | None = None  # index of the token the step in flight samples
    chained: int | None = None  # its request's index in the verify step in flight: every
    # token comes from that step, and its rows lie behind by the drafts it rejected


@dataclass
class HostBatch:
    """One step's inputs as host lists, one entry per segment of a request's rows (one per
    request, except in batch-invariant mode: `InputBuilder._segments`); absorbed first."""

    req_ids: list[str]
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B][blocks]
    num_decode: int  # requests [0, num_decode) take the absorbed path
    logits_indices: list[int]  # [N] batch rows whose logits are sampled
    # req_id -> (first row in logits_indices, number of rows, drafts to verify)
    sample_rows: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)
    prompt_rows: list[prompt_logprobs.PromptRow] = field(default_factory=list)
    # (row of input_ids, index into the step in flight's `tokens`): ids sampled by the
    # step still running, filled in on the device (input_ids holds 0 there).
    deferred: list[tuple[int, int]] = field(default_factory=list)
    # Per segment, its request's index in the verify step in flight's `Chained.rejected`,
    # whose last entry (0) serves requests it did not verify; None: no request is chained.
    rejected_index: list[int] | None = None


@dataclass
class Batch:
    """One step's flattened inputs on the device (the eager path)."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    logits_indices: torch.Tensor  # [N] batch rows whose logits are sampled
    sample_rows: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


class InputBuilder:
    """Builds each step's inputs from the SchedulerOutput and the runner's request states
    (whose histories and computed counts it advances as it reads the step).

    decode_max_query_len: queries this short (a decode token plus drafts) take the
    absorbed MLA path; in batch-invariant mode the output positions do instead."""

    def __init__(
        self,
        requests: RequestStates,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        batch_invariant: bool,
        decode_max_query_len: int,
        max_drafts: int,
    ) -> None:
        self.requests = requests
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.batch_invariant = batch_invariant
        self.decode_max_query_len = decode_max_query_len
        self.max_drafts = max_drafts

    def _absorbed(self, sr: ScheduledRequest, start: int) -> bool:
        """Whether the step's rows of `sr` (starting at position `start`) take the absorbed
        (decode) attention path: queries of at most 1 + k tokens. In batch-invariant mode
        exactly the output positions do, however many: a prompt's last chunk (or the one
        uncached token of a prefix hit) is as short as a decode step, yet must be computed
        as the unchunked prompt computes it, by the prefill path."""
        if self.batch_invariant:
            return start >= self.requests[sr.req_id].num_prompt_tokens
        return sr.num_tokens <= self.decode_max_query_len

    def _segments(
        self,
        sr: ScheduledRequest,
        start: int,
        tokens: list[int],
        drafts: list[int],
        drafting: bool,
    ) -> list[_Segment]:
        """The step's rows of `sr`: one segment, or in batch-invariant mode two when they
        cross the prompt's end (a preempted request recomputing its prompt and outputs):
        the prompt positions by the prefill path, the outputs by the absorbed one, as they
        were first computed. (Not when `drafting`: the drafter reads one entry per
        request.)"""
        cut = self.requests[sr.req_id].num_prompt_tokens - start
        if self.batch_invariant and not drafting and 0 < cut < len(tokens):
            return [
                _Segment(sr.req_id, start, tokens[:cut], False, False, []),
                _Segment(sr.req_id, start + cut, tokens[cut:], True, sr.will_sample, drafts),
            ]
        return [
            _Segment(sr.req_id, start, tokens, self._absorbed(sr, start), sr.will_sample, drafts)
        ]

    def collect(
        self,
        scheduled: list[ScheduledRequest],
        prev: PendingStep | None = None,
        *,
        drafting: bool,
    ) -> HostBatch:
        """Check the block tables, record history, flatten to lists, absorbed rows first.
        prev: the step in flight, unread (ModelRunner.launch): the tokens it samples are
        deferred. drafting: the runner's drafter reads this step (one segment a request)."""
        starts = {r.req_id: self._start(r) for r in scheduled}
        failed = self._check(scheduled)
        if failed:  # before any device work: the engine aborts these and requeues the rest
            raise RequestFailed(failed)
        segments: list[_Segment] = []
        for sr in scheduled:
            state = self.requests[sr.req_id]
            if prev is not None and prev.chain is not None and sr.req_id in prev.rows:
                # Newest token and drafts on the device (speculative_decoder.chains),
                # nothing to record yet.
                start = starts[sr.req_id]
                state.num_computed = start + sr.num_tokens
                n_drafts = sr.num_tokens - 1
                segments.append(_Segment(
                    sr.req_id, start, [0] * sr.num_tokens, self._absorbed(sr, start), True,
                    [0] * n_drafts, chained=prev.rows[sr.req_id],
                ))  # fmt: skip
                continue
            drafts = self._drafts(sr, state)
            deferred = (
                prev is not None
                and sr.req_id in prev.rows
                and not drafts
                and len(sr.token_ids or ()) == sr.num_tokens - 1
            )
            tokens = self._step_tokens(sr, state, drafts, deferred)
            start = starts[sr.req_id]
            end = start + sr.num_tokens
            state.num_computed = end  # less the rejected drafts, once verified
            # (a deferred token is recorded when prev's result is read)
            state.record_history(start, tokens[: len(tokens) - len(drafts) - deferred])
            if sr.will_sample and state.grammar is not None:
                # Outputs before the sampled position (drafts aside): the matcher has them.
                n_out = max(0, end - len(drafts) - state.num_prompt_tokens)
                try:
                    state.grammar.catch_up(state.sampling.output_token_ids[:n_out])
                except GrammarViolation as e:
                    raise RequestFailed({sr.req_id: str(e)}) from None
            if deferred:  # (no drafts, so it is one segment's last token)
                segments.append(_Segment(
                    sr.req_id, start, tokens, self._absorbed(sr, start), sr.will_sample, [],
                    deferred=len(tokens) - 1,
                ))  # fmt: skip
                continue
            segments += self._segments(sr, start, tokens, drafts, drafting)
        segments.sort(key=lambda seg: not seg.absorbed)  # stable: otherwise in step order
        rejected_index = None
        if any(seg.chained is not None for seg in segments):
            assert prev is not None and prev.chain is not None
            none = len(prev.rows)  # the zero past prev's requests
            rejected_index = [none if seg.chained is None else seg.chained for seg in segments]
        host = HostBatch(
            req_ids=[seg.req_id for seg in segments], input_ids=[], positions=[],
            query_lens=[len(seg.tokens) for seg in segments],
            context_lens=[seg.start for seg in segments],
            block_tables=[self.requests[seg.req_id].block_table for seg in segments],
            num_decode=sum(seg.absorbed for seg in segments),
            logits_indices=[], rejected_index=rejected_index,
        )  # fmt: skip
        for seg in segments:
            rid, tokens, start = seg.req_id, seg.tokens, seg.start
            state = self.requests[rid]
            if seg.samples:  # the request's sampled rows end its last segment
                n = 1 + len(seg.drafts)
                host.sample_rows[rid] = (len(host.logits_indices), n, seg.drafts)
                last = len(host.input_ids) + len(tokens)
                host.logits_indices.extend(range(last - n, last))
            params = state.sampling.params
            if state.prompt_ids is not None and params.prompt_logprobs is not None:
                host.prompt_rows += prompt_logprobs.chunk_rows(
                    rid, state.prompt_ids, start, start + len(tokens), len(host.input_ids),
                    params.prompt_logprobs)  # fmt: skip
            if seg.deferred is not None:
                assert prev is not None
                host.deferred.append((len(host.input_ids) + seg.deferred, prev.rows[rid]))
            if seg.chained is not None:
                assert prev is not None and prev.chain is not None
                w = prev.chain.width
                host.deferred += [
                    (len(host.input_ids) + j, seg.chained * w + j) for j in range(len(tokens))
                ]
            host.input_ids.extend(tokens)
            host.positions.extend(range(start, start + len(tokens)))
        return host

    def _check(self, scheduled: list[ScheduledRequest]) -> dict[str, str]:
        """Why each request's work cannot run (bad token ids, a table too short), so that
        one request's bad input fails before the model (where it could poison the device
        for every request) and ends that request alone."""
        vocab = self.vocab_size
        failed = {}
        for sr in scheduled:
            state = self.requests[sr.req_id]
            end = sr.num_computed_tokens + sr.num_tokens
            if len(state.block_table) * self.block_size < end:
                failed[sr.req_id] = (
                    f"{len(state.block_table)} blocks of {self.block_size} cannot hold {end} tokens"
                )
            bad = [t for t in sr.token_ids or () if not 0 <= t < vocab]
            if bad:
                failed[sr.req_id] = f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
        return failed

    def metadata(self, host: HostBatch, device: torch.device) -> AttentionMetadata:
        """The step's attention metadata, built on `device` (the CPU: moved later)."""
        return build_attention_metadata(
            host.query_lens, host.context_lens, host.block_tables, self.block_size,
            host.num_decode, device,
        )  # fmt: skip

    def to_device(self, host: HostBatch) -> Batch:
        """The step's inputs on the device, in one host-to-device copy."""
        lists = (host.input_ids, host.positions, host.logits_indices)
        md, (ids, positions, indices) = self.metadata(host, torch.device("cpu")).moved_with(
            self.device, [torch.tensor(x, dtype=torch.int64) for x in lists]
        )
        return Batch(
            req_ids=host.req_ids, input_ids=ids, positions=positions, md=md,
            logits_indices=indices, sample_rows=host.sample_rows,
        )  # fmt: skip

    def _start(self, sr: ScheduledRequest) -> int:
        """Where the step's tokens start. Under async scheduling the scheduler assumed the
        drafts of the step in flight were all accepted; the runner knows how many were."""
        state = self.requests[sr.req_id]
        ahead = sr.num_computed_tokens - state.num_computed
        if not 0 <= ahead <= self.max_drafts:  # at most the drafts of the step in flight
            raise ValueError(
                f"request {sr.req_id!r}: scheduled at {sr.num_computed_tokens} computed "
                f"tokens, but {state.num_computed} are in the cache"
            )
        return state.num_computed

    @staticmethod
    def _drafts(sr: ScheduledRequest, state: RequestState) -> list[int]:
        """The drafts to verify: placeholders are the runner's own latest proposal (padded
        with its last token when it proposed fewer: any draft keeps verification exact)."""
        drafts = list(sr.draft_token_ids)
        if drafts and drafts[0] == DRAFT_PLACEHOLDER:
            pad = state.last_token if state.last_token is not None else 0
            own = state.drafts[: len(drafts)]
            drafts = own + [pad] * (len(drafts) - len(own))
        return drafts

    @staticmethod
    def _step_tokens(
        sr: ScheduledRequest, state: RequestState, drafts: list[int], deferred: bool = False
    ) -> list[int]:
        """Token ids of the step's positions, drafts last.

        Under async scheduling the newest sampled token may be unknown to the scheduler:
        it is then missing just before the drafts and the runner's own sample fills in
        (0 when `deferred`: the step in flight samples it, and the device fills it in).
        """
        tokens = list(sr.token_ids or [])
        if sr.draft_token_ids[:1] == [DRAFT_PLACEHOLDER]:
            tokens += drafts  # the scheduler sent none of them
        if len(tokens) == sr.num_tokens - 1 and (deferred or state.last_token is not None):
            last = 0 if deferred else state.last_token
            tokens.insert(len(tokens) - len(drafts), last)
        if len(tokens) != sr.num_tokens:
            raise ValueError(
                f"request {sr.req_id!r}: {sr.num_tokens} tokens scheduled but "
                f"{len(sr.token_ids or [])} token ids sent"
            )
        return tokens

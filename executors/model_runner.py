"""ModelRunner: SchedulerOutput -> one flattened model forward -> sampled tokens.

Keeps per-request state keyed by req_id (block table, sampling state, the last
sampled token). A request's whole block table arrives when the runner holds no
state for it (first schedule, or resumed after preemption: the state is then
rebuilt); afterwards only `new_block_ids` are appended. State is dropped for
finished and preempted requests. A structured request (so_args) also holds a grammar
matcher: its mask is applied to its logits before sampling (executors/structured_outputs.py).

Speculation: a request scheduled with k drafts is scored on 1 + k rows and verified
by executors/spec_decode.py (greedy prefix match, or lossless rejection sampling);
afterwards the model's MTP layer proposes the next drafts (executors/mtp_drafter.py),
which go back in ModelRunnerOutput with their confidences. A step without seeds,
penalties, prompt logprobs or grammars verifies and drafts on the device
(`_verifies_on_device`) and is read back with one copy.

`launch` queues a step and returns its handle (executors/step_handle.py) without
waiting for the device. Under async scheduling the engine launches step N+1 before it
reads step N: a request whose newest token N samples takes it from N's device tensor
(`HostBatch.deferred`), so nothing waits; after a verify step on the device it takes
its drafts too, and its rows move back by the drafts N rejected (executors/spec_chain.py).
A step that needs N's tokens on the host (grammars, prompt logprobs, a sampler setting
that reads the request's history, drafts verified on the host) cannot overlap
(`can_overlap`): the engine launches it once N is applied, and a launch that finds N
unread anyway reads N first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.config import EngineConfig
from deepinfer.errors import RequestFailed
from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)
from deepinfer.sampling_params import SamplingParams
from executors import prompt_logprobs
from executors.attention import AttentionMetadata, build_attention_metadata
from executors.batch_invariant import set_batch_invariant
from executors.cuda_graphs import DecodeGraphs, default_capture_sizes
from executors.host_copy import PackedCopy, to_device
from executors.kv_cache import PagedKVCache
from executors.models.deepseek import DeepseekForCausalLM
from executors.mtp_drafter import DeviceDraftInput, Drafts, MTPDrafter
from executors.piecewise_graphs import PiecewiseGraphs, default_token_buckets
from executors.sampler import (
    DeviceSample,
    LogprobTensors,
    SamplingState,
    logprob_tensors,
    raw_logprobs,
    sample_on_device,
    sample_tokens,
)
from executors.spec_chain import Chained, Shift, StepBuffers, rows_by_sequence
from executors.spec_decode import (
    DeviceVerify,
    VerifyRequest,
    history_free,
    verify,
    verify_on_device,
)
from executors.step_handle import PendingStep, StepResult
from executors.structured_outputs import (
    GrammarCompiler,
    GrammarState,
    GrammarViolation,
    TokenMasks,
)


@dataclass
class RequestState:
    block_table: list[int]
    sampling: SamplingState
    num_prompt_tokens: int
    last_token: int | None = None  # last sampled token (used when async scheduling omits it)
    prompt_ids: list[int] | None = None  # the whole prompt, when prompt logprobs are wanted
    num_computed: int = 0  # tokens in the KV cache (the scheduler's count may run ahead)
    drafts: list[int] = field(default_factory=list)  # the drafter's latest proposal
    grammar: GrammarState | None = None  # its so_args matcher


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
    request, except in batch-invariant mode: `ModelRunner._segments`); absorbed first."""

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
    # Per request, its index in the verify step in flight's `Chained.rejected`, whose
    # last entry (0) serves requests it did not verify; None: no request is chained.
    behind: list[int] | None = None


@dataclass
class Batch:
    """One step's flattened inputs on the device (the eager path)."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    logits_indices: torch.Tensor  # [N] batch rows whose logits are sampled
    sample_rows: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_cache: PagedKVCache,
        engine_config: EngineConfig,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.eos_token_id = eos_token_id
        self.vocab_size = model.config.vocab_size
        # Queries this short (a decode token plus drafts) take the absorbed MLA path.
        self.decode_max_query_len = 1 + engine_config.num_speculative_tokens
        # Batch-invariant mode: the model's kernels are switched into it, and a step takes
        # the absorbed path only for output positions (`_absorbed`).
        self.batch_invariant = engine_config.batch_invariant
        set_batch_invariant(
            model,
            self.batch_invariant,
            max_model_len or engine_config.max_model_len or model.config.max_position_embeddings,
        )
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_drafts = engine_config.num_speculative_tokens
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        # Longest sequence a graph's block table must hold.
        self.max_model_len = min(
            max_model_len or engine_config.max_model_len or 1 << 62,
            kv_cache.num_blocks * kv_cache.block_size,
        )
        self.generator = torch.Generator(self.device).manual_seed(engine_config.seed)
        self.requests: dict[str, RequestState] = {}
        self._pending: PendingStep | None = None  # the latest step launched and not read
        self.num_chained_steps = 0  # steps that chained on a verify step in flight
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        # Query length -> its verify graphs: 1 + k, and 1 + L for the shorter uniform
        # steps that varlen (spec_policy) and trimmed drafts schedule.
        self.verify_graphs_by_len: dict[int, DecodeGraphs] = {}
        self.piecewise: PiecewiseGraphs | None = None  # set by enable_cuda_graphs
        self.grammars: GrammarCompiler | None = None  # set by the executor for so_args
        self.masks = TokenMasks(self.vocab_size, self.device)
        # Drafts come from the MTP layer when the cache holds its KV; without one the
        # runner still verifies drafts it is given.
        self.drafter: MTPDrafter | None = None
        if engine_config.num_speculative_tokens and kv_cache.mtp_layers:
            self.drafter = MTPDrafter(
                model, kv_cache.mtp_layers[0], engine_config.num_speculative_tokens,
                self.block_size, self.decode_max_query_len, self.batch_invariant,
            )  # fmt: skip

    def enable_cuda_graphs(
        self,
        sizes: list[int] | None = None,
        capture: bool = True,
        token_buckets: list[int] | None = None,
    ) -> None:
        """Serve pure-decode steps through DecodeGraphs (and, when speculating, verify steps
        whose requests all score 1 + k tokens), other steps up to the largest token bucket
        through PiecewiseGraphs; the KV cache must hold a scratch block.
        capture=False (the CPU tests) runs their padded buffers eagerly."""
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if self.kv_cache.scratch_block is None:
            raise ValueError("CUDA graphs need a KV cache built with a scratch block")
        max_blocks = -(-self.max_model_len // self.block_size)
        sizes = sizes or default_capture_sizes(self.max_num_seqs)
        query_lens = [1]
        if self.max_drafts and 1 + self.max_drafts <= self.block_size:  # padding: one block
            query_lens += range(1 + self.max_drafts, 1, -1)
        for q in query_lens:
            graphs = DecodeGraphs(
                self.model, self.kv_cache.layers, self.block_size, max_blocks,
                self.kv_cache.scratch_block, sizes, query_len=q,
            )  # fmt: skip
            if capture:
                graphs.capture()
            if q == 1:
                self.graphs = graphs
            else:
                self.verify_graphs_by_len[q] = graphs
        if self.drafter is not None and not self.batch_invariant:
            # A pass's rows: up to 1 + k a request (pass 1 after a verify step).
            max_rows = max(sizes) * (1 + self.max_drafts)
            self.drafter.enable_graphs(max_rows, max_blocks, self.kv_cache.scratch_block, capture)
        piecewise = PiecewiseGraphs(
            self.model,
            self.kv_cache.layers,
            self.block_size,
            self.kv_cache.scratch_block,
            token_buckets or default_token_buckets(self.max_num_batched_tokens),
        )
        if capture:
            piecewise.capture()
        self.piecewise = piecewise

    @property
    def verify_graphs(self) -> DecodeGraphs | None:
        """The graphs of full verify steps, 1 + k tokens a request (speculation)."""
        return self.verify_graphs_by_len.get(1 + self.max_drafts)

    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def discard_pending(self) -> None:
        """Forget the step in flight: the engine will not read it (it failed, or an
        interrupted generate dropped it); no later step may wait for it."""
        self._pending = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(out).result()

    def step(self, out: SchedulerOutput) -> StepResult:
        """Run one step; also returns the sampled logits (for tests and logprobs)."""
        return self.launch(out).step_result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Queue one step's device work; the handle's `result()` reads it back."""
        prev = self._pending if self._pending is not None and not self._pending.done() else None
        on_device = self._on_device(out)
        if prev is not None and not (on_device and self._independent(out, prev)):
            try:
                prev.step_result()
            except Exception as e:  # prev's own handle raises it to the engine, which
                # then fails this step too (requeues its requests): it was never built;
                # the requests it says ended are dropped all the same
                self._pending = None
                self._drop(out)
                return PendingStep.failed(e)
            prev = None
        self._pending = None
        self.update_states(out)
        if out.is_empty:
            return PendingStep(result=StepResult(ModelRunnerOutput()))
        host = self.collect(out.scheduled, prev)
        fill, behind = self._fill(host, prev)
        hidden, indices, input_ids = self._forward(host, fill)
        logits = self.model.compute_logits(hidden[indices])  # [N, vocab]
        if on_device and self.drafter is not None:
            pending = self._verify_on_device(out, host, hidden, logits, input_ids, behind)
            self._pending = pending
            return pending
        if on_device:
            rows = sorted(host.sample_rows.items(), key=lambda kv: kv[1][0])
            states = [self.requests[rid] for rid, _ in rows]
            sample = sample_on_device(
                logits, [st.sampling for st in states], self.generator, self.batch_invariant
            )
            sample.copy_to_host()  # queued now: behind this step, ahead of the next
            pending = PendingStep(
                lambda: self._finish(rows, states, sample, logits),
                tokens=sample.token_ids,
                rows={rid: i for i, (rid, _) in enumerate(rows)},
            )
            self._pending = pending
            return pending
        result = self._sample(host.sample_rows, logits)
        if self.drafter is not None:
            self._draft(host, hidden, result.output, out)
        if host.prompt_rows:
            result.output.prompt_logprobs = prompt_logprobs.compute(
                self.model, hidden, host.prompt_rows
            )
        return PendingStep(result=result)

    def _forward(
        self, host: HostBatch, fill: Callable[[StepBuffers], None] | None
    ) -> tuple[torch.Tensor, slice | torch.Tensor, torch.Tensor]:
        """The step's final hidden states [T, hidden], the index of its sampled rows and
        its input ids [T] on the device; `fill` completes the loaded inputs (deferred
        tokens, moved positions) before the forward."""
        t = len(host.input_ids)
        batch: Batch | None = None
        graphs = self._graphs_for(host)
        if graphs is not None:
            hidden = graphs.run(host.input_ids, host.positions, host.block_tables, fill)[:t]
            input_ids = graphs.input_ids[:t]
        elif self.piecewise is not None and t <= self.piecewise.max_size:
            md_host = self._metadata(host, torch.device("cpu"))
            md = md_host.to(self.device)
            hidden = self.piecewise.run(
                host.input_ids, host.positions, md_host.slot_mapping, md, fill
            )
            input_ids = self.piecewise.input_ids[:t]
        else:
            batch = self.to_device(host)
            md = batch.md
            if fill is not None:
                fill(StepBuffers(
                    batch.input_ids, batch.positions, [md.slot_mapping], md.seq_lens,
                    md.context_lens, md.block_tables,
                ))  # fmt: skip
            hidden = self.model(batch.input_ids, batch.positions, md, self.kv_cache.layers)
            input_ids = batch.input_ids
        n = len(host.logits_indices)
        if host.logits_indices == list(range(n)):
            return hidden, slice(0, n), input_ids
        if batch is not None:  # (the eager path's indices came in its one copy)
            return hidden, batch.logits_indices, input_ids
        return hidden, to_device(host.logits_indices, torch.int64, self.device), input_ids

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether `launch(out)` now runs `out` beside the step in flight: it queues its
        work without reading it back (`_on_device`) and needs nothing of the step in
        flight on the host (EngineCore launches it after that step otherwise)."""
        prev = self._pending if self._pending is not None and not self._pending.done() else None
        return self._on_device(out) and (prev is None or self._independent(out, prev))

    def _params(self, sr: ScheduledRequest) -> SamplingParams | None:
        """The request's sampling params (None: no state held, and none sent)."""
        if sr.block_table is not None:
            return sr.sampling_params or SamplingParams()
        state = self.requests.get(sr.req_id)
        return None if state is None else state.sampling.params

    def _on_device(self, out: SchedulerOutput) -> bool:
        """Whether the step's sampling can stay on the device until its result is read:
        no drafts to verify or propose, no grammar, no prompt logprobs; with a drafter,
        `_verifies_on_device`."""
        if self.drafter is not None:
            return self._verifies_on_device(out)
        for sr in out.scheduled:
            params = self._params(sr)
            if (
                sr.draft_token_ids
                or params is None
                or params.so_args is not None
                or params.prompt_logprobs is not None
            ):
                return False
        return True

    def _verifies_on_device(self, out: SchedulerOutput) -> bool:
        """Whether a step with a drafter can verify and draft on the device (spec_chain.py):
        its requests are unseeded, without prompt logprobs or grammar, and their processing
        reads no history (spec_decode.history_free); each decodes its newest token (plus
        drafts, at output positions, on the absorbed path) or computes a chunk of tokens
        the host knows (a prompt chunk, or a resumed request's recompute that starts in
        its prompt: one that starts past it counts as a decode, and goes to the host)."""
        assert self.drafter is not None
        for sr in out.scheduled:
            params = self._params(sr)
            state = self.requests.get(sr.req_id) if sr.block_table is None else None
            n_out = len(state.sampling.output_token_ids) if state is not None else 0
            if (
                params is None
                or params.seq_seed is not None
                or params.so_args is not None
                or params.prompt_logprobs is not None
                or not history_free(params, n_out)
            ):
                return False
            decodes = state is not None and sr.num_computed_tokens >= state.num_prompt_tokens
            if (decodes or sr.draft_token_ids) and (
                state is None
                or not sr.samples
                or sr.num_tokens != 1 + len(sr.draft_token_ids)
                or sr.num_tokens > self.decode_max_query_len
                or sr.req_id in self.drafter.pending
            ):
                return False
        return bool(out.scheduled)

    def _independent(self, out: SchedulerOutput, prev: PendingStep) -> bool:
        """Whether `out` can be built while `prev` (launched, unread) runs: its requests
        that prev samples for are not new to the runner and read no history (seeds,
        penalties and min_tokens count outputs); after a verify step on the device, each
        takes its newest token and drafts from it (`_chains`)."""
        for sr in out.scheduled:
            if sr.req_id not in prev.rows:
                continue
            state = self.requests.get(sr.req_id)
            params = self._params(sr)
            if (
                sr.block_table is not None
                or state is None
                or params is None
                or params.seq_seed is not None
                or params.repetition_penalty != 1
                or params.frequency_penalty
                or params.presence_penalty
                or len(state.sampling.output_token_ids) < params.min_tokens
            ):
                return False
            if self.drafter is not None and not self._chains(sr, prev.chain):
                return False
        return True

    @staticmethod
    def _chains(sr: ScheduledRequest, chain: Chained | None) -> bool:
        """Whether `sr` takes all its tokens from the verify step in flight (`chain`): its
        newest token and the drafts it proposed, none sent by the scheduler."""
        drafts = sr.draft_token_ids
        return (
            chain is not None
            and not sr.token_ids
            and sr.num_tokens == 1 + len(drafts)
            and len(drafts) < chain.width
            and all(d == DRAFT_PLACEHOLDER for d in drafts)
        )

    def _fill(
        self, host: HostBatch, prev: PendingStep | None
    ) -> tuple[Callable[[StepBuffers], None] | None, torch.Tensor | None]:
        """Copies prev's sampled tokens into the deferred rows of the loaded inputs and
        moves the rows of requests prev verified drafts for back by the drafts rejected
        (spec_chain.Shift). Also returns how far each request's rows moved ([B], device;
        None: no request's did)."""
        if not host.deferred:
            return None, None
        assert prev is not None and prev.tokens is not None
        tokens = prev.tokens
        dst = [row for row, _ in host.deferred]
        src = [i for _, i in host.deferred]
        k = len(dst)
        shift = behind = None
        if host.behind is not None:
            assert prev.chain is not None
            self.num_chained_steps += 1
            behind = prev.chain.rejected[to_device(host.behind, torch.int64, self.device)]
            shift = Shift(behind, rows_by_sequence(host.query_lens), self.block_size)
        if dst == src == list(range(k)):  # the same requests first, in the same order

            def fill_ids(ids: torch.Tensor) -> None:
                ids[:k].copy_(tokens[:k])

        else:
            dst_t = to_device(dst, torch.int64, self.device)
            src_t = to_device(src, torch.int64, self.device)

            def fill_ids(ids: torch.Tensor) -> None:
                ids[dst_t] = tokens[src_t]

        def fill(buffers: StepBuffers) -> None:
            fill_ids(buffers.input_ids)
            if shift is not None:
                shift.apply(buffers)

        return fill, behind

    def _graphs_for(self, host: HostBatch) -> DecodeGraphs | None:
        """The graphs of the step's query length when every request has that many tokens
        (one, or 1 + k when verifying) and some graph holds the batch; else None."""
        q = host.query_lens[0]
        graphs = self.graphs if q == 1 else self.verify_graphs_by_len.get(q)
        if (
            graphs is None
            or graphs.query_len != q
            or host.prompt_rows
            or host.num_decode != len(host.req_ids)
            or any(n != q for n in host.query_lens)
            or len(host.req_ids) > graphs.max_size
            or max(map(len, host.block_tables)) > graphs.max_blocks_per_seq
        ):
            return None
        return graphs

    def _drop(self, out: SchedulerOutput) -> None:
        """Forget the requests `out` says ended or were preempted."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.pending.pop(req_id, None)

    def update_states(self, out: SchedulerOutput) -> None:
        self._drop(out)
        for sr in out.scheduled:
            if sr.block_table is not None:
                if self.drafter is not None:  # (re)started: nothing of its past is pending
                    self.drafter.pending.pop(sr.req_id, None)
                params = sr.sampling_params or SamplingParams()
                state = SamplingState(params, [], eos_token_id=self.eos_token_id)
                self.requests[sr.req_id] = RequestState(
                    list(sr.block_table), state, sr.num_prompt_tokens,
                    num_computed=sr.num_computed_tokens,
                )  # fmt: skip
                if sr.prior_token_ids:
                    self._record_history(self.requests[sr.req_id], 0, sr.prior_token_ids)
                if sr.prompt_token_ids is not None:
                    self.requests[sr.req_id].prompt_ids = list(sr.prompt_token_ids)
                if params.so_args is not None:
                    self.requests[sr.req_id].grammar = self._grammar(sr.req_id, params.so_args)
            elif sr.req_id not in self.requests:
                raise ValueError(
                    f"request {sr.req_id!r}: no block_table and no state held "
                    "(first schedule and resumes must send the whole table)"
                )
            else:
                table = self.requests[sr.req_id].block_table
                if sr.num_prior_blocks is not None:  # slots of rejected drafts were freed
                    del table[sr.num_prior_blocks :]
                table.extend(sr.new_block_ids)

    def _grammar(self, req_id: str, so_args: dict) -> GrammarState:
        """A fresh matcher (a resumed request catches up with its history in collect)."""
        if self.grammars is None:
            raise RequestFailed({req_id: "so_args: this model runner has no grammar compiler"})
        try:
            return GrammarState(self.grammars.compiled(so_args))
        except Exception as e:  # the engine schedules a request once its compile succeeded
            raise RequestFailed({req_id: f"so_args: {e}"}) from e

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
        self, sr: ScheduledRequest, start: int, tokens: list[int], drafts: list[int]
    ) -> list[_Segment]:
        """The step's rows of `sr`: one segment, or in batch-invariant mode two when they
        cross the prompt's end (a preempted request recomputing its prompt and outputs):
        the prompt positions by the prefill path, the outputs by the absorbed one, as they
        were first computed. (Not with a drafter: it reads one entry per request.)"""
        cut = self.requests[sr.req_id].num_prompt_tokens - start
        if self.batch_invariant and self.drafter is None and 0 < cut < len(tokens):
            return [
                _Segment(sr.req_id, start, tokens[:cut], False, False, []),
                _Segment(sr.req_id, start + cut, tokens[cut:], True, sr.samples, drafts),
            ]
        return [_Segment(sr.req_id, start, tokens, self._absorbed(sr, start), sr.samples, drafts)]

    def collect(
        self, scheduled: list[ScheduledRequest], prev: PendingStep | None = None
    ) -> HostBatch:
        """Check the block tables, record history, flatten to lists, absorbed rows first.
        prev: the step in flight, unread (`launch`): the tokens it samples are deferred."""
        starts = {r.req_id: self._start(r) for r in scheduled}
        failed = self._check(scheduled)
        if failed:  # before any device work: the engine aborts these and requeues the rest
            raise RequestFailed(failed)
        segments: list[_Segment] = []
        for sr in scheduled:
            state = self.requests[sr.req_id]
            if prev is not None and prev.chain is not None and sr.req_id in prev.rows:
                # Newest token and drafts on the device (`_chains`), nothing to record yet.
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
            self._record_history(state, start, tokens[: len(tokens) - len(drafts) - deferred])
            if sr.samples and state.grammar is not None:
                # Outputs before the sampled position (drafts aside): the matcher has them.
                n_out = max(0, end - len(drafts) - state.num_prompt_tokens)
                try:
                    state.grammar.catch_up(state.sampling.output_token_ids[:n_out])
                except GrammarViolation as e:
                    raise RequestFailed({sr.req_id: str(e)}) from None
            if deferred:  # (no drafts, so it is one segment's last token)
                segments.append(_Segment(
                    sr.req_id, start, tokens, self._absorbed(sr, start), sr.samples, [],
                    deferred=len(tokens) - 1,
                ))  # fmt: skip
                continue
            segments += self._segments(sr, start, tokens, drafts)
        segments.sort(key=lambda seg: not seg.absorbed)  # stable: otherwise in step order
        behind = None
        if any(seg.chained is not None for seg in segments):
            assert prev is not None and prev.chain is not None
            none = len(prev.rows)  # the zero past prev's requests
            behind = [none if seg.chained is None else seg.chained for seg in segments]
        host = HostBatch(
            req_ids=[seg.req_id for seg in segments], input_ids=[], positions=[],
            query_lens=[len(seg.tokens) for seg in segments],
            context_lens=[seg.start for seg in segments],
            block_tables=[self.requests[seg.req_id].block_table for seg in segments],
            num_decode=sum(seg.absorbed for seg in segments),
            logits_indices=[], behind=behind,
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

    def _metadata(self, host: HostBatch, device: torch.device) -> AttentionMetadata:
        return build_attention_metadata(
            host.query_lens, host.context_lens, host.block_tables, self.block_size,
            host.num_decode, device,
        )  # fmt: skip

    def to_device(self, host: HostBatch) -> Batch:
        """The step's inputs on the device, in one host-to-device copy."""
        lists = (host.input_ids, host.positions, host.logits_indices)
        md, (ids, positions, indices) = self._metadata(host, torch.device("cpu")).moved_with(
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

    @staticmethod
    def _record_history(state: RequestState, start: int, tokens: list[int]) -> None:
        """Extend the sampler's prompt / output history with tokens at positions start...

        Only contiguous history is kept: positions the runner never saw (a prefix-cache
        hit on a resumed request) leave it short.
        """
        s, n_prompt = state.sampling, state.num_prompt_tokens
        end = start + len(tokens)
        known = len(s.prompt_token_ids)
        if start <= known < min(end, n_prompt):
            s.prompt_token_ids.extend(tokens[known - start : min(end, n_prompt) - start])
        if len(s.prompt_token_ids) == n_prompt:
            pos = n_prompt + len(s.output_token_ids)  # next output position to record
            if start <= pos < end:
                s.output_token_ids.extend(tokens[pos - start :])

    def _sample(
        self, sample_rows: dict[str, tuple[int, int, list[int]]], logits: torch.Tensor
    ) -> StepResult:
        """Sample every request's token; requests with drafts verify them (1 + k rows)."""
        rows = sorted(sample_rows.items(), key=lambda kv: kv[1][0])
        grammars = [
            (first, g, drafts)
            for rid, (first, _, drafts) in rows
            if (g := self.requests[rid].grammar) is not None
        ]
        if grammars:  # filled on the CPU now: the device may still be running the forward
            logits = logits.float()
            self.masks.apply(logits, grammars)
        out = ModelRunnerOutput()
        if not rows:
            return StepResult(out)
        if any(drafts for _, (_, _, drafts) in rows):
            reqs = [
                VerifyRequest(first, drafts, self.requests[rid].sampling)
                for rid, (first, _, drafts) in rows
            ]
            verified = verify(logits, reqs, self.generator, self.batch_invariant)
            tokens, logprobs = verified.tokens, verified.logprobs
        else:
            sampling = [self.requests[rid].sampling for rid, _ in rows]
            result = sample_tokens(logits, sampling, self.generator, self.batch_invariant)
            tokens, logprobs = [[t] for t in result.token_ids], result.logprobs
        states = [self.requests[rid] for rid, _ in rows]
        return self._record(rows, states, tokens, logprobs, logits, out)

    def _finish(
        self,
        rows: list[tuple[str, tuple[int, int, list[int]]]],
        states: list[RequestState],
        sample: DeviceSample,
        logits: torch.Tensor,
    ) -> StepResult:
        """A deferred step's sampled tokens, read back (this waits for the device)."""
        res = sample.to_host([st.sampling.params for st in states])
        tokens = [[t] for t in res.token_ids]
        return self._record(rows, states, tokens, res.logprobs, logits, ModelRunnerOutput())

    @staticmethod
    def _record(
        rows: list[tuple[str, tuple[int, int, list[int]]]],
        states: list[RequestState],
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob]] | None,
        logits: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> StepResult:
        """Apply each request's sampled tokens (rows and states in the same order) to its
        state (the state of a request dropped meanwhile is no longer the runner's)."""
        if logprobs is not None:
            out.logprobs = {}
        result = StepResult(out, logits)
        for (req_id, (first, n, _)), state, toks in zip(rows, states, tokens):
            if state.grammar is not None and not state.grammar.done:
                try:  # those past the grammar's end (a draft ended it) are dropped
                    toks = toks[: state.grammar.accept(toks)]
                except GrammarViolation as e:
                    raise RequestFailed({req_id: str(e)}) from None
                if state.grammar.done:
                    out.completed_req_ids.add(req_id)
            state.sampling.output_token_ids.extend(toks)
            state.last_token = toks[-1]
            state.num_computed -= n - len(toks)  # rejected drafts' KV is overwritten later
            out.sampled_token_ids[req_id] = toks
            if out.logprobs is not None and logprobs is not None:
                out.logprobs[req_id] = logprobs[first : first + len(toks)]
            result.rows[req_id] = (first, n)
        return result

    def _verify_on_device(
        self,
        out: SchedulerOutput,
        host: HostBatch,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        behind: torch.Tensor | None,
    ) -> PendingStep:
        """Verify and draft with nothing read back (`_verifies_on_device`): the handle
        carries each sampling request's newest token and drafts, and what it rejected, for
        the next step to chain on (spec_chain.py); `result()` reads everything with one
        copy. hidden [T', hidden] (T' >= T: graph padding), logits [N, vocab],
        input_ids [T]."""
        assert self.drafter is not None
        rows = sorted(host.sample_rows.items(), key=lambda kv: kv[1][0])  # sampling requests
        states = [self.requests[rid] for rid, _ in rows]
        num_drafts = [n - 1 for _, (_, n, _) in rows]
        t = len(host.input_ids)
        dev = self.device
        checked = None
        if rows:  # the draft each sampled row verifies: the input token after it
            after = to_device([min(i + 1, t - 1) for i in host.logits_indices], torch.int64, dev)
            checked = verify_on_device(
                logits, [st.sampling for st in states], num_drafts, input_ids[after],
                self.generator,
            )  # fmt: skip
        accepted = (
            checked.accepted
            if checked is not None
            else torch.zeros(0, dtype=torch.int64, device=dev)
        )
        rejected = to_device(num_drafts, torch.int64, dev) - accepted  # [B_s]
        rejected = torch.cat([rejected, rejected.new_zeros(1)])  # a 0 past them: [B_s + 1]
        verified = {rid: v for v, (rid, _) in enumerate(rows)}
        inputs, seg_of, verified_of = self._draft_inputs(host, hidden, input_ids, checked, verified)
        drafts = self.drafter.propose_on_device(
            inputs,
            # per input: how far its rows lie back, and the drafts it rejected (0 past the
            # sampling requests)
            (behind if behind is not None else rejected.new_zeros(len(host.req_ids)))[
                to_device(seg_of, torch.int64, dev)
            ],
            rejected[
                to_device([len(rows) if v is None else v for v in verified_of], torch.int64, dev)
            ],
            out.num_proposals,
        )
        input_of = {v: i for i, v in enumerate(verified_of) if v is not None}
        mine = to_device([input_of[v] for v in range(len(rows))], torch.int64, dev)
        counts = [drafts.counts[input_of[v]] for v in range(len(rows))]
        p = drafts.ids.shape[1]
        if checked is None:  # only prompt chunks that do not sample yet
            return PendingStep(result=StepResult(ModelRunnerOutput()))
        width = checked.tokens.shape[1]
        newest = checked.tokens.gather(1, checked.accepted[:, None])  # [B_s, 1]
        chain_ids = torch.cat([newest, drafts.ids[mine]], dim=1)  # [B_s, 1 + P]
        # Logprobs of each sampled row's token (an accepted draft, or the token sampled);
        # the per-row lists only when a request asked (1,024 rows at batch 256 x 3 drafts).
        lp = None
        grid: list[int] = []
        row_params: list[SamplingParams] = []
        if any(st.sampling.params.logprobs is not None for st in states):
            grid = [v * width + j for v, k in enumerate(num_drafts) for j in range(1 + k)]
            row_states = [
                states[v].sampling for v, k in enumerate(num_drafts) for _ in range(1 + k)
            ]
            raw = raw_logprobs(logits, row_states, self.batch_invariant)
            assert raw is not None
            row_params = [s.params for s in row_states]
            row_tokens_d = checked.tokens.flatten()[to_device(grid, torch.int64, dev)]
            lp = logprob_tensors(raw, row_tokens_d, row_params)
        extra = [] if lp is None else [lp.chosen, lp.ranks, lp.top_vals, lp.top_ids]
        back = PackedCopy([checked.tokens, checked.accepted, drafts.ids[mine],
                           drafts.confidences[mine], *extra])  # fmt: skip

        def finish() -> StepResult:
            toks, accepted, ids, conf, *lp_values = back.read()
            tokens = [
                [int(x) for x in toks[i * width : i * width + int(a) + 1]]
                for i, a in enumerate(accepted)
            ]
            logprobs = None
            if lp is not None:
                chosen, ranks, vals, top = (torch.tensor(v) for v in lp_values)
                shape = lp.top_ids.shape  # [N, n_max]
                read = LogprobTensors(
                    chosen, ranks.long(), vals.view(shape), top.long().view(shape)
                )
                logprobs = read.to_lists([int(toks[i]) for i in grid], row_params)
            res = self._record(rows, states, tokens, logprobs, logits, ModelRunnerOutput())
            output = res.output
            for i, ((rid, _), state, n) in enumerate(zip(rows, states, counts)):
                state.drafts = [int(x) for x in ids[i * p : i * p + n]]
                if n:
                    output.draft_token_ids[rid] = state.drafts
                    output.draft_confidences[rid] = conf[i * p : i * p + n]
            return res

        return PendingStep(
            finish,
            tokens=chain_ids.flatten(),
            rows={rid: i for i, (rid, _) in enumerate(rows)},
            chain=Chained(1 + p, rejected),
        )

    def _draft_inputs(
        self,
        host: HostBatch,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        checked: DeviceVerify | None,
        verified: dict[str, int],
    ) -> tuple[list[DeviceDraftInput], list[int], list[int | None]]:
        """Pass 1's rows for a step on the device, request by request (the host path's
        MTPDrafter.step_inputs with the step's tokens where they lie): a request whose
        every row sampled takes each row's next token from its verification (rows past
        the accepted ones: any); a prompt chunk its own next input ids, then, when it
        samples, its sampled token; a chunk that does not sample leaves its last position
        pending, which its next chunk's rows start at. verified: each sampling request's
        row in `checked`. Also each input's segment in `host` and its index among the
        sampling requests (None: it does not sample)."""
        assert self.drafter is not None
        pending_of = self.drafter.pending
        inputs: list[DeviceDraftInput] = []
        seg_of: list[int] = []
        verified_of: list[int | None] = []
        offset = 0
        for i, (rid, start, n) in enumerate(zip(host.req_ids, host.context_lens, host.query_lens)):
            rows_h = hidden[offset : offset + n]  # [n, hidden]
            following = input_ids[offset + 1 : offset + n]  # [n - 1]: next ids on the host's side
            first_id = input_ids[offset : offset + 1]
            offset += n
            v = verified.get(rid)
            pending = pending_of.pop(rid, None)
            newest: int | None = n - 1
            if v is not None and host.sample_rows[rid][1] == n:  # every row sampled
                assert checked is not None
                next_ids = checked.tokens[v, :n]
            elif v is not None:  # a prompt's last chunk: its sampled token ends it
                assert checked is not None
                next_ids = torch.cat([following, checked.tokens[v, :1]])
            else:  # the next token of its last position comes with the next chunk
                pending_of[rid] = (start + n - 1, rows_h[-1].clone())
                rows_h, next_ids, newest = rows_h[:-1], following, None
            first = start
            if pending is not None and pending[0] == start - 1:
                first = start - 1
                rows_h = torch.cat([pending[1][None], rows_h])
                next_ids = torch.cat([first_id, next_ids])
                newest = None if newest is None else newest + 1
            if not len(next_ids):
                continue
            state = self.requests[rid]
            inputs.append(DeviceDraftInput(
                rid, first, rows_h, next_ids, state.block_table, newest, state.num_prompt_tokens
            ))  # fmt: skip
            seg_of.append(i)
            verified_of.append(v)
        return inputs, seg_of, verified_of

    def _draft(
        self, host: HostBatch, hidden: torch.Tensor, out: ModelRunnerOutput, step: SchedulerOutput
    ) -> None:
        """The MTP layer's next drafts for every request that sampled (mtp_drafter.py):
        as many as the step asks for (varlen), else the engine's num_speculative_tokens."""
        assert self.drafter is not None
        inputs = self.drafter.step_inputs(
            host.req_ids, host.context_lens, host.query_lens, host.input_ids, hidden,
            out.sampled_token_ids,
            {rid: len(drafts) for rid, (_, _, drafts) in host.sample_rows.items()},
            {rid: self.requests[rid].block_table for rid in host.req_ids},
            {rid: self.requests[rid].num_prompt_tokens for rid in host.req_ids},
        )  # fmt: skip
        drafts: Drafts = self.drafter.propose(inputs, step.num_proposals)
        for rid, toks in drafts.tokens.items():
            self.requests[rid].drafts = toks
        out.draft_token_ids = drafts.tokens
        out.draft_confidences = drafts.confidences

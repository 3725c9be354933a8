"""ModelRunner: SchedulerOutput -> one flattened model forward -> sampled tokens.

Keeps per-request state keyed by req_id (block table, sampling state, the last
sampled token). A request's whole block table arrives when the runner holds no
state for it (first schedule, or resumed after preemption: the state is then
rebuilt); afterwards only `new_block_ids` are appended. State is dropped for
finished and preempted requests. A structured request (so_args) also holds a grammar
matcher: its mask is applied to its logits before sampling (executors/structured_outputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import EngineConfig
from deepinfer.errors import RequestFailed
from deepinfer.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors import prompt_logprobs
from executors.attention import AttentionMetadata, build_attention_metadata
from executors.cuda_graphs import DecodeGraphs, default_capture_sizes
from executors.kv_cache import PagedKVCache
from executors.models.deepseek import DeepseekForCausalLM
from executors.piecewise_graphs import PiecewiseGraphs, default_token_buckets
from executors.sampler import SamplingState, sample_tokens
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
    grammar: GrammarState | None = None  # its so_args matcher


@dataclass
class HostBatch:
    """One step's inputs as host lists; requests ordered decode-first."""

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


@dataclass
class Batch:
    """One step's flattened inputs on the device (the eager path)."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    logits_indices: torch.Tensor  # [N] batch rows whose logits are sampled
    sample_rows: dict[str, tuple[int, int, list[int]]] = field(default_factory=dict)


@dataclass
class StepResult:
    output: ModelRunnerOutput
    logits: dict[str, torch.Tensor]  # req_id -> [rows, vocab] float32 logits that were sampled


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
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        # Longest sequence a graph's block table must hold.
        self.max_model_len = min(
            max_model_len or engine_config.max_model_len or 1 << 62,
            kv_cache.num_blocks * kv_cache.block_size,
        )
        self.generator = torch.Generator(self.device).manual_seed(engine_config.seed)
        self.requests: dict[str, RequestState] = {}
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        self.piecewise: PiecewiseGraphs | None = None  # set by enable_cuda_graphs
        self.grammars: GrammarCompiler | None = None  # set by the executor for so_args
        self.masks = TokenMasks(self.vocab_size, self.device)

    def enable_cuda_graphs(
        self,
        sizes: list[int] | None = None,
        capture: bool = True,
        token_buckets: list[int] | None = None,
    ) -> None:
        """Serve pure-decode steps through DecodeGraphs and other steps up to the largest
        token bucket through PiecewiseGraphs; the KV cache must hold a scratch block.
        capture=False (the CPU tests) runs their padded buffers eagerly."""
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        if self.kv_cache.scratch_block is None:
            raise ValueError("CUDA graphs need a KV cache built with a scratch block")
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache.layers,
            self.block_size,
            max_blocks,
            self.kv_cache.scratch_block,
            sizes or default_capture_sizes(self.max_num_seqs),
        )
        piecewise = PiecewiseGraphs(
            self.model,
            self.kv_cache.layers,
            self.block_size,
            self.kv_cache.scratch_block,
            token_buckets or default_token_buckets(self.max_num_batched_tokens),
        )
        if capture:
            graphs.capture()
            piecewise.capture()
        self.graphs = graphs
        self.piecewise = piecewise

    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.step(out).output

    @torch.inference_mode()
    def step(self, out: SchedulerOutput) -> StepResult:
        """Run one step; also returns the sampled logits (for tests and logprobs)."""
        self.update_states(out)
        if out.is_empty:
            return StepResult(ModelRunnerOutput(), {})
        host = self.collect(out.scheduled)
        if self._graph_eligible(host):
            assert self.graphs is not None
            all_logits = self.graphs.run(host.input_ids, host.positions, host.block_tables)
            # A copy: the graph's output buffer is overwritten by the next replay.
            n = len(host.logits_indices)
            if host.logits_indices == list(range(n)):
                logits = all_logits[:n].clone()
            else:
                logits = all_logits[torch.tensor(host.logits_indices, device=self.device)]
            return self._sample(host.sample_rows, logits)
        if self.piecewise is not None and len(host.input_ids) <= self.piecewise.max_size:
            md_host = self._metadata(host, torch.device("cpu"))
            md = md_host.to(self.device)
            hidden = self.piecewise.run(host.input_ids, host.positions, md_host.slot_mapping, md)
            indices = torch.tensor(host.logits_indices, dtype=torch.int64).to(self.device)
        else:
            batch = self.to_device(host)
            hidden = self.model(batch.input_ids, batch.positions, batch.md, self.kv_cache.layers)
            indices = batch.logits_indices
        logits = self.model.compute_logits(hidden[indices])  # [N, vocab]
        result = self._sample(host.sample_rows, logits)
        if host.prompt_rows:
            result.output.prompt_logprobs = prompt_logprobs.compute(
                self.model, hidden, host.prompt_rows
            )
        return result

    def _graph_eligible(self, host: HostBatch) -> bool:
        """Pure decode (one token per request) of a batch some graph holds."""
        return (
            self.graphs is not None
            and len(host.input_ids) == len(host.req_ids) <= self.graphs.max_size
            and host.num_decode == len(host.req_ids)
            and max(map(len, host.block_tables)) <= self.graphs.max_blocks_per_seq
        )

    def update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for sr in out.scheduled:
            if sr.block_table is not None:
                params = sr.sampling_params or SamplingParams()
                state = SamplingState(params, [], eos_token_id=self.eos_token_id)
                self.requests[sr.req_id] = RequestState(
                    list(sr.block_table), state, sr.num_prompt_tokens
                )
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
                self.requests[sr.req_id].block_table.extend(sr.new_block_ids)

    def _grammar(self, req_id: str, so_args: dict) -> GrammarState:
        """A fresh matcher (a resumed request catches up with its history in collect)."""
        if self.grammars is None:
            raise RequestFailed({req_id: "so_args: this model runner has no grammar compiler"})
        try:
            return GrammarState(self.grammars.compiled(so_args))
        except Exception as e:  # the engine schedules a request once its compile succeeded
            raise RequestFailed({req_id: f"so_args: {e}"}) from e

    def collect(self, scheduled: list[ScheduledRequest]) -> HostBatch:
        """Order decode-first, check the block tables, record history, flatten to lists."""
        ordered = sorted(scheduled, key=lambda r: r.num_tokens > self.decode_max_query_len)
        host = HostBatch(
            req_ids=[r.req_id for r in ordered], input_ids=[], positions=[],
            query_lens=[r.num_tokens for r in ordered],
            context_lens=[r.num_computed_tokens for r in ordered],
            block_tables=[self.requests[r.req_id].block_table for r in ordered],
            num_decode=sum(r.num_tokens <= self.decode_max_query_len for r in ordered),
            logits_indices=[],
        )  # fmt: skip
        failed = self._check(ordered)
        if failed:  # before any device work: the engine aborts these and requeues the rest
            raise RequestFailed(failed)
        for sr in ordered:
            state = self.requests[sr.req_id]
            tokens = self._step_tokens(sr, state)
            start, end = sr.num_computed_tokens, sr.num_computed_tokens + sr.num_tokens
            self._record_history(state, start, tokens[: len(tokens) - len(sr.draft_token_ids)])
            if sr.samples and state.grammar is not None:
                # Outputs before the sampled position (drafts aside): the matcher has them.
                n_out = max(0, end - len(sr.draft_token_ids) - state.num_prompt_tokens)
                try:
                    state.grammar.catch_up(state.sampling.output_token_ids[:n_out])
                except GrammarViolation as e:
                    raise RequestFailed({sr.req_id: str(e)}) from None
            if sr.samples:
                n = 1 + len(sr.draft_token_ids)
                host.sample_rows[sr.req_id] = (
                    len(host.logits_indices),
                    n,
                    list(sr.draft_token_ids),
                )
                last = len(host.input_ids) + len(tokens)
                host.logits_indices.extend(range(last - n, last))
            params = state.sampling.params
            if state.prompt_ids is not None and params.prompt_logprobs is not None:
                host.prompt_rows += prompt_logprobs.chunk_rows(
                    sr.req_id, state.prompt_ids, start, end, len(host.input_ids),
                    params.prompt_logprobs)  # fmt: skip
            host.input_ids.extend(tokens)
            host.positions.extend(range(start, end))
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
        md = self._metadata(host, self.device)
        return Batch(
            req_ids=host.req_ids,
            input_ids=torch.tensor(host.input_ids, dtype=torch.int64).to(self.device),
            positions=torch.tensor(host.positions, dtype=torch.int64).to(self.device),
            md=md,
            logits_indices=torch.tensor(host.logits_indices, dtype=torch.int64).to(self.device),
            sample_rows=host.sample_rows,
        )

    @staticmethod
    def _step_tokens(sr: ScheduledRequest, state: RequestState) -> list[int]:
        """Token ids of positions [num_computed, num_computed + num_tokens), drafts last.

        Under async scheduling the newest sampled token may be unknown to the scheduler:
        it is then missing just before the drafts and the runner's own sample fills in.
        """
        tokens = list(sr.token_ids or [])
        if len(tokens) == sr.num_tokens - 1 and state.last_token is not None:
            tokens.insert(len(tokens) - len(sr.draft_token_ids), state.last_token)
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
        rows = sorted(sample_rows.items(), key=lambda kv: kv[1][0])
        states = [self.requests[rid].sampling for rid, (_, n, _) in rows for _ in range(n)]
        grammars = [
            (first, g, drafts)
            for rid, (first, _, drafts) in rows
            if (g := self.requests[rid].grammar) is not None
        ]
        if grammars:  # filled on the CPU now: the device may still be running the forward
            logits = logits.float()
            self.masks.apply(logits, grammars)
        result = sample_tokens(logits, states, self.generator) if states else None
        sampled = result.token_ids if result else []
        out = ModelRunnerOutput()
        if result is not None and result.logprobs is not None:
            out.logprobs = {}
        per_req: dict[str, torch.Tensor] = {}
        for req_id, (first, n, drafts) in rows:
            toks = sampled[first : first + n]
            accepted = 0
            while accepted < len(drafts) and toks[accepted] == drafts[accepted]:
                accepted += 1
            toks = toks[: accepted + 1]
            state = self.requests[req_id]
            if state.grammar is not None and not state.grammar.done:
                try:  # those past the grammar's end (a draft ended it) are dropped
                    toks = toks[: state.grammar.accept(toks)]
                except GrammarViolation as e:
                    raise RequestFailed({req_id: str(e)}) from None
                if state.grammar.done:
                    out.completed_req_ids.add(req_id)
            state.sampling.output_token_ids.extend(toks)
            state.last_token = toks[-1]
            out.sampled_token_ids[req_id] = toks
            if out.logprobs is not None and result is not None and result.logprobs is not None:
                out.logprobs[req_id] = result.logprobs[first : first + len(toks)]
            per_req[req_id] = logits[first : first + n]
        return StepResult(out, per_req)

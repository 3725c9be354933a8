"""ModelRunner: SchedulerOutput -> one flattened model forward -> sampled tokens.

Keeps per-request state keyed by req_id (block table, sampling state, the last
sampled token). A request's whole block table arrives when the runner holds no
state for it (first schedule, or resumed after preemption: the state is then
rebuilt); afterwards only `new_block_ids` are appended. State is dropped for
finished and preempted requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import EngineConfig
from deepinfer.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors.attention import AttentionMetadata, build_attention_metadata
from executors.kv_cache import PagedKVCache
from executors.models.deepseek import DeepseekForCausalLM
from executors.sampler import SamplingState, sample_tokens


@dataclass
class RequestState:
    block_table: list[int]
    sampling: SamplingState
    num_prompt_tokens: int
    last_token: int | None = None  # last sampled token (used when async scheduling omits it)


@dataclass
class Batch:
    """One step's flattened inputs; requests ordered decode-first."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    md: AttentionMetadata
    logits_indices: torch.Tensor  # [N] batch rows whose logits are sampled
    # req_id -> (first row in logits_indices, number of rows, drafts to verify)
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
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.eos_token_id = eos_token_id
        # Queries this short (a decode token plus drafts) take the absorbed MLA path.
        self.decode_max_query_len = 1 + engine_config.num_speculative_tokens
        self.generator = torch.Generator(self.device).manual_seed(engine_config.seed)
        self.requests: dict[str, RequestState] = {}

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
        batch = self.prepare_batch(out.scheduled)
        hidden = self.model(batch.input_ids, batch.positions, batch.md, self.kv_cache.layers)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab]
        return self._sample(batch, logits)

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
            elif sr.req_id not in self.requests:
                raise ValueError(
                    f"request {sr.req_id!r}: no block_table and no state held "
                    "(first schedule and resumes must send the whole table)"
                )
            else:
                self.requests[sr.req_id].block_table.extend(sr.new_block_ids)

    def prepare_batch(self, scheduled: list[ScheduledRequest]) -> Batch:
        ordered = sorted(scheduled, key=lambda r: r.num_tokens > self.decode_max_query_len)
        num_decode = sum(r.num_tokens <= self.decode_max_query_len for r in ordered)
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sample_rows: dict[str, tuple[int, int, list[int]]] = {}
        for sr in ordered:
            state = self.requests[sr.req_id]
            tokens = self._step_tokens(sr, state)
            start, end = sr.num_computed_tokens, sr.num_computed_tokens + sr.num_tokens
            if len(state.block_table) * self.block_size < end:
                raise ValueError(
                    f"request {sr.req_id!r}: {len(state.block_table)} blocks of "
                    f"{self.block_size} cannot hold {end} tokens"
                )
            self._record_history(state, start, tokens[: len(tokens) - len(sr.draft_token_ids)])
            if sr.samples:
                n = 1 + len(sr.draft_token_ids)
                sample_rows[sr.req_id] = (len(logits_indices), n, list(sr.draft_token_ids))
                last = len(ids) + len(tokens)
                logits_indices.extend(range(last - n, last))
            ids.extend(tokens)
            positions.extend(range(start, end))
        md = build_attention_metadata(
            [r.num_tokens for r in ordered],
            [r.num_computed_tokens for r in ordered],
            [self.requests[r.req_id].block_table for r in ordered],
            self.block_size,
            num_decode,
            self.device,
        )
        return Batch(
            req_ids=[r.req_id for r in ordered],
            input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device),
            positions=torch.tensor(positions, dtype=torch.int64).to(self.device),
            md=md,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(self.device),
            sample_rows=sample_rows,
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

    def _sample(self, batch: Batch, logits: torch.Tensor) -> StepResult:
        rows = sorted(batch.sample_rows.items(), key=lambda kv: kv[1][0])
        states = [self.requests[rid].sampling for rid, (_, n, _) in rows for _ in range(n)]
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
            state.sampling.output_token_ids.extend(toks)
            state.last_token = toks[-1]
            out.sampled_token_ids[req_id] = toks
            if out.logprobs is not None and result is not None and result.logprobs is not None:
                out.logprobs[req_id] = result.logprobs[first : first + len(toks)]
            per_req[req_id] = logits[first : first + n]
        return StepResult(out, per_req)

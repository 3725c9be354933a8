"""ModelRunner: SchedulerOutput -> one flattened model forward -> sampled tokens.

The runner owns five parts, each an object with its own state:
- `requests` (executors/request_states.py): per-request state keyed by req_id (block
  table, sampling state, the last sampled token, a structured request's grammar
  matcher, whose mask is applied to its logits before sampling:
  executors/structured_outputs.py), built when a request arrives with its whole block
  table and dropped when it ends or is preempted;
- `inputs` (executors/input_builder.py): a step's rows flattened into host lists
  (`collect`) and moved to the device with one copy (`to_device`);
- `kv_transfer` (executors/kv_transfer.py): a request's KV exported to a decode engine,
  and the KV imported for a decode engine's requests, written into their blocks before
  the forward of the step that first schedules them;
- `speculator` (executors/speculative_decoder.py), with an MTP layer to draft from:
  the drafter and the verification of a step on the device;
- `host_tier` (executors/host_kv_tier.py), with kv_host_cache_gib: the prefix blocks
  copied to host memory and back, each step's copies queued first at its launch.
The runner itself chooses a step's forward (decode or verify graphs, piecewise graphs,
eager), samples, and keeps the step in flight.

Speculation: a request scheduled with k drafts is scored on 1 + k rows and verified
by executors/spec_decode.py (greedy prefix match, or lossless rejection sampling);
afterwards the model's MTP layer proposes the next drafts (executors/mtp_drafter.py),
which go back in ModelRunnerOutput with their confidences. A step without seeds,
penalties, prompt logprobs or grammars verifies and drafts on the device
(`SpeculativeDecoder.verifies_on_device`) and is read back with one copy.

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

import torch

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from executors import prompt_logprobs
from executors.batch_invariant import set_batch_invariant
from executors.cuda_graphs import DecodeGraphs, default_capture_sizes
from executors.host_copy import to_device
from executors.host_kv_tier import HostKVTier
from executors.input_builder import Batch, HostBatch, InputBuilder
from executors.kv_cache import PagedKVCache
from executors.kv_transfer import KVTransfer
from executors.models.deepseek import DeepseekForCausalLM
from executors.mtp_drafter import MTPDrafter
from executors.piecewise_graphs import PiecewiseGraphs, default_token_buckets
from executors.request_states import RequestState, RequestStates, record_sampled
from executors.sampler import DeviceSample, sample_on_device, sample_tokens
from executors.spec_chain import Shift, StepBuffers, rows_by_sequence
from executors.spec_decode import VerifyRequest, verify
from executors.speculative_decoder import SpeculativeDecoder, chains
from executors.step_handle import PendingStep, StepResult
from executors.structured_outputs import TokenMasks


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
        self.vocab_size = model.config.vocab_size
        # Queries this short (a decode token plus drafts) take the absorbed MLA path.
        decode_max_query_len = 1 + engine_config.num_speculative_tokens
        # Batch-invariant mode: the model's kernels are switched into it, and a step takes
        # the absorbed path only for output positions (InputBuilder._absorbed).
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
        self.requests = RequestStates(eos_token_id)
        # KV exported to a decode engine, and imported from a prefill engine.
        self.kv_transfer = KVTransfer(kv_cache, engine_config.role is EngineRole.DECODE)
        self.inputs = InputBuilder(
            self.requests, self.block_size, self.vocab_size, self.device,
            self.batch_invariant, decode_max_query_len, self.max_drafts,
        )  # fmt: skip
        # Host memory for evicted prefix blocks; set by the TorchExecutor (kv_host_cache_gib).
        self.host_tier: HostKVTier | None = None
        self._pending: PendingStep | None = None  # the latest step launched and not read
        self.num_chained_steps = 0  # steps that chained on a verify step in flight
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        # Query length -> its verify graphs: 1 + k, and 1 + L for the shorter uniform
        # steps that varlen (spec_policy) and trimmed drafts schedule.
        self.verify_graphs_by_len: dict[int, DecodeGraphs] = {}
        self.piecewise: PiecewiseGraphs | None = None  # set by enable_cuda_graphs
        self.masks = TokenMasks(self.vocab_size, self.device)
        # Drafts come from the MTP layer when the cache holds its KV; without one the
        # runner still verifies drafts it is given (on the host: `_sample`).
        self.speculator: SpeculativeDecoder | None = None
        if engine_config.num_speculative_tokens and kv_cache.mtp_layers:
            drafter = MTPDrafter(
                model, kv_cache.mtp_layers[0], engine_config.num_speculative_tokens,
                self.block_size, decode_max_query_len, self.batch_invariant,
            )  # fmt: skip
            self.speculator = SpeculativeDecoder(
                drafter, self.requests, self.device, self.generator, self.batch_invariant,
                decode_max_query_len,
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
        if self.speculator is not None and not self.batch_invariant:
            # A pass's rows: up to 1 + k a request (pass 1 after a verify step).
            max_rows = max(sizes) * (1 + self.max_drafts)
            self.speculator.drafter.enable_graphs(
                max_rows, max_blocks, self.kv_cache.scratch_block, capture
            )
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

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply `out`'s changes to the requests the runner holds (RequestStates.update);
        nothing of a request that ended, or that (re)starts, stays pending in the
        drafter."""
        if self.speculator is not None:
            restarted = {sr.req_id for sr in out.scheduled if sr.block_table is not None}
            self.speculator.forget(out.finished_req_ids | out.preempted_req_ids | restarted)
        self.requests.update(out)

    def _drop(self, out: SchedulerOutput) -> None:
        """Forget the requests `out` says ended or were preempted."""
        ended = out.finished_req_ids | out.preempted_req_ids
        self.requests.drop(ended)
        self.kv_transfer.forget(ended)
        if self.speculator is not None:
            self.speculator.forget(ended)

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
        if self.host_tier is not None:  # first: the tier's slots are booked once scheduled
            self.host_tier.apply(out)
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
        self.kv_transfer.apply(out)  # a decode engine's imported prompts, before the forward
        if out.is_empty:
            return PendingStep(result=StepResult(ModelRunnerOutput()))
        speculator = self.speculator
        host = self.inputs.collect(out.scheduled, prev, drafting=speculator is not None)
        fill, behind = self._fill(host, prev)
        hidden, indices, input_ids = self._forward(host, fill)
        logits = self.model.compute_logits(hidden[indices])  # [N, vocab]
        if on_device and speculator is not None:
            pending = speculator.verify_and_draft_on_device(
                out, host, hidden, logits, input_ids, behind
            )
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
        if speculator is not None:
            speculator.draft(host, hidden, result.output, out)
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
            md_host = self.inputs.metadata(host, torch.device("cpu"))
            md = md_host.to(self.device)
            hidden = self.piecewise.run(
                host.input_ids, host.positions, md_host.slot_mapping, md, fill
            )
            input_ids = self.piecewise.input_ids[:t]
        else:
            batch = self.inputs.to_device(host)
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

    def _on_device(self, out: SchedulerOutput) -> bool:
        """Whether the step's sampling can stay on the device until its result is read:
        no drafts to verify or propose, no grammar, no prompt logprobs; with a drafter,
        `SpeculativeDecoder.verifies_on_device`."""
        if self.speculator is not None:
            return self.speculator.verifies_on_device(out)
        for sr in out.scheduled:
            params = self.requests.params(sr)
            if (
                sr.draft_token_ids
                or params is None
                or params.so_args is not None
                or params.prompt_logprobs is not None
            ):
                return False
        return True

    def _independent(self, out: SchedulerOutput, prev: PendingStep) -> bool:
        """Whether `out` can be built while `prev` (launched, unread) runs: its requests
        that prev samples for are not new to the runner and read no history (seeds,
        penalties and min_tokens count outputs); after a verify step on the device, each
        takes its newest token and drafts from it (speculative_decoder.chains)."""
        for sr in out.scheduled:
            if sr.req_id not in prev.rows:
                continue
            state = self.requests.get(sr.req_id)
            params = self.requests.params(sr)
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
            if self.speculator is not None and not chains(sr, prev.chain):
                return False
        return True

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
        if host.rejected_index is not None:
            assert prev.chain is not None
            self.num_chained_steps += 1
            index = to_device(host.rejected_index, torch.int64, self.device)
            behind = prev.chain.rejected[index]
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
        return record_sampled(rows, states, tokens, logprobs, logits, out)

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
        return record_sampled(rows, states, tokens, res.logprobs, logits, ModelRunnerOutput())

"""The runner's speculative decoder: the MTP drafter's proposals and their verification
on the device, with nothing read back until the step's result is.

A step qualifies (`verifies_on_device`) when its requests are unseeded, want no
prompt logprobs or grammar, and read no history. `verify_and_draft_on_device` verifies
the step's drafts (executors/spec_decode.py), builds the drafter's first pass from the rows
each request keeps (`_draft_inputs`) and returns a handle whose `tokens` hold each
request's newest token and next drafts, and whose `chain` says what it rejected, for
the next step to chain on (executors/spec_chain.py). Other steps verify on the host
(ModelRunner._sample) and draft after it (`draft`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer.sampling_params import SamplingParams
from executors.host_copy import PackedCopy, to_device
from executors.input_builder import HostBatch
from executors.mtp_drafter import DeviceDraftInput, Drafts, MTPDrafter
from executors.request_states import RequestStates, record_sampled
from executors.sampler import LogprobTensors, logprob_tensors, raw_logprobs
from executors.spec_chain import Chained
from executors.spec_decode import DeviceVerify, history_free, verify_on_device
from executors.step_handle import PendingStep, StepResult


def chains(sr: ScheduledRequest, chain: Chained | None) -> bool:
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


class SpeculativeDecoder:
    """Drafts with the model's MTP layer and verifies drafts on the device.

    drafter: the MTP drafter (its `pending` holds, per request, the last row of a prompt
    chunk that did not sample, which the next chunk's first pass starts at); the
    profiler and the speculative benchmark swap in a wrapper of it. requests: the
    runner's request states (read, and given each request's latest proposal).
    generator: the runner's, shared with its sampler."""

    def __init__(
        self,
        drafter: MTPDrafter,
        requests: RequestStates,
        device: torch.device,
        generator: torch.Generator,
        batch_invariant: bool,
        decode_max_query_len: int,
    ) -> None:
        self.drafter = drafter
        self.requests = requests
        self.device = device
        self.generator = generator
        self.batch_invariant = batch_invariant
        self.decode_max_query_len = decode_max_query_len

    def forget(self, req_ids: Iterable[str]) -> None:
        """Nothing of these requests' past stays pending in the drafter (they ended, were
        preempted, or (re)start with a whole block table)."""
        for req_id in req_ids:
            self.drafter.pending.pop(req_id, None)

    def verifies_on_device(self, out: SchedulerOutput) -> bool:
        """Whether the step can verify and draft on the device (spec_chain.py):
        its requests are unseeded, without prompt logprobs or grammar, and their processing
        reads no history (spec_decode.history_free); each decodes its newest token (plus
        drafts, at output positions, on the absorbed path) or computes a chunk of tokens
        the host knows (a prompt chunk, or a resumed request's recompute that starts in
        its prompt: one that starts past it counts as a decode, and goes to the host)."""
        for sr in out.scheduled:
            params = self.requests.params(sr)
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
                or not sr.will_sample
                or sr.num_tokens != 1 + len(sr.draft_token_ids)
                or sr.num_tokens > self.decode_max_query_len
                or sr.req_id in self.drafter.pending
            ):
                return False
        return bool(out.scheduled)

    def verify_and_draft_on_device(
        self,
        out: SchedulerOutput,
        host: HostBatch,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        behind: torch.Tensor | None,
    ) -> PendingStep:
        """Verify and draft with nothing read back (`verifies_on_device`): the handle
        carries each sampling request's newest token and drafts, and what it rejected, for
        the next step to chain on (spec_chain.py); `result()` reads everything with one
        copy. hidden [T', hidden] (T' >= T: graph padding), logits [N, vocab],
        input_ids [T]; behind [B] (device; None: nowhere): how far each request's rows lie
        before the positions the host built them at (ModelRunner._fill)."""
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
            res = record_sampled(rows, states, tokens, logprobs, logits, ModelRunnerOutput())
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

    def draft(
        self, host: HostBatch, hidden: torch.Tensor, out: ModelRunnerOutput, step: SchedulerOutput
    ) -> None:
        """The MTP layer's next drafts for every request that sampled (mtp_drafter.py):
        as many as the step asks for (varlen), else the engine's num_speculative_tokens.
        hidden [T, hidden]: the step's final hidden states."""
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

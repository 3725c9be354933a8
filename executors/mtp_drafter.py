"""MTP drafting: the model's multi-token-prediction layer proposes the next k tokens.

After each target step, for every request the MTP layer (DeepSeek-V3 layout,
executors/models/mtp.py) runs over the positions whose next token is now known:

    pass 1 (all requests of the step, one varlen batch): row p combines the target's
        final-normed hidden state at p with the token at p + 1 and writes the MTP
        layer's KV at p; the row of the request's newest token (the one just sampled
        or accepted) gives draft 1 (for the position after it).
    pass j = 2..k (one row per drafting request): the MTP block output of pass j - 1
        with draft j - 1, at the next position, gives draft j (the one MTP layer is
        chained, as DeepSeek does).

The MTP layer keeps its own paged KV (`PagedKVCache.mtp_layers`) in the request's
block table. A verify step's rows past the accepted prefix are never given to pass 1
(their inputs were rejected drafts); chained passes write the positions past it, and
the next step's pass 1 rewrites them before any query can see them (attention reads
keys up to the query's own position, written in the same pass). The scheduler holds
k - 1 lookahead slots for those chained positions.

A prompt chunk that ends before the prompt does leaves its last position pending (its
next token arrives with the next chunk): the drafter keeps that hidden state, and the
next chunk's pass 1 starts one position earlier.

Drafts are the MTP layer's argmax (verification treats them as deterministic, so
sampling stays lossless); a draft's confidence is its softmax probability.

With expert parallelism the MTP layer's experts are sharded like the model's, so each
pass is one more MoE exchange: before pass 1 the drafter offers its pass count
(`mtp_passes`) and the rank pads to the largest over the ranks
(executors/distributed/expert_parallel.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from executors.attention import build_attention_metadata, token_positions
from executors.cuda_graphs import default_capture_sizes
from executors.draft_graphs import DraftGraphs
from executors.host_copy import to_device
from executors.models.deepseek import DeepseekForCausalLM
from executors.models.moe import MoE
from executors.spec_chain import Shift, StepBuffers, rows_by_sequence


def mtp_passes(
    k: int, has_rows: bool, last_positions: Sequence[int], table_slots: Sequence[int]
) -> int:
    """The MTP layer forwards of one drafting step: none without rows; pass 1 alone when
    no request drafts (or k is 0); else pass 1 plus the chained passes of the request
    that chains furthest. A request whose newest row is at position p, with
    `table_slots` slots in its block table, chains while the next position has a slot:
    min(k - 1, slots - 1 - p) passes."""
    if not has_rows:
        return 0
    if k <= 0 or not last_positions:
        return 1
    chained = max(min(k - 1, slots - 1 - p) for p, slots in zip(last_positions, table_slots))
    return 1 + max(0, chained)


@dataclass
class DraftInput:
    """One request's part of pass 1."""

    req_id: str
    first_pos: int  # position of its first MTP row
    hidden: torch.Tensor  # [rows, hidden]: the target's hidden states at those positions
    next_ids: list[int]  # [rows]: the token after each position
    block_table: list[int]
    wants_drafts: bool  # its newest token is known: draft from the last row
    num_prompt: int = 0  # the request's prompt length (batch-invariant mode's routing)


@dataclass
class Drafts:
    tokens: dict[str, list[int]]  # req_id -> up to k drafts
    confidences: dict[str, list[float]]  # req_id -> each draft's probability


@dataclass
class DeviceDraftInput:
    """One request's part of pass 1 in a step whose results stay on the device."""

    req_id: str
    first_pos: int  # position of its first row, where the host placed it
    hidden: torch.Tensor  # [rows, hidden]: the target's hidden states at those positions
    next_ids: torch.Tensor  # [rows] (device): the token after each (past the accepted: any)
    block_table: list[int]
    newest: int | None  # its newest token's row if every draft is accepted; None: no drafts
    num_prompt: int = 0  # the request's prompt length (batch-invariant mode's routing)


@dataclass
class DeviceDrafts:
    """`propose_on_device`'s drafts, nothing read back."""

    ids: torch.Tensor  # [B, P] int64: request i's drafts in its first counts[i] columns
    confidences: torch.Tensor  # [B, P] float32
    counts: list[int]  # [B] (host): drafts proposed for each request


class MTPDrafter:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_cache: torch.Tensor,
        num_drafts: int,
        block_size: int,
        decode_max_query_len: int,
        batch_invariant: bool = False,
    ) -> None:
        """batch_invariant: pass 1 routes rows as the model runner does in that mode (prompt
        positions by the prefill path, outputs by the absorbed one), so the MTP layer's KV,
        and with it the drafts and their probabilities, never depend on the batch."""
        if model.mtp is None:
            raise ValueError("speculation needs the model's MTP layer, and none was loaded")
        self.model = model
        self.mtp = model.mtp
        self.kv_cache = kv_cache  # [num_blocks, block_size, L + R]: the MTP layer's cache
        self.k = num_drafts
        self.block_size = block_size
        self.decode_max_query_len = decode_max_query_len
        self.batch_invariant = batch_invariant
        self.device = next(model.parameters()).device
        # Expert parallelism: the lock-step the MTP layer's MoE exchanges in (None: none).
        mlp = self.mtp.drafting_mlp()
        self.lockstep = mlp.ep if isinstance(mlp, MoE) else None
        # req_id -> (position, the target's hidden state there [hidden]) of a prompt
        # chunk's last position, whose next token comes with the next chunk.
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}
        self.graphs: DraftGraphs | None = None  # set by enable_graphs

    def enable_graphs(
        self, max_rows: int, max_blocks_per_seq: int, scratch_block: int, capture: bool
    ) -> None:
        """Run passes of up to `max_rows` rows through CUDA graphs (draft_graphs.py);
        capture=False (the CPU tests) runs the same static buffers eagerly. Not in
        batch-invariant mode, whose passes route prompt rows by the prefill path."""
        if self.batch_invariant:
            raise ValueError("the drafter's CUDA graphs do not keep batch-invariant routing")
        self.graphs = DraftGraphs(
            self.model, self.kv_cache, self.block_size, max_blocks_per_seq, scratch_block,
            default_capture_sizes(max_rows),
        )  # fmt: skip
        if capture:
            self.graphs.capture()

    def step_inputs(
        self,
        req_ids: Sequence[str],
        starts: Sequence[int],
        query_lens: Sequence[int],
        input_ids: Sequence[int],
        hidden: torch.Tensor,
        sampled: Mapping[str, list[int]],
        num_drafts: Mapping[str, int],
        block_tables: Mapping[str, list[int]],
        num_prompt: Mapping[str, int] | None = None,
    ) -> list[DraftInput]:
        """Pass 1's rows from a target step: requests in batch order, each `query_lens`
        tokens from position `starts` (input_ids, hidden: [T] and [T, hidden]); `sampled`:
        the tokens each sampling request got (accepted drafts, then the new token) of the
        `num_drafts` it verified. Rows of rejected drafts are left out; a request that did
        not sample leaves its last position pending, which its next step's rows start at."""
        inputs = []
        offset = 0
        for rid, start, n in zip(req_ids, starts, query_lens):
            rows = hidden[offset : offset + n]  # [n, hidden]: positions start..start + n - 1
            ids = list(input_ids[offset + 1 : offset + n])  # next tokens of start..start + n - 2
            first_token = input_ids[offset]
            offset += n
            toks = sampled.get(rid)
            pending = self.pending.pop(rid, None)
            if toks is not None:  # rows up to the newest token: accepted drafts, then it
                keep = n - num_drafts.get(rid, 0) + len(toks) - 1
                rows, ids = rows[:keep], ids[: keep - 1] + [toks[-1]]
            else:  # the last position's next token comes with the next chunk
                self.pending[rid] = (start + n - 1, rows[-1].clone())
                rows = rows[:-1]
            first = start
            if pending is not None and pending[0] == start - 1:
                first, rows, ids = (
                    start - 1,
                    torch.cat([pending[1][None], rows]),
                    [first_token] + ids,
                )
            n_prompt = num_prompt.get(rid, 0) if num_prompt is not None else 0
            inputs.append(
                DraftInput(rid, first, rows, ids, block_tables[rid], toks is not None, n_prompt)
            )
        return inputs

    def propose(self, inputs: list[DraftInput], num_drafts: int | None = None) -> Drafts:
        """Up to `num_drafts` drafts per request (None: the drafter's k; at most k)."""
        k = self.k if num_drafts is None else min(num_drafts, self.k)
        out = Drafts({}, {})
        inputs = [x for x in inputs if x.next_ids]
        self._agree_passes(k, bool(inputs), [
            (x.first_pos + len(x.next_ids) - 1, x.block_table) for x in inputs if x.wants_drafts
        ])  # fmt: skip
        if not inputs:
            return out
        # Pass 1, decode-first (short queries take the absorbed MLA path).
        inputs.sort(key=lambda x: not self._absorbed(x))
        num_decode = sum(self._absorbed(x) for x in inputs)
        h = self._run(
            torch.cat([x.hidden for x in inputs]),
            [t for x in inputs for t in x.next_ids],
            [x.first_pos for x in inputs],
            [len(x.next_ids) for x in inputs],
            [x.block_table for x in inputs],
            num_decode,
        )  # [rows, hidden]
        ends = torch.tensor([len(x.next_ids) for x in inputs]).cumsum(0) - 1
        drafting = [i for i, x in enumerate(inputs) if x.wants_drafts]
        if not drafting or k <= 0:  # pass 1 still wrote the MTP layer's KV
            return out
        reqs = [inputs[i] for i in drafting]
        last = h[ends[drafting].to(self.device)]  # [B, hidden]
        pos = [x.first_pos + len(x.next_ids) - 1 for x in reqs]  # position of each last row
        # Each pass's drafts stay on the device, chained into the next pass as its input
        # ids: the host reads them all at the end, with one synchronisation.
        passes: list[tuple[list[DraftInput], torch.Tensor, torch.Tensor]] = []
        for j in range(k):
            logits = self.mtp.compute_logits(self.model, last)  # [B_j, vocab]
            conf, ids = logits.softmax(dim=-1).max(dim=-1)  # [B_j] each
            passes.append((reqs, ids, conf))
            if j + 1 == k:
                break
            # Chain: the next position needs a slot in the request's table.
            keep = [
                i for i, (r, p) in enumerate(zip(reqs, pos))
                if (p + 1) // self.block_size < len(r.block_table)
            ]  # fmt: skip
            if not keep:
                break
            if len(keep) < len(reqs):
                sel = torch.tensor(keep, device=self.device)
                last, ids = last[sel], ids[sel]
                reqs, pos = [reqs[i] for i in keep], [pos[i] for i in keep]
            pos = [p + 1 for p in pos]
            last = self._run(
                last, ids, pos, [1] * len(reqs), [r.block_table for r in reqs], len(reqs)
            )
        # float64 holds every token id exactly: one copy for ids and confidences.
        flat = torch.cat([torch.stack([i.double(), c.double()]) for _, i, c in passes], dim=1)
        all_ids, all_conf = flat.tolist()
        at = 0
        for reqs_j, _, _ in passes:
            for r in reqs_j:
                out.tokens.setdefault(r.req_id, []).append(int(all_ids[at]))
                out.confidences.setdefault(r.req_id, []).append(all_conf[at])
                at += 1
        return out

    def propose_on_device(
        self,
        inputs: list[DeviceDraftInput],
        behind: torch.Tensor,
        rejected: torch.Tensor,
        num_drafts: int | None = None,
    ) -> DeviceDrafts:
        """`propose` for a step whose results stay on the device (spec_chain.py). Each
        input's rows start where the host placed them (assuming the drafts of the step
        before were all accepted); `behind` [B] (device): how far they lie before that;
        `rejected` [B]: the drafts each rejected now. Rows past a request's accepted ones
        write MTP KV that the next step rewrites before any query reads it. Drafts come
        from each sampling input's newest row, `rejected` before its `newest`, at
        positions `behind + rejected` before where the host would put them. The result's
        rows follow `inputs` (zeros, count 0, for inputs that do not draft)."""
        k = self.k if num_drafts is None else min(num_drafts, self.k)
        self._agree_passes(k, bool(inputs), [
            (x.first_pos + x.newest, x.block_table) for x in inputs if x.newest is not None
        ])  # fmt: skip
        b = len(inputs)
        ids_out = torch.zeros(b, max(k, 1), dtype=torch.int64, device=self.device)
        conf_out = torch.zeros(b, max(k, 1), dtype=torch.float32, device=self.device)
        counts = [0] * b
        if not inputs:
            return DeviceDrafts(ids_out[:, :0], conf_out[:, :0], counts)
        # Pass 1, decode-first (short queries take the absorbed MLA path).
        order = sorted(range(b), key=lambda i: not self._absorbed(inputs[i]))
        sorted_in = [inputs[i] for i in order]
        order_t = to_device(order, torch.int64, self.device)
        h = self._run(
            torch.cat([x.hidden for x in sorted_in]),
            torch.cat([x.next_ids for x in sorted_in]),
            [x.first_pos for x in sorted_in],
            [len(x.next_ids) for x in sorted_in],
            [x.block_table for x in sorted_in],
            sum(self._absorbed(x) for x in sorted_in),
            behind[order_t],
        )  # [rows, hidden]
        starts = [0]
        for x in sorted_in[:-1]:
            starts.append(starts[-1] + len(x.next_ids))
        drafting = [j for j, x in enumerate(sorted_in) if x.newest is not None]
        if not drafting or k <= 0:  # pass 1 still wrote the MTP layer's KV
            return DeviceDrafts(ids_out[:, :k], conf_out[:, :k], counts)
        reqs = [order[j] for j in drafting]  # indices into `inputs`
        newest = [starts[j] + sorted_in[j].newest for j in drafting]  # type: ignore[operator]
        reqs_t = to_device(reqs, torch.int64, self.device)
        last = h[to_device(newest, torch.int64, self.device) - rejected[reqs_t]]  # [D, hidden]
        # Positions of the newest rows if every draft is accepted (the scheduler's lookahead
        # holds the chained ones), and how far the true ones lie before them.
        pos = [inputs[r].first_pos + inputs[r].newest for r in reqs]  # type: ignore[operator]
        amount = (behind + rejected)[reqs_t]  # [D]
        for j in range(k):
            logits = self.mtp.compute_logits(self.model, last)  # [B_j, vocab]
            conf, ids = logits.softmax(dim=-1).max(dim=-1)  # [B_j] each
            sel = to_device(reqs, torch.int64, self.device)
            ids_out[sel, j] = ids
            conf_out[sel, j] = conf.float()
            for r in reqs:
                counts[r] += 1
            if j + 1 == k:
                break
            keep = [
                i for i, (r, p) in enumerate(zip(reqs, pos))
                if (p + 1) // self.block_size < len(inputs[r].block_table)
            ]  # fmt: skip
            if not keep:
                break
            if len(keep) < len(reqs):
                kept = to_device(keep, torch.int64, self.device)
                last, ids, amount = last[kept], ids[kept], amount[kept]
                reqs, pos = [reqs[i] for i in keep], [pos[i] for i in keep]
            pos = [p + 1 for p in pos]
            last = self._run(
                last, ids, pos, [1] * len(reqs), [inputs[r].block_table for r in reqs],
                len(reqs), amount,
            )  # fmt: skip
        return DeviceDrafts(ids_out[:, :k], conf_out[:, :k], counts)

    def _agree_passes(self, k: int, has_rows: bool, drafting: list[tuple[int, list[int]]]) -> None:
        """Expert parallelism: before pass 1, offer the passes this step runs (`mtp_passes`
        of each drafting request's newest position and block table) to the other ranks,
        which all run the largest offer (the rank pads the rest at the round's end)."""
        if self.lockstep is not None:
            self.lockstep.agree_draft_passes(mtp_passes(
                k, has_rows, [p for p, _ in drafting],
                [len(table) * self.block_size for _, table in drafting],
            ))  # fmt: skip

    def _absorbed(self, x: DraftInput | DeviceDraftInput) -> bool:
        """Pass 1's rows of `x` take the absorbed path: short ones, or in batch-invariant
        mode exactly those past the prompt (the model runner's rule)."""
        if self.batch_invariant:
            return x.first_pos >= x.num_prompt
        return len(x.next_ids) <= self.decode_max_query_len

    def _run(
        self,
        hidden: torch.Tensor,
        next_ids: list[int] | torch.Tensor,
        first_pos: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        num_decode: int,
        behind: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One MTP forward over a varlen batch -> block outputs [rows, hidden] (through the
        graphs when they hold the rows: a view valid until the next pass). next_ids: a
        list, or a device tensor [rows] (a chained pass: the previous pass's drafts).
        behind [requests] (device): how far each request's rows lie before `first_pos`
        (spec_chain.Shift); None: nowhere."""
        seq_of = rows_by_sequence(query_lens)
        if self.graphs is not None and self.graphs.fits(len(next_ids), block_tables):
            positions_ = token_positions(query_lens, first_pos).tolist()
            shift = None
            if behind is not None:  # the graphs hold one single-row sequence a row
                per_row = behind[to_device(seq_of, torch.int64, self.device)]
                shift = Shift(per_row, list(range(len(seq_of))), self.block_size)
            return self.graphs.run_rows(
                hidden, next_ids, positions_, block_tables, query_lens, shift
            )
        md_host = build_attention_metadata(
            query_lens, first_pos, block_tables, self.block_size, num_decode, torch.device("cpu")
        )
        extra = [torch.from_numpy(token_positions(query_lens, first_pos))]
        if not isinstance(next_ids, torch.Tensor):
            extra.append(torch.tensor(next_ids, dtype=torch.int64))
        # one copy, through pinned memory (a pageable copy would wait for the step in flight)
        md, moved = md_host.moved_with(self.device, extra)
        positions = moved[0]
        ids = next_ids.to(self.device) if isinstance(next_ids, torch.Tensor) else moved[1]
        if behind is not None:
            Shift(behind, seq_of, self.block_size).apply(StepBuffers(
                ids, positions, [md.slot_mapping], md.seq_lens, md.context_lens, md.block_tables
            ))  # fmt: skip
        return self.mtp(self.model, hidden, ids, positions, md, self.kv_cache)

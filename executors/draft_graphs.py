"""CUDA graphs of the MTP drafter's passes (executors/mtp_drafter.py).

Eagerly, a drafter pass launches the MTP layer's ~50 kernels from Python, and a
speculating step runs 1 + (k - 1) of them: at small batches that costs more than the
target's own (graphed) step. Every pass is captured here as a decode batch of single
rows: row p of a request is a one-token query at position p over the request's
block table, attending to keys 0..p. That is exactly what the varlen pass computes,
since the layer writes every row's KV before any row attends, so the rows of one
request written in the same pass are seen by its later rows. Graphs are bucketed by
row count (`DecodeGraphs`' padding: rows at position 0 of the scratch block). The
input hidden states [rows, hidden] go into a static buffer too. Batch-invariant mode
keeps the eager passes: its routing rule sends prompt rows through the prefill path.
"""

from __future__ import annotations

import torch

from executors.cuda_graphs import DecodeGraphs
from executors.models.deepseek import DeepseekForCausalLM
from executors.spec_chain import Shift


class DraftGraphs(DecodeGraphs):
    """Captured MTP block forwards over single-row queries, one per bucketed row count."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        sizes: list[int],
    ) -> None:
        super().__init__(model, [kv_cache], block_size, max_blocks_per_seq, scratch_block, sizes)
        assert model.mtp is not None
        self.mtp = model.mtp
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        self.prev = torch.zeros(
            self.max_size, embed.shape[1], dtype=embed.dtype, device=embed.device
        )

    def _forward(self, size: int) -> torch.Tensor:
        # [size, hidden]; the drafter computes logits for the rows it reads
        return self.mtp(
            self.model, self.prev[:size], self.input_ids[:size], self.positions[:size],
            self.metadata(size), self.kv_caches[0],
        )  # fmt: skip

    def fits(self, num_rows: int, block_tables: list[list[int]]) -> bool:
        return num_rows <= self.max_size and max(map(len, block_tables)) <= self.max_blocks_per_seq

    def run_rows(
        self,
        hidden: torch.Tensor,
        next_ids: list[int] | torch.Tensor,
        positions: list[int],
        block_tables: list[list[int]],
        repeats: list[int] | None = None,
        shift: Shift | None = None,
    ) -> torch.Tensor:
        """One pass over single-row queries: hidden [rows, hidden] at `positions`, the
        next token of each (a list, or a device tensor [rows]), the block tables (each
        shared by `repeats` consecutive rows; default one a row) -> block outputs [rows,
        hidden] (a view of a static buffer: valid until the next run). shift: moves the
        rows back once loaded (spec_chain.py; one sequence a row)."""
        rows = len(positions)
        size = self._load(next_ids, positions, block_tables, repeats)
        if shift is not None:
            shift.apply(self.buffers())
        self.prev[:rows].copy_(hidden)
        graph = self.graphs.get(size)
        if graph is None:  # not captured (the CPU tests): the same buffers, eagerly
            return self._forward(size)[:rows]
        graph.replay()
        return self.hidden[size][:rows]

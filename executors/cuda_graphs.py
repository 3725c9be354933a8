"""CUDA graphs of the decode forward, one per bucketed batch size.

A decode step launches some 50 kernels per layer; from Python each launch costs
more than the kernel itself at small batches, so the step is launch-bound.
Graphs replay the whole forward (embedding to the final norm) with one launch; the
runner computes the logits of the rows it samples outside the graph, so no captured
size keeps a [rows, vocab] float32 output alive (Moonlight's vocabulary: 640 KiB a
row, 1.3 GiB for 512 requests scoring 4 tokens) and every query length can have a
graph at every batch size.

A graph reads fixed buffers, so a step copies its inputs into them and runs the
graph of the smallest captured size >= its batch. Padding rows are requests of
one token at position 0 whose block table points at a scratch block that the
scheduler never hands out (the KV cache holds one extra block for it), so their
cache writes and attention reads touch no real request's data; their hidden states
are never read. Graphs serve pure-decode steps (every request schedules one token) and,
with `query_len` = 1 + k, verify steps in which every request scores 1 + k tokens
(the runner keeps one DecodeGraphs per query length, so graphs are bucketed by
requests and tokens per request); prefill chunks and ragged steps run piecewise (or
eagerly past the largest token bucket). `run` returns the final hidden states (the
sampler's logits and the MTP drafter read them).
Without `capture()` (on the CPU, in tests) `run` executes the same padded forward
over the same buffers eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from executors.attention import AttentionMetadata
from executors.models.deepseek import DeepseekForCausalLM
from executors.spec_chain import StepBuffers

logger = logging.getLogger(__name__)


def default_capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 64 beyond; up to max_batch.

    Finer steps where a padded row costs most (small batches are weight-read bound, so
    padding costs little in time; the steps only bound the graphs' number)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 257, 32))
    sizes += list(range(320, max(max_batch, 256) + 64, 64))
    capped = [s for s in sizes if s < max_batch] + [max_batch]
    return sorted(set(capped))


class DecodeGraphs:
    """Captured decode forwards of the model, sharing one memory pool and one set of
    input buffers (the largest size's; smaller graphs read their prefixes)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        sizes: list[int],
        query_len: int = 1,
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        if not 1 <= query_len <= block_size:
            raise ValueError(f"query_len={query_len}: padding needs 1..block_size slots")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        dev = kv_caches[0].device
        n = self.max_size
        q = self.query_len = query_len
        # Static inputs, one [4, n * q] buffer so that a step fills them with one copy:
        # token ids, positions, cache slots (per token), sequence lengths (per request,
        # the first n). Rows start as padding: q tokens at positions 0..q-1 of the
        # scratch block.
        self._rows = torch.zeros(4, n * q, dtype=torch.int64, device=dev)
        self._rows[1] = torch.arange(q, device=dev).repeat(n)
        self._rows[2] = scratch_block * block_size + self._rows[1]
        self._rows[3] = q
        self.input_ids, self.positions, self.slot_mapping, seq_lens = self._rows.unbind(0)
        self.seq_lens = seq_lens[:n]
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), scratch_block, dtype=torch.int64, device=dev
        )
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=dev) * q
        self._empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self._zero = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # size -> [size * q, hidden]
        self.last_hidden: torch.Tensor | None = None  # of the latest run (its first rows)
        self.pool = None

    def metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` requests of the buffers: all requests decode."""
        q = self.query_len
        return AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[: size * q],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.seq_lens[:size] - q,
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decode_reqs=size,
            num_decode_tokens=size * q,
            prefill_cu_seqlens_q=self._zero,
            prefill_cu_seqlens_k=self._zero,
            prefill_kv_slots=self._empty,
            prefill_max_query_len=0,
        )

    def buffers(self) -> StepBuffers:
        """The static inputs, one sequence a request (context lengths follow from seq_lens
        inside the forward)."""
        return StepBuffers(
            self.input_ids, self.positions, [self.slot_mapping], self.seq_lens, None,
            self.block_tables,
        )  # fmt: skip

    def _forward(self, size: int) -> torch.Tensor:
        t = size * self.query_len
        return self.model(
            self.input_ids[:t], self.positions[:t], self.metadata(size), self.kv_caches
        )  # [t, hidden]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller ones reuse its pool)."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs of %d-token queries (batch %d..%d) in %.1f s",
            len(self.sizes),
            self.query_len,
            self.sizes[0],
            self.max_size,
            time.perf_counter() - t0,
        )

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` requests, or None."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        fill: Callable[[StepBuffers], None] | None = None,
    ) -> torch.Tensor:
        """query_len tokens per request (input_ids, positions: [b * query_len], request
        by request) -> final-normed hidden [size * query_len, hidden] (rows past
        len(input_ids) are padding), also kept as `last_hidden`. Valid until the next
        run. fill: completes the loaded buffers on the device (ids the step before
        samples, positions it moves back: ModelRunner.launch, executors/spec_chain.py)."""
        size = self._load(input_ids, positions, block_tables)
        if fill is not None:
            fill(self.buffers())
        graph = self.graphs.get(size)
        if graph is None:  # not captured (the CPU tests): the same buffers, run eagerly
            self.last_hidden = self._forward(size)
        else:
            graph.replay()
            self.last_hidden = self.hidden[size]
        return self.last_hidden

    def _load(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        block_tables: list[list[int]],
        repeats: list[int] | None = None,
    ) -> int:
        """Copy a step's inputs into the static buffers; the graph size that holds it.

        input_ids: a list, or a device tensor (the drafter's chained passes: copied on the
        device, so the host never waits for the pass before). repeats: how many requests
        (query_len rows each) share each of `block_tables` (the drafter's first pass: one
        table a request, one single-token request a position); default one each."""
        q = self.query_len
        b = len(positions) // q
        counts = [1] * len(block_tables) if repeats is None else repeats
        assert b * q == len(positions) == len(input_ids) and b == sum(counts)
        size = self.size_for(b)
        if size is None:
            raise ValueError(f"decode batch of {b} exceeds the largest graph ({self.max_size})")
        bs = self.block_size
        lens = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
        width = int(lens.max())
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block table of {width} blocks exceeds the graphs' {self.block_tables.shape[1]}"
            )
        # Vectorised: a Python list per entry costs host time in proportion to the batch.
        tables = np.full((len(block_tables), width), self.scratch_block, dtype=np.int64)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        table_of = np.repeat(np.arange(len(block_tables)), counts)  # [b]: each request's
        table = np.full((size, width), self.scratch_block, dtype=np.int64)  # [size, width]
        table[:b] = tables[table_of]
        pos = np.asarray(positions, dtype=np.int64)  # [b * q]
        req = np.repeat(np.arange(b), q)  # [b * q]: each token's request
        page = pos // bs
        if (page >= lens[table_of][req]).any():
            raise ValueError("a position lies past its request's block table")
        pad_pos = np.tile(np.arange(q, dtype=np.int64), size - b)
        rows = np.empty((4, size * q), dtype=np.int64)  # ids, positions, slots, seq_lens
        rows[0] = 0
        if not isinstance(input_ids, torch.Tensor):
            rows[0, : b * q] = input_ids
        rows[1] = np.concatenate([pos, pad_pos])
        rows[2] = np.concatenate(
            [table[req, page] * bs + pos % bs, self.scratch_block * bs + pad_pos]
        )
        rows[3] = q
        rows[3, :b] = pos[q - 1 :: q] + 1
        rows_t, table_t = torch.from_numpy(rows), torch.from_numpy(table)
        if self._rows.is_cuda:  # pinned: the copies need not wait for the host
            rows_t, table_t = rows_t.pin_memory(), table_t.pin_memory()
        self._rows[:, : size * q].copy_(rows_t, non_blocking=True)
        if isinstance(input_ids, torch.Tensor):
            self.input_ids[: b * q].copy_(input_ids)
        # Columns past `width` keep stale pages: the kernel reads no page past seq_len.
        self.block_tables[:size, :width].copy_(table_t, non_blocking=True)
        return size

"""Piecewise CUDA graphs for the steps decode graphs cannot hold (prefill, mixed, verify).

An eager prefill or mixed step launches some 25 kernels per layer from Python; below a
few thousand tokens the GPU waits on the launches, and the step's time follows the host
CPU's speed (`benchmarks/investigations/step_variance.py`). Attention is the only part of a layer whose
work depends on the step's requests (their contexts, chunk boundaries, block tables);
everything else (norms, projections, the RoPE + cache write, o_proj, the router and the
experts) depends on the token count alone. So each step's forward is cut at attention:

    piece 0      embed, layer 0 up to attention            graph
    attention 0  decode and prefill attention of layer 0   eager, on the real tokens
    piece 1      rest of layer 0, layer 1 up to attention  graph
    ...
    piece L      rest of layer L-1, the final norm         graph

and the pieces are captured once per token bucket. A step pads its tokens to the
smallest bucket: padding tokens are token 0 at position 0 whose cache writes go to the
scratch block no request holds; their rows are never attended to or sampled, and every
op in the pieces is row-wise or, in the experts, sums per token, so they cannot change
a real token's result. Without `capture()` (on the CPU, in tests) `run` executes the
same pieces over the same padded buffers eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from executors.attention import AttentionMetadata
from executors.models.deepseek import DeepseekForCausalLM
from executors.spec_chain import StepBuffers

logger = logging.getLogger(__name__)


def default_token_buckets(max_tokens: int, limit: int = 8192) -> list[int]:
    """16, 32, 48, 64, then about 1.33x apart to 2,048, then every 512, to
    min(max_tokens, limit).

    Eager steps stay host-bound (their kernel launches cost more than their matmuls)
    well past 2k tokens, so buckets go on, 512 apart (padding to the next bucket costs
    less than the launches a graph saves), to 8k tokens, where an eager step is bound
    by its matmuls (the launches overlap the GPU work) and padding would cost more than
    a graph saves."""
    sizes = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536]
    sizes += list(range(2048, limit + 1, 512))
    top = min(max_tokens, limit)
    return [s for s in sizes if s < top] + [top]


class PiecewiseGraphs:
    """The forward cut at attention, captured per token bucket; one memory pool and one
    set of static buffers (the largest bucket's; smaller buckets use their prefixes)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        scratch_block: int,
        sizes: list[int],
    ) -> None:
        if not sizes:
            raise ValueError("PiecewiseGraphs needs at least one token bucket")
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        cfg = model.config
        dev = kv_caches[0].device
        dtype = model.lm_head.weight.dtype
        n = self.max_size
        self.scratch_slot = scratch_block * block_size
        # Inputs, one [3, n] buffer filled by one copy: token ids, positions, cache slots.
        self._rows = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self._rows[2] = self.scratch_slot
        self.input_ids, self.positions, self.slot_mapping = self._rows.unbind(0)
        # Between pieces: the residual stream, the queries, the attention output.
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)  # [n, hidden]
        heads = cfg.num_attention_heads
        self.q = torch.zeros(n, heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                             dtype=dtype, device=dev)  # fmt: skip
        self.o = torch.zeros(n, heads, cfg.v_head_dim, dtype=dtype, device=dev)  # [n, H, dv]
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None

    def _piece(self, k: int, size: int) -> None:
        """Piece k over the first `size` rows: finish layer k-1, start layer k."""
        x, o = self.x[:size], self.o[:size]
        if k == 0:
            h = self.model.model.embed_tokens(self.input_ids[:size])  # [size, hidden]
        else:
            h = self.layers[k - 1].attn_out(o, x)
        if k == len(self.layers):
            x.copy_(self.model.model.norm(h))
            return
        x.copy_(h)
        cos_sin = self.model.rotary.cos_sin(self.positions[:size])
        q = self.layers[k].attn_in(x, cos_sin, self.slot_mapping[:size], self.kv_caches[k])
        self.q[:size].copy_(q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first (the rest reuse its pool).

        The pieces run once eagerly first (Triton compiles and cuBLAS picks kernels for
        the bucket), reading zeros or stale rows of `o`: finite values, whose results
        land only in the scratch block and in the buffers, which the next step rewrites.
        """
        t0 = time.perf_counter()
        pieces = len(self.layers) + 1
        for size in reversed(self.sizes):
            for k in range(pieces):
                self._piece(k, size)
            torch.cuda.synchronize()
            graphs = []
            for k in range(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._piece(k, size)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs: %d token buckets (%d..%d) x %d pieces in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.max_size,
            pieces,
            time.perf_counter() - t0,
        )

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds `num_tokens`, or None."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: torch.Tensor,
        md: AttentionMetadata,
        fill: Callable[[StepBuffers], None] | None = None,
    ) -> torch.Tensor:
        """One step's forward -> final-normed hidden [T, hidden] (a view of a buffer,
        valid until the next run). slots: [T] int64 on the host (md.slot_mapping's
        values); md: the step's metadata on the device, for the eager attention;
        fill: completes the input ids on the device (DecodeGraphs.run)."""
        t = len(input_ids)
        size = self.size_for(t)
        if size is None:
            raise ValueError(f"a step of {t} tokens exceeds the largest bucket ({self.max_size})")
        rows = torch.full((3, size), self.scratch_slot, dtype=torch.int64)  # [3, size]
        rows[0, :t] = torch.tensor(input_ids, dtype=torch.int64)
        rows[0, t:] = 0
        rows[1, :t] = torch.tensor(positions, dtype=torch.int64)
        rows[1, t:] = 0
        rows[2, :t] = slots
        if self._rows.is_cuda:  # pinned: the copy need not wait for the host
            rows = rows.pin_memory()
        self._rows[:, :size].copy_(rows, non_blocking=True)
        if fill is not None:  # (md's slot mapping is the eager attention's copy)
            fill(StepBuffers(
                self.input_ids, self.positions, [self.slot_mapping, md.slot_mapping],
                md.seq_lens, md.context_lens, md.block_tables,
            ))  # fmt: skip
        graphs = self.graphs.get(size)
        for k in range(len(self.layers) + 1):
            if graphs is None:  # not captured (the CPU tests): the same pieces, eagerly
                self._piece(k, size)
            else:
                graphs[k].replay()
            if k < len(self.layers):
                attn = self.layers[k].self_attn
                attn.attend(self.q[:t], md, self.kv_caches[k], out=self.o[:t])
        return self.x[:t]

"""Roofline-style step time for a DeepSeek-architecture model on one GPU.

A step is priced per op group as max(FLOPs / (peak * eff), bytes / (HBM bw * eff)),
summed over groups, plus per-layer and per-step fixed overheads (Vidur /
LLMCompass style, but analytic: no profiled tables). Groups:

  dense      attention projections (q or q-LoRA, kv_a, kv_b, o), dense MLPs of the
             first k layers, shared experts, router; weights read once per step
  experts    routed experts: expected distinct experts touched by the batch
  attn_pre   prefill chunks, MLA non-absorbed: per-head attention with qk 192 / v 128
             over context + chunk, causal; cached context latents up-projected by kv_b
  attn_dec   decode (and draft-verify) tokens, MLA absorbed: MQA over the 576-wide
             latent cache; each request's latent KV read once per layer
  lm_head    logits only for positions that sample, plus the embedding gather
  mtp        speculation: the MTP drafter after every step of a speculating engine
             (K = num_speculative_tokens drafts; without it, a step verifying drafts
             stands for one drafting as many as it verifies): one decoder layer plus
             the head each pass, pass 1 over the step's tokens, then K - 1 chained
             passes of one token per sampling request

step_time is called for every simulated step, so the per-request loop only
accumulates a few sums in plain Python floats; model constants are folded in
__init__.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from deepinfer.model_config import ModelConfig
from sim.cost_coefficients import CostCoefficients
from sim.cost_model import CostModel, RunCosts
from sim.hardware import HardwareSpec

if TYPE_CHECKING:
    from deepinfer.decode_run import DecodeRun
    from deepinfer.outputs import SchedulerOutput


class GroupCost(NamedTuple):
    flops: float
    bytes: float
    seconds: float  # max of the compute and memory times


def expected_distinct_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected number of experts hit when `num_tokens` tokens each pick `top_k` of `num_experts`.

    Under uniform routing an expert escapes one token with probability
    1 - k/E, so E * (1 - (1 - k/E)^T) for T tokens; it tends to E as T grows.
    """
    if num_tokens <= 0 or num_experts <= 0:
        return 0.0
    if top_k >= num_experts:
        return float(num_experts)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


class AnalyticCostModel(CostModel):
    """Prices a SchedulerOutput from FLOPs and bytes; see the module docstring."""

    def __init__(
        self,
        model: ModelConfig,
        hardware: HardwareSpec,
        coeffs: CostCoefficients,
        num_speculative_tokens: int = 0,
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: must be >= 0")
        self.num_speculative_tokens = num_speculative_tokens
        self.model = model
        self.hardware = hardware
        self.coeffs = coeffs
        m, c = model, coeffs
        ab = c.activation_bytes
        h, heads, layers = m.hidden_size, m.num_attention_heads, m.num_hidden_layers
        dense_layers, moe_layers = m.num_dense_layers, m.num_moe_layers

        # Rates (FLOP/s, bytes/s) with efficiencies folded in.
        self._mm_rate = hardware.peak_flops(m.dtype_bytes) * c.matmul_efficiency
        self._moe_rate = hardware.peak_flops(m.dtype_bytes) * c.moe_matmul_efficiency
        # Attention and the lm head run in bf16 even when the other weights are fp8.
        self._attn_rate = hardware.peak_bf16_flops * c.attention_efficiency
        self._head_rate = hardware.peak_bf16_flops * c.matmul_efficiency
        self._bw = hardware.hbm_bandwidth * c.bandwidth_efficiency
        self._moe_bw = hardware.hbm_bandwidth * c.moe_bandwidth_efficiency
        self._fixed = layers * c.layer_overhead_s + c.step_overhead_s

        # dense: every token multiplies these (kv_b stands for the absorbed W_UK / W_UV
        # in the decode form: same FLOPs per token).
        attn_w = m.q_proj_params + m.kv_a_params + m.kv_b_params + m.o_proj_params
        shared = m.n_shared_experts * m.expert_params + m.router_params
        dense_params = layers * attn_w + dense_layers * m.dense_mlp_params + moe_layers * shared
        self._dense_flops_per_tok = 2.0 * dense_params
        self._dense_weight_bytes = float(dense_params * m.dtype_bytes)
        # Activation traffic per token: each linear reads its input and writes its output.
        q_io = h + heads * m.qk_head_dim
        if m.q_lora_rank is not None:
            q_io += 2 * m.q_lora_rank
        kvb_io = m.kv_lora_rank + heads * (m.qk_nope_head_dim + m.v_head_dim)
        attn_io = q_io + (h + m.kv_entry_dim) + kvb_io + (heads * m.v_head_dim + h) + 4 * h
        mlp_io = 2 * h + 6 * m.intermediate_size  # gate_up in/out, act, down in/out
        shared_inter = m.n_shared_experts * m.moe_intermediate_size
        shared_io = (2 * h + 6 * shared_inter + m.n_routed_experts) if moe_layers else 0
        self._dense_act_bytes_per_tok = ab * (
            layers * attn_io + dense_layers * mlp_io + moe_layers * shared_io
        )
        # A piecewise graph's pad rows run every projection but kv_b (its W_UK / W_UV and
        # the prefill form's up-projection run in attention, on the step's own rows).
        kvb_params = layers * m.kv_b_params
        self._pad_flops_per_tok = self._dense_flops_per_tok - 2.0 * kvb_params
        self._pad_act_bytes_per_tok = self._dense_act_bytes_per_tok - ab * layers * kvb_io
        # Cached context up-projected by kv_b in the prefill form: per context token.
        self._ctx_upproj_flops = 2.0 * layers * m.kv_b_params
        self._ctx_upproj_bytes = float(layers * (ab * kvb_io + m.kv_dtype_bytes * m.kv_entry_dim))

        # experts (routed): per token FLOPs and activations; weights by distinct experts.
        self._num_experts, self._top_k = m.n_routed_experts, m.num_experts_per_tok
        self._has_moe = moe_layers > 0
        self._expert_flops_per_tok = 2.0 * moe_layers * m.num_experts_per_tok * m.expert_params
        self._expert_bytes_each = float(moe_layers * m.expert_params * m.dtype_bytes)
        # per routed copy: dispatch gather + combine scatter of the hidden state (2h) and the
        # expert's own linears (2h + 6 * moe_intermediate).
        self._expert_act_bytes_per_tok = float(
            ab * moe_layers * m.num_experts_per_tok * (4 * h + 6 * m.moe_intermediate_size)
        )

        # attention, prefill form: per (query, key) pair over all heads and layers.
        self._pre_flops_per_pair = 2.0 * layers * heads * (m.qk_head_dim + m.v_head_dim)
        # Q [heads, 192] and O [heads, 128] per new token; K [heads, 192] and V [heads, 128]
        # per attended token (context + chunk): the same width both times.
        self._pre_row_bytes = float(layers * ab * heads * (m.qk_head_dim + m.v_head_dim))
        self._kv_write_bytes = float(layers * m.kv_entry_dim * m.kv_dtype_bytes)  # per new token

        # attention, absorbed decode form: MQA over [ctx, 576] latents, values are the 512.
        self._dec_flops_per_pair = 2.0 * layers * heads * (m.kv_entry_dim + m.kv_lora_rank)
        self._dec_kv_bytes = float(layers * m.kv_entry_dim * m.kv_dtype_bytes)  # per cached token
        self._dec_q_bytes = float(layers * ab * heads * (m.kv_entry_dim + m.kv_lora_rank))

        # lm head on sampled positions; logits written in fp32.
        self._head_flops_per_tok = 2.0 * m.vocab_size * h
        self._head_weight_bytes = float(m.vocab_size * h * m.embed_dtype_bytes)
        self._head_act_bytes_per_tok = float(m.vocab_size * 4 + h * ab)
        self._embed_bytes_per_tok = float(h * m.embed_dtype_bytes)
        self._layers = layers
        self._layer_overhead = c.layer_overhead_s + c.step_overhead_s  # one drafting pass

    # --- public -------------------------------------------------------------

    def step_time(self, out: SchedulerOutput) -> float:
        """GPU seconds for one step; 0.0 for an empty step."""
        return self._price(out, None)

    def cpu_time(self, out: SchedulerOutput) -> float:
        """Host seconds around the step (schedule, prepare, post-process)."""
        n = len(out.scheduled)
        if n == 0:
            return 0.0
        return self.coeffs.cpu_step_overhead_s + self.coeffs.cpu_per_request_s * n

    def decode_run_costs(self, run: DecodeRun) -> RunCosts | None:
        """A decode run's steps from their sums (exactly `cpu_time` and `step_time` of
        each step's output); None when speculating (drafts are not a run's)."""
        if self.num_speculative_tokens:
            return None
        return self._decode_run(run)

    def _decode_run(self, run: DecodeRun) -> RunCosts:
        for batch in run.batches():
            n, ctx_sum = batch.num_reqs, batch.ctx_sum
            cpu = self.coeffs.cpu_step_overhead_s + self.coeffs.cpu_per_request_s * n
            for s in range(batch.num_steps):
                yield cpu, self._price_sums(decode_sums(n, ctx_sum + n * s), None, None), 0.0, 0.0

    @property
    def grammar_mask_per_token_s(self) -> float:
        """Host seconds to fill one structured request's token mask (sim.cost_model.mask_time)."""
        return self.coeffs.cpu_grammar_mask_per_token_s

    def breakdown(self, out: SchedulerOutput) -> dict[str, GroupCost]:
        """Per op group FLOPs, bytes and seconds, plus "overhead"; sums to step_time."""
        detail: dict[str, GroupCost] = {}
        self._price(out, detail)
        return detail

    def routed_expert_seconds(self, num_pairs: float, num_experts: int) -> float:
        """The routed-expert group of a step (all MoE layers) for `num_pairs` (token, expert)
        pairs over `num_experts` experts held, each pair on one expert chosen uniformly:
        expert parallelism prices a rank's share with it (sim/expert_parallel_cost.py)."""
        if not self._has_moe or num_pairs <= 0:
            return 0.0
        per_pair = 1.0 / self._top_k
        distinct = expected_distinct_experts(round(num_pairs), num_experts, 1)
        f = num_pairs * self._expert_flops_per_tok * per_pair
        b = (
            distinct * self._expert_bytes_each
            + num_pairs * self._expert_act_bytes_per_tok * per_pair
        )
        return max(f / self._moe_rate, b / self._moe_bw)

    # --- pricing ------------------------------------------------------------

    def group_seconds(self, out: SchedulerOutput, graph_tokens: int = 0) -> list[float]:
        """Seconds of dense, experts, attn_pre, attn_dec, lm_head (0.0 where absent): the
        profiled cost model's features, without building the breakdown's records.
        graph_tokens: the rows a piecewise CUDA graph runs the step's projections and
        experts over (its token bucket: the step's tokens padded), 0 for the step's own."""
        return self.group_seconds_of(_sums(out), out.num_proposals, graph_tokens)

    def group_seconds_of(
        self, sums: _StepSums, num_proposals: int | None, graph_tokens: int = 0
    ) -> list[float]:
        """`group_seconds` of a step given by its sums (a uniform step priced without
        building it: `decode_sums`)."""
        sink = [0.0] * 5
        self._price_sums(sums, num_proposals, None, sink, graph_tokens=graph_tokens)
        return sink

    def target_time(self, out: SchedulerOutput) -> float:
        """GPU seconds of `out` without the MTP drafter after it."""
        return self._price(out, None, drafts=0)

    def drafter_parts(self, out: SchedulerOutput, num_drafts: int) -> list[float]:
        """The MTP drafter after `out` proposing `num_drafts` drafts, in parts: [passes,
        seconds of pass 1 (one layer over the step's tokens, the head on its sampling
        rows), seconds of the chained passes, drafts proposed], overheads left out (the
        profiled cost model's drafter features)."""
        parts = [0.0] * 4
        self._price(out, None, drafts=num_drafts, mtp_sink=parts)
        return parts

    def drafter_seconds(self, out: SchedulerOutput, num_drafts: int) -> float:
        """The analytic model's seconds of the drafter after `out` (overheads included)."""
        passes, first, chained, _ = self.drafter_parts(out, num_drafts)
        return passes * self._layer_overhead + first + chained

    def _price(
        self,
        out: SchedulerOutput,
        detail: dict[str, GroupCost] | None,
        sink: list[float] | None = None,
        drafts: int | None = None,
        mtp_sink: list[float] | None = None,
    ) -> float:
        """Seconds of `out` with the drafter proposing `drafts` after it (None: the step's
        num_proposals, or the engine's num_speculative_tokens, or the most drafts a
        request verifies)."""
        return self._price_sums(_sums(out), out.num_proposals, detail, sink, drafts, mtp_sink)

    def _price_sums(
        self,
        sums: _StepSums,
        num_proposals: int | None,
        detail: dict[str, GroupCost] | None,
        sink: list[float] | None = None,
        drafts: int | None = None,
        mtp_sink: list[float] | None = None,
        graph_tokens: int = 0,
    ) -> float:
        """`_price` of a step from its sums (a decode run prices its steps' sums without
        an output each); graph_tokens as in `group_seconds`."""
        (n_tok, n_logits, pre_q, pre_pairs, pre_keys, pre_ctx, dec_q, dec_pairs, dec_keys,
         k, n_sampling) = sums  # fmt: skip
        pad = graph_tokens - n_tok if graph_tokens > n_tok else 0  # a piecewise graph's pad rows
        if n_tok == 0:
            if detail is not None:
                detail["overhead"] = GroupCost(0.0, 0.0, 0.0)
            return 0.0

        bw = self._bw
        total = self._fixed

        f = (
            n_tok * self._dense_flops_per_tok
            + pad * self._pad_flops_per_tok
            + pre_ctx * self._ctx_upproj_flops
        )
        b = (
            self._dense_weight_bytes
            + n_tok * self._dense_act_bytes_per_tok
            + pad * self._pad_act_bytes_per_tok
            + pre_ctx * self._ctx_upproj_bytes
        )
        t = max(f / self._mm_rate, b / bw)
        total += t
        if detail is not None:
            detail["dense"] = GroupCost(f, b, t)
        if sink is not None:
            sink[0] = t

        if self._has_moe:
            distinct = expected_distinct_experts(n_tok, self._num_experts, self._top_k)
            rows = n_tok + pad
            f = rows * self._expert_flops_per_tok
            b = distinct * self._expert_bytes_each + rows * self._expert_act_bytes_per_tok
            t = max(f / self._moe_rate, b / self._moe_bw)
            total += t
            if detail is not None:
                detail["experts"] = GroupCost(f, b, t)
            if sink is not None:
                sink[1] = t

        if pre_q:
            f = pre_pairs * self._pre_flops_per_pair
            b = (pre_q + pre_keys) * self._pre_row_bytes + pre_q * self._kv_write_bytes
            t = max(f / self._attn_rate, b / bw)
            total += t
            if detail is not None:
                detail["attn_pre"] = GroupCost(f, b, t)
            if sink is not None:
                sink[2] = t

        if dec_q:
            f = dec_pairs * self._dec_flops_per_pair
            b = dec_keys * self._dec_kv_bytes + dec_q * (self._dec_q_bytes + self._kv_write_bytes)
            t = max(f / self._attn_rate, b / bw)
            total += t
            if detail is not None:
                detail["attn_dec"] = GroupCost(f, b, t)
            if sink is not None:
                sink[3] = t

        f = n_logits * self._head_flops_per_tok
        b = n_tok * self._embed_bytes_per_tok
        if n_logits:  # no logits at all: the head's weights are not read
            b += self._head_weight_bytes + n_logits * self._head_act_bytes_per_tok
        t = max(f / self._head_rate, b / bw)
        total += t
        if detail is not None:
            detail["lm_head"] = GroupCost(f, b, t)
            detail["overhead"] = GroupCost(0.0, 0.0, self._fixed)
        if sink is not None:
            sink[4] = t
        if drafts is None:  # a varlen step names its drafter's proposals
            drafts = self.num_speculative_tokens or k
            if drafts and num_proposals is not None:
                drafts = num_proposals
        if drafts:
            parts = self._mtp_parts(total - self._fixed - t, n_sampling, drafts, dec_keys)
            t = parts[0] * self._layer_overhead + parts[1] + parts[2]
            total += t
            if detail is not None:
                detail["mtp"] = GroupCost(0.0, 0.0, t)
            if mtp_sink is not None:
                mtp_sink[:] = parts
        return total

    def _mtp_parts(self, body: float, n_rows: int, k: int, dec_keys: int) -> list[float]:
        """The MTP drafter proposing k drafts after a step: [passes, pass 1 seconds,
        chained seconds, drafts] (see drafter_parts). Pass 1 costs one decoder layer of
        the step (`body`: the step's layer groups, all layers) plus the head on the
        n_rows sampling rows; each of the k - 1 chained passes reads one layer's weights
        and KV for the n_rows one-token queries, plus the head. A step where no request
        samples drafts nothing: pass 1 only (the MTP layer's KV of its positions)."""
        layers = self._layers
        if not n_rows:
            return [1.0, body / layers, 0.0, 0.0]
        head_b = self._head_weight_bytes + n_rows * self._head_act_bytes_per_tok
        head = max(n_rows * self._head_flops_per_tok / self._head_rate, head_b / self._bw)
        f = n_rows * (self._dense_flops_per_tok + self._expert_flops_per_tok) / layers
        b = self._dense_weight_bytes / layers + dec_keys * self._dec_kv_bytes / layers
        if self._has_moe:
            distinct = expected_distinct_experts(n_rows, self._num_experts, self._top_k)
            b += distinct * self._expert_bytes_each / layers
        chained = max(f / self._mm_rate, b / self._bw) + head
        return [float(k), body / layers + head, (k - 1) * chained, float(k * n_rows)]


class _StepSums(NamedTuple):
    """The integer sums a step's price reads (`AnalyticCostModel._price_sums`)."""

    n_tok: int  # tokens computed this step
    n_logits: int  # positions whose logits are computed (sampled + drafts to verify)
    pre_q: int  # prefill form: query tokens, (query, key) pairs, keys, cached context
    pre_pairs: int
    pre_keys: int
    pre_ctx: int
    dec_q: int  # absorbed decode form: query tokens, pairs, keys
    dec_pairs: int
    dec_keys: int
    k: int  # drafts verified (max over requests)
    n_sampling: int  # requests that sample


def _sums(out: SchedulerOutput) -> _StepSums:
    n_tok = 0  # tokens computed this step
    n_logits = 0  # positions whose logits are computed (sampled + drafts to verify)
    pre_q = pre_pairs = pre_keys = pre_ctx = 0  # prefill form
    dec_q = dec_pairs = dec_keys = 0  # absorbed decode form
    k = n_sampling = 0  # drafts verified (max over requests), requests that sample
    for r in out.scheduled:
        q = r.num_tokens
        ctx = r.num_computed_tokens
        n_tok += q
        # new token i (0-based) attends ctx + i + 1 keys: q*ctx + q(q+1)/2 pairs
        pairs = q * ctx + (q * (q + 1) >> 1)
        if r.is_prompt and q > 1:
            pre_q += q
            pre_pairs += pairs
            pre_keys += ctx + q
            pre_ctx += ctx
        else:
            dec_q += q
            dec_pairs += pairs
            dec_keys += ctx + q
        d = len(r.draft_token_ids)
        if r.will_sample:
            n_logits += d + 1
            n_sampling += 1
        else:
            n_logits += d
        if d > k:
            k = d
    return _StepSums(
        n_tok, n_logits, pre_q, pre_pairs, pre_keys, pre_ctx, dec_q, dec_pairs, dec_keys,
        k, n_sampling,
    )  # fmt: skip


def decode_sums(num_reqs: int, ctx_sum: int) -> _StepSums:
    """The sums of a step in which num_reqs requests decode one token each, their
    contexts summing to ctx_sum (each attends its context plus the new token)."""
    n = num_reqs
    return _StepSums(n, n, 0, 0, 0, 0, n, ctx_sum + n, ctx_sum + n, 0, n)

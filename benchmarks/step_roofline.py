"""Measured engine steps against their roofline, read from a profile (`deepinfer profile`).

    python -m benchmarks.step_roofline [PROFILE.json] [--copy-tb-s 4.25]
        [--matmul-tflop-s 751] [--kinds prefill,mixed,short_prompts,decode]

Every point of a profile is a whole real-executor step (input preparation, the forward,
the sampler), timed on the device that measured it. A step's roofline is the larger of
- its FLOPs (the matmuls of every token, the attention of its prompt chunks and decodes,
  the LM head on the rows that sample) over the bf16 matmul rate, and
- the bytes it must read (dense weights, the experts its tokens route to under uniform
  routing, the LM head, the latent KV its queries attend to) over the copy bandwidth.
The default ceilings are the H200's as `benchmarks/model_speed.py` measured them
(2026-12-02: copy 4.25 TB/s, bf16 matmul 751 TFLOP/s). Prints one row per point:
measured ms, roofline ms, and their ratio (fraction of the roofline reached).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from deepinfer.model_config import ModelConfig, load_model_config
from sim.analytic_cost_model import expected_distinct_experts

DEFAULT_PROFILE = Path("sim/data/profiles/moonlight-16b-a3b__h200.json")


def step_roofline_s(spec: ModelConfig, groups: list[list[Any]], bw: float, peak: float) -> float:
    """Roofline seconds of a step: groups of [count, query, context, is_prompt, ...]."""
    layers = spec.num_hidden_layers
    heads = spec.num_attention_heads
    head_params = spec.lm_head_params + spec.embed_params
    body = spec.active_params - head_params  # per token, through every layer
    tokens = rows = kv_read = 0
    attn_flops = 0.0
    for count, q, ctx, is_prompt, *_ in groups:
        tokens += count * q
        rows += count  # one sampling row a request
        kv_read += count * (ctx + q)
        if is_prompt:  # per head: QK^T over (qk dims) and PV over (v dims), causal
            pairs = q * ctx + q * (q + 1) / 2
            attn_flops += count * 2 * pairs * heads * (spec.qk_head_dim + spec.v_head_dim)
        else:  # absorbed MLA: latent + rope for QK^T, latent for PV
            dims = 2 * spec.kv_lora_rank + spec.qk_rope_head_dim
            attn_flops += count * q * 2 * (ctx + q) * heads * dims
    flops = 2 * body * tokens + layers * attn_flops + 2 * spec.lm_head_params * rows
    experts = expected_distinct_experts(tokens, spec.n_routed_experts, spec.num_experts_per_tok)
    routed_active = spec.num_moe_layers * spec.num_experts_per_tok * spec.expert_params
    weights = spec.dtype_bytes * (
        body - routed_active + spec.num_moe_layers * experts * spec.expert_params
    )
    weights += spec.embed_dtype_bytes * spec.lm_head_params
    read = weights + kv_read * spec.kv_bytes_per_token
    return max(flops / peak, read / bw)


def describe(point: dict[str, Any]) -> str:
    parts = []
    for count, q, ctx, is_prompt, *_ in point["groups"]:
        what = f"prompt {q:,} after {ctx:,}" if is_prompt else f"decode at {ctx:,}"
        parts.append(f"{count} x {what}")
    return " + ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile", nargs="?", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--copy-tb-s", type=float, default=4.25)
    p.add_argument("--matmul-tflop-s", type=float, default=751.0)
    p.add_argument("--kinds", default="prefill,mixed,short_prompts,decode")
    args = p.parse_args()
    profile = json.loads(args.profile.read_text())
    spec = load_model_config(profile["model"])
    bw, peak = args.copy_tb_s * 1e12, args.matmul_tflop_s * 1e12
    kinds = args.kinds.split(",")
    print(f"{args.profile.name}: {profile['meta'].get('device')}, {profile['meta'].get('date')}")
    print("| kind | step | measured ms | roofline ms | of roofline |")
    print("|---|---|---:|---:|---:|")
    by_kind: dict[str, list[float]] = {}
    for point in profile["points"]:
        if point["kind"] not in kinds or point.get("drafter"):
            continue
        roof = step_roofline_s(spec, point["groups"], bw, peak)
        frac = roof / point["median_s"]
        by_kind.setdefault(point["kind"], []).append(frac)
        print(
            f"| {point['kind']} | {describe(point)} | {point['median_s'] * 1e3:.2f} "
            f"| {roof * 1e3:.2f} | {frac:.2f} |"
        )
    for kind, fracs in by_kind.items():
        print(
            f"{kind}: {len(fracs)} steps at {min(fracs):.2f}-{max(fracs):.2f} of their "
            f"roofline (median {statistics.median(fracs):.2f})"
        )


if __name__ == "__main__":
    main()

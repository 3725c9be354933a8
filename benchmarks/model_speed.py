"""Real-executor throughput on a dummy model in published shapes, beside HF transformers.

    deepinfer bench model-speed [--model moonlight-16b-a3b] [--no-hf] [--eager]
        [--async-scheduling] [--json OUT.json]      # then: python -m benchmarks.plot_model_speed OUT.json

Builds transformers' DeepseekV3ForCausalLM from the preset config directly on
the GPU (random weights), copies the same weights into deepinfer's model, and
measures in one process (each figure a whole engine step: scheduler, model, sampler):
- prefill tokens/s with N tokens in one step (1k-token prompts), 1k to 32k;
- decode tokens/s at batch B and context C (median step time), batch 1 to 256 at
  context 1k and 4k; with --eager also without CUDA graphs;
- each beside its roofline: bytes of weights actually read (dense + distinct
  experts touched, expected under uniform routing) plus KV read, over the
  measured copy bandwidth; prefill FLOPs over the measured bf16 matmul rate;
- HF transformers on the same weights: a forward over the same prompts, and
  `generate` with greedy decoding;
- mixed steps (D decodes beside a P-token prompt), steps of many short prompts, and with
  --served-rate the bundled Azure code trace served at that rate, each against its
  roofline (benchmarks/model_speed_steps.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_speed_steps import print_step_table, served_row, step_rows
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import PRESETS_DIR, load_model_config
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.loader import load_state_dict_into
from executors.torch_executor import TorchExecutor
from sim.analytic_cost_model import expected_distinct_experts

PRESETS = PRESETS_DIR


def ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s) measured on random data."""
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return statistics.median(times)

    bw = 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), 10)
    flops = 2 * 8192**3 / timed(lambda: a @ b, 10)
    return bw, flops


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def ours(
    ex: TorchExecutor, cfg: EngineConfig, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[float, float]:
    """(prefill seconds of the first step, median seconds of the decode steps that ran
    every request). The prompts take ceil(tokens / budget) steps to prefill, during which
    the first ones already decode, so each request generates that many tokens more than
    `new_tokens`: the last `new_tokens` steps then decode the whole batch."""
    core = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
    prefill_steps = -(-sum(map(len, prompts)) // cfg.max_num_batched_tokens)
    extra = prefill_steps if new_tokens > 1 else 0
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens + extra, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"{tag}-{i}", p, sp))
    while core.has_unfinished():
        core.step()
    prefill = [s.duration for s in core.steps if s.num_prompt_tokens]
    full = len(prompts)
    decode = [
        s.duration for s in core.steps if not s.num_prompt_tokens and s.num_scheduled_reqs == full
    ]
    return sum(prefill), statistics.median(decode) if decode else float("nan")


@torch.no_grad()
def hf_times(hf, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per step): generate(1) is the prefill, and the
    difference to generate(new_tokens) spread over the extra steps is the decode."""
    ids = torch.tensor(prompts, device=hf.device)

    def gen(n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t0

    gen(2)  # warm-up at this shape
    prefill = gen(1)
    return prefill, max(gen(new_tokens) - prefill, 1e-9) / (new_tokens - 1)


def hf_tok_s(hf, prompts: list[list[int]], new_tokens: int, prefill: bool) -> float | None:
    """HF's prefill (all prompt tokens) or decode (one per prompt) tokens/s; None on OOM."""
    try:
        t_prefill, t_step = hf_times(hf, prompts, new_tokens)
    except torch.OutOfMemoryError:
        return None
    finally:
        _empty_cache()
    return sum(map(len, prompts)) / t_prefill if prefill else len(prompts) / t_step


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(
    model: str, dev: torch.device, cfg: EngineConfig, with_hf: bool
) -> tuple[TorchExecutor, object, object]:
    """(deepinfer executor, HF model with the same weights or None, model spec) for a preset
    name or a config.json path; dummy weights, MTP layers left out."""
    path = Path(model) if model.endswith(".json") else PRESETS / f"{model}.json"
    raw = json.loads(path.read_text())
    raw["num_nextn_predict_layers"] = 0
    spec = load_model_config(path).with_quantization(cfg.quantization)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(raw))
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    ex = TorchExecutor(cfg, str(tmp), load_format="dummy", dtype=dtype, device=str(dev))
    hf = None
    if with_hf:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.set_default_dtype(getattr(torch, dtype))
        with torch.device(dev):
            hf = DeepseekV3ForCausalLM(DeepseekV3Config(**raw)).eval()
        torch.set_default_dtype(torch.float32)
        load_state_dict_into(ex.model, ex.config, hf.state_dict())
    return ex, hf, spec


def decode_roofline_s(spec, batch: int, context: int, bw: float) -> float:
    """Bytes a decode step must read (dense weights, the distinct experts that `batch`
    tokens route to under uniform routing, every request's latent KV) over `bw`."""
    experts = expected_distinct_experts(batch, spec.n_routed_experts, spec.num_experts_per_tok)
    weight_bytes = spec.dtype_bytes * (
        spec.active_params
        - spec.num_moe_layers * spec.num_experts_per_tok * spec.expert_params
        + spec.num_moe_layers * experts * spec.expert_params
    )
    return (weight_bytes + batch * context * spec.kv_bytes_per_token) / bw


def sweep_config(
    batch: int,
    context: int,
    new_tokens: int,
    max_prefill: int,
    block: int = 64,
    budget: int = 16384,
) -> EngineConfig:
    """An engine config whose KV cache holds the largest decode batch with room above the
    prefill watermark. No prompt starts above the watermark: in a cache the batch just
    fills, the last prompts would wait for the first requests to finish and no step would
    decode the whole batch (batch 256 at 4k did that)."""
    cfg = EngineConfig(
        block_size=block,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        async_scheduling=False,  # the baseline; --async-scheduling times the overlap beside
    )
    # every request's tokens, with the extra ones it decodes while the batch prefills
    extra = -(-batch * context // budget)
    need = max(batch * (context + new_tokens + extra + block), max_prefill + block)
    return cfg.replace(num_gpu_blocks=int(need / block / cfg.prefill_watermark * 1.05) + 64)


def hf_kv_bytes(ex: TorchExecutor, tokens: int) -> int:
    """transformers caches full per-head K and V for MLA (not the latent)."""
    c = ex.config
    per_token = c.num_hidden_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return 2 * per_token * tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--prefill",
        default="1024,2048,4096,8192,16384,32768",
        help="tokens per prefill step (prompts of 1,024 tokens)",
    )
    p.add_argument("--no-hf", action="store_true")
    p.add_argument(
        "--hf-max-kv-gib",
        type=float,
        default=24.0,
        help="skip HF where its KV cache would exceed this",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="also time decode without CUDA graphs (first context only)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="also time decode with async scheduling (step N+1 launched while N runs)",
    )
    p.add_argument(
        "--mixed",
        default="16,64,240x512,2048,7680",
        help="mixed steps DxP: D decodes (at the first context) beside a P-token prompt",
    )
    p.add_argument(
        "--short-prompts", default="32x64,128x64", help="NxL: N prompts of L tokens in one step"
    )
    p.add_argument(
        "--served-rate",
        type=float,
        default=None,
        help="also serve the bundled Azure code trace at this many requests/s",
    )
    p.add_argument("--served-requests", type=int, default=200)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument(
        "--quantization",
        default=None,
        help="fp8: the dummy weights in e4m3 with 128x128 block scales (the decode roofline "
        "then reads 1-byte weights; prefill's stays the measured bf16 matmul ceiling)",
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    bw, peak = float("nan"), float("nan")
    if dev.type == "cuda":
        bw, peak = ceilings(dev)
        torch.cuda.empty_cache()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    batches = [int(x) for x in args.batches.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    mixed = _pairs(args.mixed)
    short = [
        (int(n), int(length)) for n, length in (x.split("x") for x in _items(args.short_prompts))
    ]
    # The cache holds every step timed: the largest prefill, mixed step (its decodes'
    # contexts, with room to run on) and batch of short prompts.
    steps_tokens = [d * (contexts[0] + 64) + p for d, p in mixed] + [n * ln for n, ln in short]
    cfg = sweep_config(
        max(batches), max(contexts), args.new_tokens, max([*prefills, *steps_tokens], default=0)
    ).replace(quantization=args.quantization)
    ex, hf, spec = build(args.model, dev, cfg, with_hf=not args.no_hf)
    hf_limit = args.hf_max_kv_gib * 2**30
    rows = []
    ours(ex, cfg, random_prompts(2, 64, spec.vocab_size, 0), 4, "warm")  # warm-up
    for n in prefills:
        prompts = random_prompts(max(n // 1024, 1), min(n, 1024), spec.vocab_size, n)
        run_cfg = cfg.replace(max_num_batched_tokens=max(n, 1024))
        # The first step at a new shape pays allocator growth and kernel selection.
        t = min(ours(ex, run_cfg, prompts, 1, f"p{n}.{i}")[0] for i in range(2))
        flops = 2 * spec.active_params * n  # matmul FLOPs; attention is small at 1k context
        row = dict(kind="prefill", tokens=n, ours_tok_s=n / t, roofline_tok_s=n / (flops / peak))
        if hf is not None and hf_kv_bytes(ex, n) <= hf_limit:
            row["hf_tok_s"] = hf_tok_s(hf, prompts, 2, prefill=True)
        rows.append(row)
        print(row, flush=True)
    for ctx in contexts:
        for b in batches:
            prompts = random_prompts(b, ctx, spec.vocab_size, b + ctx)
            _, step = ours(ex, cfg, prompts, args.new_tokens, f"d{b}.{ctx}")
            roof = decode_roofline_s(spec, b, ctx, bw)
            row = dict(
                kind="decode",
                batch=b,
                context=ctx,
                ours_step_ms=1e3 * step,
                ours_tok_s=b / step,
                roofline_step_ms=1e3 * roof,
                roofline_tok_s=b / roof,
            )
            if args.eager and ctx == contexts[0] and ex.runner.graphs is not None:
                graphs, ex.runner.graphs = ex.runner.graphs, None
                _, eager = ours(ex, cfg, prompts, args.new_tokens, f"e{b}.{ctx}")
                ex.runner.graphs = graphs
                row["eager_tok_s"] = b / eager
            if args.async_scheduling:
                run_cfg = cfg.replace(async_scheduling=True)
                _, overlapped = ours(ex, run_cfg, prompts, args.new_tokens, f"a{b}.{ctx}")
                row["async_tok_s"] = b / overlapped
            if hf is not None and hf_kv_bytes(ex, b * (ctx + args.new_tokens)) <= hf_limit:
                row["hf_tok_s"] = hf_tok_s(hf, prompts, args.new_tokens, prefill=False)
            rows.append(row)
            print(row, flush=True)
    rows += step_rows(ex, spec, mixed, short, contexts[0], bw, peak)
    if args.served_rate is not None:
        served_cfg = cfg.replace(async_scheduling=None)  # the default, as users serve
        rows.append(
            served_row(ex, served_cfg, spec, args.served_rate, args.served_requests, bw, peak)
        )
    print_table([r for r in rows if r["kind"] in ("prefill", "decode")])
    print_step_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    copy_bw=bw,
                    matmul_flops=peak,
                    model=args.model,
                    quantization=args.quantization,
                    rows=rows,
                ),
                indent=1,
            )
        )


def _items(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _pairs(text: str) -> list[tuple[int, int]]:
    """ "16,64x512,2048" -> every (D, P): D in 16, 64 and P in 512, 2048."""
    if not text:
        return []
    left, right = text.split("x")
    return [(int(d), int(p)) for d in _items(left) for p in _items(right)]


def print_table(rows: list[dict]) -> None:
    print(
        "| kind | size | deepinfer tok/s | roofline tok/s | deepinfer / roofline "
        "| async tok/s (/ roofline) | eager tok/s | HF tok/s | deepinfer / HF |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["kind"] == "prefill":
            size = f"{r['tokens']:,} tokens"
        else:
            size = f"batch {r['batch']}, ctx {r['context']:,}"
        ours_s, roof, hf_s = r["ours_tok_s"], r["roofline_tok_s"], r.get("hf_tok_s")
        eager = f"{r['eager_tok_s']:,.0f}" if r.get("eager_tok_s") else "-"
        a = r.get("async_tok_s")
        overlapped = f"{a:,.0f} ({a / roof:.2f})" if a else "-"
        hf_txt = f"{hf_s:,.0f} | {ours_s / hf_s:.1f}x" if hf_s else "- | -"
        print(
            f"| {r['kind']} | {size} | {ours_s:,.0f} | {roof:,.0f} | {ours_s / roof:.2f} "
            f"| {overlapped} | {eager} | {hf_txt} |"
        )


if __name__ == "__main__":
    main()

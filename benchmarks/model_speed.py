"""Real-executor throughput on a dummy model in published shapes, beside HF transformers.

    python benchmarks/model_speed.py [--model moonlight-16b-a3b] [--no-hf] [--json OUT.json]

Builds transformers' DeepseekV3ForCausalLM from the preset config directly on
the GPU (random weights), copies the same weights into deepinfer's model, and
measures in one process:
- prefill tokens/s with N tokens in one step (1k-token prompts);
- decode tokens/s at batch B and context C (median step time);
- each beside its roofline: bytes of weights actually read (dense + distinct
  experts touched, expected under uniform routing) plus KV read, over the
  measured copy bandwidth; prefill FLOPs over the measured bf16 matmul rate;
- HF transformers on the same weights: a forward over the same prompts, and
  `generate` with greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.loader import load_state_dict_into
from executors.torch_executor import TorchExecutor
from sim.analytic_cost_model import expected_distinct_experts
from sim.model_spec import load_model_spec

PRESETS = Path(__file__).resolve().parents[1] / "sim" / "data" / "models"


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


def ours(ex: TorchExecutor, cfg: EngineConfig, prompts: list[list[int]], new_tokens: int,
         tag: str) -> tuple[float, float]:
    """(prefill seconds of the first step, median decode step seconds)."""
    core = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"{tag}-{i}", p, sp))
    while core.has_unfinished():
        core.step()
    prefill = [s.duration for s in core.steps if s.num_prompt_tokens]
    decode = [s.duration for s in core.steps if not s.num_prompt_tokens]
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


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prefill", default="1024,4096,16384")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = p.parse_args()
    dev = torch.device(args.device)
    bw, peak = float("nan"), float("nan")
    if dev.type == "cuda":
        bw, peak = ceilings(dev)
        torch.cuda.empty_cache()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    path = Path(args.model) if args.model.endswith(".json") else PRESETS / f"{args.model}.json"
    raw = json.loads(path.read_text())
    raw["num_nextn_predict_layers"] = 0
    spec = load_model_spec(path)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(raw))
    cfg = EngineConfig(block_size=64, num_gpu_blocks=6144, max_num_seqs=256,
                       max_num_batched_tokens=16384, enable_prefix_caching=False)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    ex = TorchExecutor(cfg, str(tmp), load_format="dummy", dtype=dtype, device=args.device)
    hf = None
    if not args.no_hf:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.set_default_dtype(getattr(torch, dtype))
        with torch.device(dev):
            hf = DeepseekV3ForCausalLM(DeepseekV3Config(**raw)).eval()
        torch.set_default_dtype(torch.float32)
        load_state_dict_into(ex.model, ex.config, hf.state_dict())
    rows = []
    ours(ex, cfg, random_prompts(2, 64, spec.vocab_size, 0), 4, "warm")  # warm-up
    for n in [int(x) for x in args.prefill.split(",")]:
        prompts = random_prompts(max(n // 1024, 1), min(n, 1024), spec.vocab_size, n)
        run_cfg = cfg.replace(max_num_batched_tokens=max(n, 1024))
        # The first step at a new shape pays allocator growth and kernel selection.
        t = min(ours(ex, run_cfg, prompts, 1, f"p{n}.{i}")[0] for i in range(2))
        flops = 2 * spec.active_params * n  # matmul FLOPs; attention is small at 1k context
        row = dict(kind="prefill", tokens=n, ours_tok_s=n / t, roofline_tok_s=n / (flops / peak))
        if hf is not None:
            try:
                th, _ = hf_times(hf, prompts, 2)
                row["hf_tok_s"] = n / th
            except torch.OutOfMemoryError:
                row["hf_tok_s"] = None
            _empty_cache()
        rows.append(row)
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = random_prompts(b, args.context, spec.vocab_size, b)
        _, step = ours(ex, cfg, prompts, args.new_tokens, f"d{b}")
        experts = expected_distinct_experts(b, spec.n_routed_experts, spec.num_experts_per_tok)
        weight_bytes = spec.dtype_bytes * (
            spec.active_params - spec.num_moe_layers * spec.num_experts_per_tok
            * spec.expert_params + spec.num_moe_layers * experts * spec.expert_params)
        kv_bytes = b * args.context * spec.kv_bytes_per_token
        row = dict(kind="decode", batch=b, context=args.context, ours_step_ms=1e3 * step,
                   ours_tok_s=b / step, roofline_step_ms=1e3 * (weight_bytes + kv_bytes) / bw)
        if hf is not None:
            try:
                _, th = hf_times(hf, prompts, args.new_tokens)
                row["hf_tok_s"] = b / th
            except torch.OutOfMemoryError:
                row["hf_tok_s"] = None
            _empty_cache()
        rows.append(row)
    print("| kind | size | ours tok/s | roofline | ours/roofline | HF tok/s | ours/HF |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        hf_s = r.get("hf_tok_s")
        if r["kind"] == "prefill":
            size, roof = f"{r['tokens']} tokens", r["roofline_tok_s"]
        else:
            size = f"batch {r['batch']}, ctx {r['context']}"
            roof = r["batch"] / (r["roofline_step_ms"] / 1e3)
        ours_s = r["ours_tok_s"]
        hf_txt = f"{hf_s:.0f} | {ours_s / hf_s:.1f}x" if hf_s else "n/a | n/a"
        print(f"| {r['kind']} | {size} | {ours_s:.0f} | {roof:.0f} | {ours_s / roof:.2f} | "
              f"{hf_txt} |")
    if args.json:
        args.json.write_text(json.dumps(dict(copy_bw=bw, matmul_flops=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""What structured outputs cost: the grammar token mask, per token and per decode step.

    # on the GPU (the issue's target: <= 5% at batch 64 with a JSON Schema on every request)
    deepinfer bench structured-outputs [--model moonlight-16b-a3b] [--batches 1,64]
        [--context 1024] [--steps 32] [--json OUT.json]
    # anywhere (CPU): only the mask fill, microseconds per token, for the simulator's
    # cpu_grammar_mask_per_token_s
    deepinfer bench structured-outputs --mask-only [--vocab 163840] [--batches 1,64]

The GPU mode builds the real executor on random weights in the model's shapes
(`load_format="dummy"`, as benchmarks/model_speed.py does), then at each batch size
decodes the same prompts twice through the engine: unconstrained, and with the JSON
Schema below on every request (`so_args`), at temperature 1.0. It reports the median
wall time of the decode steps that ran the whole batch (scheduler, model, mask, sampler)
and the host time spent filling and applying masks (`TokenMasks.apply`).

A dummy checkpoint has no tokenizer, so one of the model's vocabulary size is made:
the demo model's byte-level BPE vocabulary (8,192 tokens) extended with distinct
concatenations of its tokens up to `vocab_size` (163,840 for Moonlight). xgrammar's
mask cost grows with the vocabulary and with how many tokens share prefixes, so this
stands in for a real ~160k tokenizer; `--tokenizer DIR` uses a real one instead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.demo import DEMO_MODEL_DIR
from executors.structured_outputs import GrammarCompiler, GrammarState

# Never complete within a benchmark's steps (minItems), and mixes what costs most to
# mask: numbers, enums, bounded strings, nested objects and arrays.
SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 10000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 12},
                    "score": {"type": "number", "minimum": -100, "maximum": 100},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "score", "tags", "ok"],
            },
        }
    },
    "required": ["records"],
}
SO_ARGS = {"schema_type": "json", "schema": SCHEMA}


def synthetic_tokenizer(vocab_size: int, out_dir: Path, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens in `out_dir`: the demo
    vocabulary plus distinct concatenations of two of its tokens (never produced by
    encoding, but every one is a token the grammar engine must classify)."""
    raw = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text())
    vocab: dict[str, int] = raw["model"]["vocab"]
    special = {t["content"] for t in raw["added_tokens"]}
    base = [t for t in vocab if t not in special]
    rng = random.Random(seed)
    next_id = max(vocab.values()) + 1
    while next_id < vocab_size:
        token = rng.choice(base) + rng.choice(base)
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(raw))
    config = (DEMO_MODEL_DIR / "tokenizer_config.json").read_text()
    (out_dir / "tokenizer_config.json").write_text(config)
    return out_dir


def tokenizer_dir(args: argparse.Namespace, vocab_size: int) -> Path:
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    return synthetic_tokenizer(vocab_size, Path(tempfile.mkdtemp()) / "tokenizer")


def mask_only(args: argparse.Namespace) -> list[dict]:
    """Host microseconds per token mask at batch b: b matchers walk the grammar with
    random allowed tokens; each step times the batched fill of their bitmask rows (the
    host work a GPU step overlaps) and, apart, applying it to CPU float32 logits."""
    import numpy as np
    import xgrammar as xgr

    vocab = args.vocab
    compiler = GrammarCompiler(tokenizer_dir(args, vocab), vocab, [1])
    t0 = time.perf_counter()
    compiled = compiler.compiled(SO_ARGS)
    print(f"vocabulary {vocab}: tokenizer info + compile {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch_sizes:
        states = [GrammarState(compiled) for _ in range(b)]
        batch = xgr.BatchGrammarMatcher()
        bitmask = xgr.allocate_token_bitmask(b, vocab)
        logits = torch.zeros(b, vocab)
        fills, applies = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
            fills.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
            applies.append(time.perf_counter() - t0)
            for i, s in enumerate(states):  # a random allowed token: stays in the grammar
                bits = np.unpackbits(bitmask[i].numpy().view(np.uint8), bitorder="little")
                allowed = bits[:vocab].nonzero()[0]
                s.accept([int(allowed[rng.integers(len(allowed))])])
        fill, apply = statistics.median(fills) / b, statistics.median(applies) / b
        rows.append(
            {"batch": b, "vocab": vocab, "fill_us_per_token": fill * 1e6,
             "cpu_apply_us_per_token": apply * 1e6}
        )  # fmt: skip
        print(
            f"batch {b:4d}: fill {fill * 1e6:7.1f} us per token mask, applying it to CPU "
            f"logits {apply * 1e6:7.1f} us (medians of {args.steps} steps)"
        )
    return rows


def gpu(args: argparse.Namespace) -> list[dict]:
    from benchmarks.model_speed import build, random_prompts

    dev = torch.device(args.device)
    cfg = EngineConfig(
        block_size=64,
        num_gpu_blocks=4096,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=16384,
        enable_prefix_caching=False,
    )
    ex, _, spec = build(args.model, dev, cfg, with_hf=False)
    vocab = spec.vocab_size
    eos = ex.eos_token_id if isinstance(ex.eos_token_id, list) else [ex.eos_token_id or 1]
    ex.runner.requests.grammars = GrammarCompiler(tokenizer_dir(args, vocab), vocab, eos)
    # Host seconds per phase: the whole mask (fill + launching its kernel) and, apart,
    # advancing the matchers over the sampled tokens (after the step's sync: not overlapped).
    seconds = {"mask": 0.0, "accept": 0.0}
    apply, accept = ex.runner.masks.apply, GrammarState.accept

    def timed_apply(logits, rows) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        apply(logits, rows)
        seconds["mask"] += time.perf_counter() - t0

    def timed_accept(state, tokens):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        n = accept(state, tokens)
        seconds["accept"] += time.perf_counter() - t0
        return n

    ex.runner.masks.apply = timed_apply  # type: ignore[method-assign]
    GrammarState.accept = timed_accept  # type: ignore[method-assign]
    results = []
    for b in args.batch_sizes:
        prompts = random_prompts(b, args.context, vocab, b)
        row: dict = {"batch": b, "context": args.context, "vocab": vocab}
        for tag, so_args in (("none", None), ("json", SO_ARGS)):
            for attempt in ("warm", "timed"):
                core = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
                sp = SamplingParams(
                    temperature=1.0, max_tokens=args.steps + 2, ignore_eos=True, so_args=so_args
                )
                for i, p in enumerate(prompts):
                    core.add_request(Request(f"{tag}-{attempt}-{b}-{i}", p, sp))
                seconds.update(mask=0.0, accept=0.0)
                while core.has_unfinished():
                    core.step()
                decode = [
                    s for s in core.steps if not s.num_prompt_tokens and s.num_scheduled_reqs == b
                ]
            assert decode, f"no decode step ran all {b} requests"
            row[f"step_ms_{tag}"] = statistics.median(s.duration for s in decode) * 1e3
            if so_args is not None:
                tokens = b * (args.steps + 2)  # every request sampled that many, masked
                row["mask_us_per_token"] = seconds["mask"] / tokens * 1e6
                row["accept_us_per_token"] = seconds["accept"] / tokens * 1e6
        row["overhead"] = row["step_ms_json"] / row["step_ms_none"] - 1
        results.append(row)
        print(
            f"batch {b:4d}: decode step {row['step_ms_none']:.2f} ms unconstrained, "
            f"{row['step_ms_json']:.2f} ms with a JSON Schema ({row['overhead']:+.1%}); "
            f"host per token: mask {row['mask_us_per_token']:.1f} us, "
            f"matcher advance {row['accept_us_per_token']:.1f} us"
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="preset or config.json path")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per case")
    p.add_argument("--mask-only", action="store_true", help="CPU: time the mask fill alone")
    p.add_argument("--vocab", type=int, default=163840, help="vocabulary of --mask-only")
    p.add_argument("--tokenizer", default=None, help="a directory with a real tokenizer.json")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke test of the step benchmark (with a small --model config.json)",
    )
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batches.split(",") if x]
    if not args.mask_only and args.device == "cuda" and not torch.cuda.is_available():
        p.error("the step benchmark needs CUDA; --mask-only times the mask fill on the CPU")
    rows = mask_only(args) if args.mask_only else gpu(args)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

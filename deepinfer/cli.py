"""`deepinfer simulate | generate | bench`.

Exit codes: 0 success, 2 bad input (trace, option, model config), 3 the
engine stalled (the message is the diagnosis).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.errors import SchedulerStalled

EXIT_BAD_INPUT = 2
EXIT_STALLED = 3

_ENGINE_HELP = {
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "KV blocks in the cache (default: derived from GPU memory minus weights)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "longest request (prompt + output); capped by the cache",
    "enable_chunked_prefill": "split long prompts across steps",
    "prefill_watermark": "KV usage above which no new prompt starts (GPU_CACHE_PREFILL_WATERMARK)",
    "enable_prefix_caching": "reuse cached KV blocks of equal prefixes",
    "role": "normal, prefill (finish after the first token) or decode (prompt arrives cached)",
    "num_speculative_tokens": "draft tokens verified per step (0: no speculation)",
    "enable_mtp_varlen": "confidence-scheduled variable-length drafts",
    "async_scheduling": "schedule step N+1 while step N runs",
    "policy": "fcfs or priority",
    "seed": "seed for everything random",
}


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One --kebab-case option per EngineConfig field, defaulting to the config's default."""
    group = parser.add_argument_group("engine options (EngineConfig)")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        kind: Any = {bool: _bool, int: int, float: float}.get(type(default), str)
        if f.name in ("num_gpu_blocks", "max_model_len"):
            kind = int
        shown = default.value if hasattr(default, "value") else default
        group.add_argument(flag, dest=f"engine_{f.name}", type=kind, default=None,
                           metavar=f.name.split("_")[-1].upper(),
                           help=f"{_ENGINE_HELP.get(f.name, '')} (default: {shown})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {k[len("engine_"):]: v for k, v in vars(args).items()
              if k.startswith("engine_") and v is not None}
    return EngineConfig.from_dict(values, source="command line")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deepinfer",
        description="Inference engine and scheduler simulator for DeepSeek-architecture models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from deepinfer.cli_simulate import add_simulate_parser

    add_simulate_parser(sub)
    _add_generate_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SchedulerStalled as e:
        print(f"deepinfer: the engine stalled:\n{e}", file=sys.stderr)
        return EXIT_STALLED
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with a real model (needs the torch extra)")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument("--model", default="deepinfer-demo",
                   help="checkpoint directory or hub id (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seq-seed", dest="seq_seed", type=int, default=None,
                   help="per-request sampling seed (deterministic sampling)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (they are on by default on CUDA)")
    add_engine_options(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    engine = engine_config_from_args(args)
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
                  enforce_eager=args.enforce_eager,
                  **{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)})
    except (RuntimeError, OSError) as e:  # unreachable hub, unreadable checkpoint
        raise ValueError(f"cannot load model {args.model!r}: {e}") from e
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seq_seed=args.seq_seed)
    for out in llm.generate(list(args.prompt), params):
        print(f"--- {out.request_id} ({out.outputs[0].finish_reason})")
        print((out.prompt or "") + out.outputs[0].text)
    return 0


def default_trace() -> Path:
    """The bundled trace `deepinfer simulate` runs when given none."""
    return Path(__file__).resolve().parents[1] / "traces" / "azure_code_small.json"


if __name__ == "__main__":
    sys.exit(main())

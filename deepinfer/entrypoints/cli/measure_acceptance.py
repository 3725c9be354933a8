"""`deepinfer measure-acceptance`: how often a model's MTP drafts are accepted.

Runs the real executor with speculation over held-out text (by default the demo
model's `heldout_sample.json`: source files it was not trained on), counts per draft
position how often a draft is verified with all drafts before it accepted and how
often it is accepted (Scheduler.draft_position_stats), and writes the acceptance file
the simulator reads (sim/acceptance.py; `deepinfer simulate --acceptance-rate FILE`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args


def add_measure_acceptance_parser(sub: Any) -> None:
    p = sub.add_parser(
        "measure-acceptance",
        help="measure MTP draft acceptance per position for the simulator (needs torch)",
        description="Generate from held-out text with speculation on the real executor and "
        "write the per-position draft acceptance that `deepinfer simulate` replays.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help="held-out text: JSON {'files': [{'text': ...}]} or a plain text file "
        "(default: the demo model's heldout_sample.json)",
    )
    p.add_argument("--num-prompts", type=int, default=16, help="prompts cut from the text")
    p.add_argument("--prompt-chars", type=int, default=400, help="characters of each prompt")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--out", type=Path, required=True, help="acceptance JSON to write")
    p.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    add_engine_options(p)
    p.set_defaults(func=run_measure_acceptance)


def held_out_prompts(path: Path, num: int, chars: int) -> list[str]:
    """`num` prompts of `chars` characters, taken in turn from the text's files (or, for a
    plain text file, from consecutive pieces of it)."""
    raw = path.read_text()
    try:
        texts = [f["text"] for f in json.loads(raw)["files"]]
    except (ValueError, KeyError, TypeError):
        texts = [raw[i : i + 4 * chars] for i in range(0, len(raw), 4 * chars)]
    pieces = [t[o : o + chars] for t in texts for o in range(0, max(len(t) - chars, 1), 2 * chars)]
    pieces = [p for p in pieces if p.strip()]
    if not pieces:
        raise ValueError(f"{path}: no text to make prompts from")
    return [pieces[i * len(pieces) // num] for i in range(num)] if len(pieces) > num else pieces


def run_measure_acceptance(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine import EngineCore
    from executors.demo import demo_model_path
    from sim.acceptance import AcceptanceModel, acceptance_file

    cfg = engine_config_from_args(args)
    if not cfg.num_speculative_tokens:
        cfg = cfg.replace(num_speculative_tokens=3)
    model = args.model or str(demo_model_path())
    text = args.text or Path(demo_model_path()) / "heldout_sample.json"
    prompts = held_out_prompts(text, args.num_prompts, args.prompt_chars)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True
    )
    if cfg.data_parallel_size > 1:
        raise ValueError(
            f"--data-parallel-size {cfg.data_parallel_size}: measure-acceptance counts the "
            "drafts of one engine; run it with one rank"
        )
    engine_args = {name: getattr(cfg, name) for name in cfg.field_names()}
    llm = LLM(model, device=args.device, dtype=args.dtype, **engine_args)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert isinstance(llm.engine, EngineCore)  # (one rank: refused above otherwise)
    sched = llm.engine.scheduler
    reached = [n for n, _ in sched.draft_position_stats]
    accepted = [a for _, a in sched.draft_position_stats]
    shown = text.resolve()
    if shown.is_relative_to(Path.cwd()):
        shown = shown.relative_to(Path.cwd())
    data = acceptance_file(
        Path(model).name, f"{shown} ({len(prompts)} prompts)", cfg.num_speculative_tokens,
        reached, accepted,
    )  # fmt: skip
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    verify_steps = reached[0] if reached else 0
    data["mean_tokens_per_verify"] = (
        (verify_steps + sum(accepted)) / verify_steps if verify_steps else None
    )
    data["temperature"] = args.temperature
    data["output_tokens_per_second"] = tokens / seconds
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    model_ = AcceptanceModel.from_counts(reached, accepted)
    probs = ", ".join(f"{p:.3f}" for p in model_.per_position)
    print(
        f"acceptance per position [{probs}]; mean tokens per verify step "
        f"{data['mean_tokens_per_verify'] or 0:.2f}; {tokens} tokens in {seconds:.1f} s "
        f"-> {args.out}"
    )
    return 0

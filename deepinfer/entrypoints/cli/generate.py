"""`deepinfer generate PROMPT...`: text from a real model (needs the torch extra)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.entrypoints.cli.sampling_options import (
    add_sampling_options,
    sampling_params_from_args,
)


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with a real model (needs the torch extra)")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.add_argument(
        "--model",
        default="deepinfer-demo",
        help="checkpoint directory or hub id (default: %(default)s)",
    )
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (they are on by default on CUDA)",
    )
    p.add_argument(
        "--disaggregate",
        default=None,
        metavar="xPyD",
        help="serve from x prefill and y decode engines in this process, each request's "
        "prompt KV handed from one to the other (e.g. 1P1D)",
    )
    p.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="write every step (its shape, host and device seconds) to this step log, "
        "which `deepinfer profile --from-log` fits a profile from",
    )
    add_sampling_options(p)
    add_engine_options(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from deepinfer.data_parallel.front_end import DataParallelEngine
    from deepinfer.disaggregated_engine import DisaggregatedEngine
    from deepinfer.entrypoints.llm import LLM

    engine = engine_config_from_args(args)
    try:
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            enforce_eager=args.enforce_eager,
            disaggregate=args.disaggregate,
            step_log=args.step_log,
            **{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)},
        )
    except (RuntimeError, OSError) as e:  # unreachable hub, unreadable checkpoint
        raise ValueError(f"cannot load model {args.model!r}: {e}") from e
    params = sampling_params_from_args(args)
    for out in llm.generate(list(args.prompt), params):
        print(f"--- {out.request_id} ({out.outputs[0].finish_reason})")
        for c in out.outputs:
            print((out.prompt or "") + c.text)
            if c.logprobs is not None:  # --logprobs N: each sampled token, then the top N
                _print_logprobs(c.token_ids, c.logprobs, c.cumulative_logprob, params.logprobs)
    # Several engines, each counting its own drafts: no one line of acceptance.
    if isinstance(llm.engine, (DataParallelEngine, DisaggregatedEngine)):
        llm.shutdown()
        return 0
    sched = llm.engine.scheduler
    if sched.num_draft_tokens:
        by_position = ", ".join(f"{a / n:.2f}" for n, a in sched.draft_position_stats if n)
        print(
            f"speculation: {sched.num_accepted_drafts} of {sched.num_draft_tokens} drafts "
            f"accepted; by position (given the earlier passed): {by_position}",
            file=sys.stderr,
        )
    return 0


def _print_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Any]],
    cumulative: float | None,
    top_n: int | None,
) -> None:
    """One line a generated token: its id, text, logprob and rank, then the top N (the
    sampled token comes with them even when it ranks lower, as in vLLM)."""
    for j, (tok, entries) in enumerate(zip(token_ids, logprobs)):
        top = sorted(
            ((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= (top_n or 0)),
            key=lambda kv: kv[1].rank,
        )
        alts = ", ".join(f"{t} {e.logprob:.3f}" for t, e in top)
        mine = entries.get(tok)
        text = mine.decoded_token if mine is not None and mine.decoded_token is not None else ""
        value = f"{mine.logprob:.3f} (rank {mine.rank})" if mine is not None else "?"
        print(f"  [{j}] {tok} {text!r} {value}  top: {alts}")
    if cumulative is not None:
        print(f"  cumulative logprob {cumulative:.3f}")

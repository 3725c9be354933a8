"""`deepinfer serve MODEL`: an OpenAI-compatible HTTP server over the engine, or over its
simulated twin (`--executor sim`). Needs the `serve` extra (FastAPI, uvicorn)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args

# Flags of one executor only: given with the other, they are refused by name.
_TORCH_ONLY = ("dtype", "device", "load_format", "revision", "enforce_eager", "trust_remote_code",
               "step_log")  # fmt: skip
_SIM_ONLY = ("hardware", "cost_model", "profile", "acceptance_rate", "tokenizer")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (--executor sim: its simulated twin)",
        description="An OpenAI-compatible server: POST /v1/completions and "
        "/v1/chat/completions (streaming or not), GET /v1/models, /health and /metrics "
        "(Prometheus). SIGTERM drains running requests (--drain-timeout) and exits.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default="deepinfer-demo",
        help="checkpoint directory, hub id, preset (with --load-format dummy, or --executor "
        "sim) or deepinfer-demo (default: %(default)s)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: MODEL)"
    )
    p.add_argument(
        "--executor",
        choices=["torch", "sim"],
        default="torch",
        help="torch (the model) or sim (the simulated twin: the same engine core, steps "
        "timed by the cost model, random tokens) (default: %(default)s)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the text) for a checkpoint that has none",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route (default: "
        "DEEPINFER_API_KEY, else none)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        metavar="N",
        help="answer 503 (Retry-After) rather than let more than N requests wait, N >= 1; "
        "a request of more than N completions is a 400 (default: no limit)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish; the rest are "
        "aborted (their streams end with finish_reason abort) (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default: %(default)s)")
    torch = p.add_argument_group("--executor torch")
    torch.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    torch.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    torch.add_argument("--load-format", default=None, help="auto, or dummy (random weights)")
    torch.add_argument("--revision", default=None, help="hub revision")
    torch.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    torch.add_argument(
        "--trust-remote-code", action="store_true", default=None, help="custom tokenizer classes"
    )
    torch.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="write every served step (its shape, host and device seconds) to this step "
        "log, which `deepinfer profile --from-log` fits a profile from (the steps are "
        "written as served, a line each, not kept in memory)",
    )
    sim = p.add_argument_group("--executor sim")
    sim.add_argument("--hardware", default=None, help="h200 (default), h100, h800, b200 or cpu")
    sim.add_argument(
        "--cost-model", choices=["profiled", "analytic", "unit"], default=None,
        help="as `deepinfer simulate` (default: profiled where a profile exists)",
    )  # fmt: skip
    sim.add_argument("--profile", default=None, help="a profile JSON from `deepinfer profile`")
    sim.add_argument(
        "--acceptance-rate", default=None, help="draft acceptance when speculating (default: 0.7)"
    )
    sim.add_argument(
        "--tokenizer", default=None, help="a checkpoint directory whose tokenizer to use"
    )
    add_engine_options(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from deepinfer.entrypoints.openai.app import build_app
        from deepinfer.entrypoints.openai.draining_server import FLUSH_S, DrainingServer
    except ModuleNotFoundError as e:
        raise ValueError(f"serve: {e.name} is not installed; pip install -e '.[serve]'") from None
    from deepinfer import envs
    from deepinfer.entrypoints.openai.async_engine import AsyncEngine
    from deepinfer.entrypoints.openai.server_metrics import ServerMetrics

    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(
            f"--max-waiting {args.max_waiting}: must be >= 1 (every request waits for a step "
            "before it runs)"
        )
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout}: must be >= 0")
    served = _load(args)
    engine = AsyncEngine(served, ServerMetrics(served.name))
    app = build_app(engine, api_key=args.api_key or envs.api_key(), max_waiting=args.max_waiting)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    facts = ", ".join(f"{k} {v}" for k, v in served.meta.items())
    print(
        f"deepinfer serve: {served.name} ({facts}); max_model_len {served.max_model_len}; "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=FLUSH_S,
        access_log=False,
    )
    # uvicorn shuts down on SIGTERM / SIGINT, then raises the signal again under the
    # handler it found: a drained server then exits 0 rather than die by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    DrainingServer(config, engine, args.drain_timeout).run()
    return 0


def _drained(sig: int, _frame: Any) -> None:
    print(f"deepinfer serve: {signal.Signals(sig).name}: drained, exiting", file=sys.stderr)


def _load(args: argparse.Namespace) -> Any:
    from deepinfer.entrypoints.openai.served_model import real_model, simulated_model

    engine = engine_config_from_args(args)
    wrong = _TORCH_ONLY if args.executor == "sim" else _SIM_ONLY
    given = [name for name in wrong if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise ValueError(f"{flags}: not an option of --executor {args.executor}")
    common: dict[str, Any] = {"name": args.served_model_name, "chat_template": args.chat_template}
    if args.executor == "sim":
        acceptance: float | str = 0.7
        if args.acceptance_rate is not None:
            try:
                acceptance = float(args.acceptance_rate)
            except ValueError:
                acceptance = args.acceptance_rate
        return simulated_model(
            args.model, engine, **common, tokenizer=args.tokenizer,
            hardware=args.hardware or "h200", cost_model=args.cost_model,
            profile=args.profile, acceptance_rate=acceptance,
        )  # fmt: skip
    kwargs = {n: getattr(args, n) for n in _TORCH_ONLY if getattr(args, n) is not None}
    try:
        return real_model(args.model, engine, **common, **kwargs)
    except (RuntimeError, OSError) as e:  # unreachable hub, unreadable checkpoint
        raise ValueError(f"cannot load model {args.model!r}: {e}") from e

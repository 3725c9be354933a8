"""`deepinfer bench serve`: a load generator for any OpenAI-compatible endpoint.

    deepinfer bench serve [TRACE] --base-url http://HOST:PORT [--model NAME]
        [--request-rate R | --time-scale S] [--max-requests N] [--slo ttft:MS,tpot:MS]
        [--out report.json] [--compare-sim --hardware h200 [engine options]]

Replays a trace (any format `deepinfer simulate` reads) against the endpoint: each
request is sent at its arrival time (scaled by --time-scale), or the trace's requests
become a seeded Poisson process at --request-rate. A request's prompt has the trace's
length and its output the trace's length (`max_tokens`, `ignore_eos`, greedy), sent to
/v1/completions as token ids: the simulator's own prompts (`sim.simulator.build_requests`),
so Mooncake's `hash_ids` become shared prefixes as they do in the simulator. Responses
are streamed; as vLLM's serving benchmark defines them, TTFT is the time to the first
chunk with text, ITL each gap between such chunks, E2EL the time to the last, TPOT
(E2EL - TTFT) / (output tokens - 1), the output tokens the server's `usage` count.
The summary (`deepinfer.metrics.summarize`: mean, median, p90, p99, throughput,
goodput under --slo) prints as `deepinfer simulate` prints its own, and --out writes
per-request records in the format of `deepinfer simulate --out` (times in seconds from
the benchmark's start; the prefix-cache hits are the server's, not seen here: 0).
--compare-sim simulates the same requests at the same arrival times (the served
model's preset or config, --hardware, the engine options) and prints the simulator's
error beside each measured figure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.metrics import parse_slo, summarize
from deepinfer.records import RequestRecord

COMPARED = [
    (f"{m}_ms_{s}", f"{m.upper()} {label} (ms)")
    for m in ("ttft", "tpot", "itl", "e2el")
    for s, label in (("mean", "mean"), ("p50", "median"), ("p90", "P90"), ("p99", "P99"))
] + [
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer bench serve",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("trace", nargs="?", default=None, help="trace file (default: the bundled "
                   "traces/azure_code_small.json)")  # fmt: skip
    p.add_argument(
        "--format", choices=["native", "azure", "mooncake", "burstgpt", "vidur"], default=None
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the endpoint's root")
    p.add_argument("--model", default=None, help="model name (default: the first it lists)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times")
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="a Poisson process of R requests/s (seeded by --seed) in place of the "
        "trace's arrivals (inf: all at once)",
    )
    p.add_argument("--max-requests", "--num-requests", dest="max_requests", type=int)
    p.add_argument("--start", type=float, default=None)
    p.add_argument("--end", type=float, default=None)
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt token ids below this (default: the served model's config)",
    )
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:2000,tpot:100")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--out", type=Path, default=None, help="write per-request records (JSON)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sim = p.add_argument_group("--compare-sim: the simulator's prediction beside")
    sim.add_argument("--compare-sim", action="store_true")
    sim.add_argument("--sim-model", default=None, help="preset or config (default: --model)")
    sim.add_argument("--hardware", default=None, help="(default: h200)")
    sim.add_argument("--cost-model", choices=["profiled", "analytic", "unit"], default=None)
    sim.add_argument("--profile", default=None, help="a profile JSON from `deepinfer profile`")
    add_engine_options(p)
    return p


@dataclass
class Sent:
    """One request's measurement, on the benchmark's clock (seconds from its start)."""

    req_id: str
    num_prompt_tokens: int
    arrival: float
    chunk_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    finish: float | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status of a refused request

    def record(self) -> RequestRecord:
        ok = self.error is None and bool(self.chunk_times)
        state = "finished" if ok else ("rejected" if self.status is not None else "aborted")
        return RequestRecord(
            req_id=self.req_id,
            status=state,
            arrival=self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens if ok else 0,
            first_token=self.chunk_times[0] if self.chunk_times else None,
            finish=self.finish,
            token_times=list(self.chunk_times),
            finish_reason="length" if ok else state,
            reason=self.error,
        )


async def _send(
    client: Any, model: str, req: Any, t0: float, timeout: float, gate: asyncio.Semaphore | None
) -> Sent:
    import openai

    await asyncio.sleep(max(0.0, req.arrival_time - (time.perf_counter() - t0)))
    if gate is not None:
        await gate.acquire()
    ids = req.prompt.token_ids(0, req.num_prompt_tokens)
    sent = Sent(req.request_id, len(ids), time.perf_counter() - t0)
    try:
        stream = await client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=req.sampling_params.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=timeout,
        )
        chunks = 0
        async for chunk in stream:
            # Every chunk of a choice is a delta of tokens (empty text from a server with
            # no tokenizer), or its finish, which comes with its last tokens.
            if chunk.choices:
                sent.chunk_times.append(time.perf_counter() - t0)
                chunks += 1
            if chunk.usage is not None:
                sent.num_output_tokens = chunk.usage.completion_tokens
        sent.num_output_tokens = sent.num_output_tokens or chunks
        sent.finish = time.perf_counter() - t0
    except openai.APIStatusError as e:
        sent.status, sent.error = e.status_code, f"HTTP {e.status_code}: {e.message}"
        sent.finish = time.perf_counter() - t0
    except (TimeoutError, openai.APIError) as e:
        sent.error = f"{type(e).__name__}: {e}"
        sent.finish = time.perf_counter() - t0
    finally:
        if gate is not None:
            gate.release()
    return sent


async def _run(args: argparse.Namespace, model: str, requests: list[Any]) -> list[Sent]:
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(
        base_url=args.base_url.rstrip("/") + "/v1",
        api_key=args.api_key or "none",
        max_retries=0,
        timeout=args.timeout,
    )
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    t0 = time.perf_counter()
    tasks = [
        asyncio.ensure_future(_send(client, model, r, t0, args.timeout, gate)) for r in requests
    ]
    out: list[Sent] = []
    with tqdm(total=len(tasks), desc="requests", unit="req", file=sys.stderr,
              disable=args.no_progress or None, leave=False) as bar:  # fmt: skip
        for done in asyncio.as_completed(tasks):
            out.append(await done)
            bar.update(1)
    await client.close()
    order = {r.request_id: i for i, r in enumerate(requests)}
    return sorted(out, key=lambda s: order[s.req_id])


def _served_model(args: argparse.Namespace) -> str:
    """--model, else the first model the endpoint lists."""
    if args.model:
        return str(args.model)
    import openai

    client = openai.OpenAI(
        base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0
    )
    try:
        models = client.models.list().data
    except openai.APIError as e:
        raise ValueError(f"--base-url {args.base_url}: cannot list its models ({e})") from None
    if not models:
        raise ValueError(f"--base-url {args.base_url}: it lists no model; pass --model")
    return str(models[0].id)


def _model_config(name: str) -> Any:
    """The served model's config (a preset, a config.json, a checkpoint, the demo)."""
    from deepinfer.entrypoints.openai.served_model import checkpoint_dir
    from deepinfer.model_config import load_model_config

    src = checkpoint_dir(name)
    return load_model_config(src if src is not None else name)


def _comparison(measured: dict[str, Any], simulated: dict[str, Any]) -> str:
    lines = [f"{'':<34}{'measured':>11}{'simulated':>11}{'error':>9}"]
    for key, label in COMPARED:
        m, s = measured.get(key), simulated.get(key)
        if m is None or s is None:
            continue
        err = f"{(s - m) / m:+.1%}" if m else "n/a"
        lines.append(f"{label:<34}{m:>11.2f}{s:>11.2f}{err:>9}")
    return "\n".join(lines)


def _simulator_options(args: argparse.Namespace) -> list[str]:
    """The --compare-sim options given (engine options included): each means something
    only to the simulation (--seed also seeds --request-rate's arrivals)."""
    given = [
        "--" + name.replace("_", "-")
        for name in ("sim_model", "hardware", "cost_model", "profile")
        if getattr(args, name) is not None
    ]
    given += [
        "--" + name.removeprefix("engine_").replace("_", "-")
        for name, value in vars(args).items()
        if name.startswith("engine_") and name != "engine_seed" and value is not None
    ]
    return given


def main() -> int:
    """0 once the trace is replayed, 1 when every request failed."""
    from deepinfer.entrypoints.cli.simulate import default_trace, retime
    from sim.report import print_summary, write_report
    from sim.simulator import build_requests
    from sim.traces import load_trace

    args = build_parser().parse_args()
    sim_only = _simulator_options(args)
    if sim_only and not args.compare_sim:
        raise ValueError(
            f"{', '.join(sim_only)}: options of the simulation, which only --compare-sim runs "
            "(the endpoint's own engine is configured where it was started)"
        )
    path = Path(args.trace) if args.trace else default_trace()
    trace = load_trace(
        path, args.format, time_scale=args.time_scale, max_requests=args.max_requests,
        start=args.start, end=args.end,
    )  # fmt: skip
    engine = engine_config_from_args(args)
    if args.request_rate is not None:
        trace = retime(trace, args.request_rate, engine.seed, args.time_scale)
    slo = parse_slo(args.slo) if args.slo else None
    model = _served_model(args)
    sim_model = args.sim_model or model
    vocab = args.vocab_size
    if vocab is None:
        try:
            vocab = _model_config(sim_model).vocab_size
        except ValueError as e:
            raise ValueError(f"{e}; give --vocab-size (or --sim-model)") from None
    requests = build_requests(trace, vocab)
    sent = asyncio.run(_run(args, model, requests))
    records = [s.record() for s in sent]
    summary = summarize(records, None, slo)
    print_summary(summary, f"{trace.name} against {args.base_url} ({model})")
    meta: dict[str, Any] = {
        "trace": trace.name,
        "trace_path": str(path),
        "num_requests": len(trace),
        "base_url": args.base_url,
        "model": model,
        "measured": "http",
        "request_rate": args.request_rate,
        "time_scale": args.time_scale,
    }
    if args.compare_sim:
        from sim.simulator import simulate

        result = simulate(
            trace, _model_config(sim_model), args.hardware or "h200", engine, args.cost_model,
            profile=args.profile, slo=slo,
        )  # fmt: skip
        cal = "calibrated" if result.meta.get("calibrated") else "uncalibrated"
        print(f"\nthe simulator ({result.meta['cost_model']}, {cal}) on the same requests:")
        print(_comparison(summary, result.summary))
        meta["simulated"] = {"summary": result.summary, "meta": result.meta}
    if args.out:
        write_report(args.out, summary, records, None, meta, include_token_times=True)
        print(f"report: {args.out}")
    failed = [s for s in sent if s.error is not None or not s.chunk_times]
    if sent and len(failed) == len(sent):
        print(f"bench serve: every request failed; the first: {failed[0].error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

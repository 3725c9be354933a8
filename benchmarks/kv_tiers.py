"""The KV cache off the GPU, measured: a host-memory tier and a 1P1D handover, each beside
the simulator's prediction of the same run (issue 45's device figures).

    deepinfer bench kv-tiers --out DIR [--model moonlight-16b-a3b] [--device cuda]
        [--trace mooncake_conversation_small.jsonl] [--num-requests 60]
        [--max-prompt 8192] [--max-output 32] [--prefix-hit 0.7 --documents 8]
        [--hbm-fraction 0.25] [--host-gib G]
        [--pd-requests 16] [engine options]

1. tiers: the trace's requests (prefix reuse: requests sharing hash ids share those
   prompt blocks; the first requests of Mooncake's conversation slice share little
   beyond a system prompt that never leaves HBM, so by default each request's leading
   part is one of --documents shared documents, taken in turn, for --prefix-hit of the
   prompt tokens, which evicts each before it comes back), all arriving at once, through the real engine (EngineCore + the torch
   executor, dummy weights for a preset) with `num_gpu_blocks` set so that HBM holds
   --hbm-fraction of the prefix blocks that two or more requests share, once without and
   once with `kv_host_cache_gib` (default: room for every shared prefix block). Per run:
   TTFT p50/p99, prompt tokens computed (the steps' prompt tokens: a prefix hit is not
   computed, a preempted request's prompt is computed again), prefix hits per tier (the
   KV manager's counters), blocks saved to and loaded from host memory, and the copy
   bandwidth achieved each way: the bytes loaded from host slots over the time the tier's
   copy stream spent on the steps' gathers and loads, and the bytes saved over the time
   its save stream spent on them (CUDA events around each step's copies on each stream:
   the gather and the scatter in HBM are inside the load side's time, so its figure is a
   floor of the link's), against PCIe Gen5 x16's and NVLink-C2C's figures. On a CPU the
   times are the wall time of the copies (no stream). Beside each figure: `simulate()`
   of the same requests with the same EngineConfig (the same num_gpu_blocks and tier).
2. pd: the first --pd-requests of the requests through a prefill and a decode engine in
   this process (deepinfer/disaggregated_engine.py; on one GPU both share it), all
   arriving at once: per handover its bytes and its time, the export (the gather of the
   prompt's KV on the prefill engine) plus the import (the scatter into the decode
   engine's blocks before its first step), each timed with CUDA events on the compute
   stream (a CPU: wall time). Beside it: the simulator's PD cluster of the same two
   engines (`simulate_cluster`, the handover sent whole after the prefill, not layer by
   layer) over the intra-node link (NVLink) and the inter-node one (an RDMA NIC), its
   transfer time per handover and its bytes.

Prints markdown tables; writes DIR/kv_tiers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fidelity_workloads import TRACES, with_prefix_hit
from benchmarks.replay import ReplayResult, add_replay_options, materialized_requests, replay
from deepinfer.config import EngineConfig, EngineRole
from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.kv_cache.tiers import HBM, HOST
from deepinfer.model_config import ModelConfig, known_models, load_model_config
from deepinfer.records import RequestRecord, StepRecord
from sim import simulate
from sim.cluster.description import DEFAULT_LINKS, cluster_from_dict
from sim.cluster.simulate_cluster import simulate_cluster
from sim.kv_capacity import kv_bytes_per_token
from sim.kv_tiers import DEFAULT_HOST, GIB, tier_stats
from sim.traces import Trace, load_trace, offline

# Host-to-device links, one direction, datasheet figures: PCIe Gen5 x16 (64 GB/s raw) and
# Grace Hopper's NVLink-C2C (900 GB/s both ways together).
LINKS_GB_S = {"PCIe Gen5 x16": 64.0, "NVLink-C2C": 450.0}


# ---- the requests -----------------------------------------------------------------------


def trace_slice(path: Path, num_requests: int, max_prompt: int, max_output: int) -> Trace:
    """The first `num_requests` requests of `path` whose prompt fits `max_prompt`, their
    outputs cut to `max_output` tokens, every one arriving at 0 (the TTFTs then compare a
    queue both sides drain alike, not arrival noise)."""
    base = load_trace(path)
    reqs = [r for r in base.requests if r.prompt_len <= max_prompt][:num_requests]
    if not reqs:
        raise ValueError(f"{path}: no request with a prompt of at most {max_prompt} tokens")
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, max_output)) for r in reqs]
    return offline(Trace(base.name, base.source, reqs))


def shared_prefix_blocks(trace: Trace, block_size: int) -> int:
    """Engine blocks (of `block_size` tokens) in the prefix chains two or more of the
    trace's requests share: what a prefix cache that never evicted would serve again."""
    chains: Counter[tuple[int, ...]] = Counter()
    tokens = 0
    for r in trace.requests:
        for i in range(len(r.prefix_blocks)):
            chains[tuple(r.prefix_blocks[: i + 1])] += 1
    for chain, count in chains.items():
        if count >= 2:
            owner = next(r for r in trace.requests if tuple(r.prefix_blocks[: len(chain)]) == chain)
            tokens += owner.prefix_block_size
    return tokens // block_size


def hbm_blocks(trace: Trace, block_size: int, fraction: float) -> int:
    """`fraction` of the shared prefix blocks, never fewer than the longest request needs
    plus one (each request must fit alone, or the engine rejects it)."""
    need = max(math.ceil((r.prompt_len + r.output_len) / block_size) for r in trace.requests)
    return max(math.ceil(fraction * shared_prefix_blocks(trace, block_size)), need + 1)


# ---- the figures of one run, real or simulated ------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def run_figures(
    records: list[RequestRecord], steps: list[StepRecord], stats: dict[str, Any]
) -> dict[str, Any]:
    """TTFT p50/p99 (s), prompt tokens computed, prefix hits per tier, host blocks moved
    (`stats`: sim/kv_tiers.py's `tier_stats` of the run's engine)."""
    ttft = [r.first_token - r.arrival for r in records if r.first_token is not None]
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "prompt_tokens_computed": sum(s.num_prompt_tokens for s in steps),
        "hbm_hit_blocks": stats["hit_blocks"][HBM],
        "host_hit_blocks": stats["hit_blocks"][HOST],
        "host_bytes_saved": stats["bytes_saved"][HOST],
        "host_bytes_loaded": stats["bytes_loaded"][HOST],
        "statuses": sorted({r.status for r in records}),
    }


# ---- the host tier's copies, timed ------------------------------------------------------


class CopyTimes:
    """The host tier's copies of each step, timed around `HostKVTier._load` (the gather of
    the saves and the loads, on the copy stream) and `HostKVTier._save` (the saves' way to
    the host, on the save stream), benchmark only: the tier itself times nothing. On CUDA
    an event pair on each call's stream, read after the run; on a CPU the calls' wall
    time. Bytes: host to device (loads read from a host slot, not from the step's own
    save) and device to host (distinct slots saved). The load side's time holds the gather
    and the scatter in HBM, and any wait for a save still writing a slot it reads: its
    bandwidth is a floor of the link's."""

    def __init__(self) -> None:
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self._events: dict[str, list[Any]] = {"load": [], "save": []}  # (start, end) pairs
        self._wall_s = {"load": 0.0, "save": 0.0}

    @contextmanager
    def around(self, tier: Any) -> Iterator[None]:
        import torch

        on_cuda = tier.stream is not None

        def timed(side: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                if not on_cuda:
                    t0 = time.perf_counter()
                    result = original(*args)
                    self._wall_s[side] += time.perf_counter() - t0
                    return result
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()  # (the current stream: the tier's, as it calls)
                result = original(*args)
                end.record()
                self._events[side].append((start, end))
                return result

            return call

        def load(loads: Any, saves: Any, sources: Any, fences: Any) -> Any:
            self.bytes_h2d += sum(1 for j in sources if j is None) * tier.block_bytes
            return timed("load", tier_load)(loads, saves, sources, fences)

        def save(saves: Any, written: Any, gathered: Any) -> None:
            self.bytes_d2h += len(written) * tier.block_bytes
            timed("save", tier_save)(saves, written, gathered)

        tier_load, tier_save = tier._load, tier._save
        tier._load, tier._save = load, save
        try:
            yield
        finally:
            del tier._load, tier._save  # the class's methods again

    def seconds(self, side: str) -> float:
        """The time the `side` ("load" or "save") stream spent on the tier's copies."""
        events = self._events[side]
        if events:
            import torch

            torch.cuda.synchronize()
        return self._wall_s[side] + sum(a.elapsed_time(b) for a, b in events) / 1e3

    def to_dict(self) -> dict[str, Any]:
        load_s, save_s = self.seconds("load"), self.seconds("save")
        on_cuda = any(self._events.values())
        return {
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "load_s": load_s,
            "save_s": save_s,
            "timed_by": "cuda events on the tier's streams" if on_cuda else "wall time",
            "h2d_gb_s": self.bytes_h2d / load_s / 1e9 if load_s > 0 else None,
            "d2h_gb_s": self.bytes_d2h / save_s / 1e9 if save_s > 0 else None,
        }


# ---- part 1: the host tier --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sides:
    """How each run is made on both sides: `build` an executor of an EngineConfig (the
    real side), the simulator's model, hardware and profile."""

    build: Callable[[EngineConfig], Any]
    sim_model: str | ModelConfig
    hardware: str
    profile: Path | None


def tier_runs(sides: Sides, cfg: EngineConfig, trace: Trace) -> list[dict[str, Any]]:
    """The trace without and with the host tier (`cfg` has both sizes set but the tier's),
    each real run beside `simulate()` of the same requests and engine."""
    rows = []
    for with_tier in (False, True):
        engine = cfg if with_tier else cfg.replace(kv_host_cache_gib=0.0)
        executor = sides.build(engine)
        try:
            times = CopyTimes()
            tier = executor.runner.host_tier
            if tier is None:
                real = replay(executor, engine, trace, executor.max_model_len)
            else:
                with times.around(tier):
                    real = replay(executor, engine, trace, executor.max_model_len)
            block_bytes = tier.block_bytes if tier is not None else 0
            row = _real_row(real, block_bytes)
            row["copies"] = times.to_dict() if tier is not None else None
            row["host_slots"] = tier.num_slots if tier is not None else 0
            row["tokens"] = real.output_tokens  # (greedy: the same with and without the tier)
        finally:
            executor.shutdown()
        sim = simulate(trace, sides.sim_model, sides.hardware, engine, None, profile=sides.profile)
        kv = sim.meta["kv_tiers"]
        row["sim"] = run_figures(sim.requests, sim.steps, kv)
        row["sim"]["host_slots"] = kv["tiers"].get(HOST, {}).get("capacity_blocks", 0)
        row["sim"]["host_gb_s"] = DEFAULT_HOST.bandwidth / 1e9 if with_tier else None
        row["host_kv_cache_gib"] = engine.kv_host_cache_gib
        rows.append(row)
    return rows


def _real_row(real: ReplayResult, block_bytes: int) -> dict[str, Any]:
    assert real.kv is not None
    return run_figures(real.records, real.engine_steps, tier_stats([(real.kv, block_bytes)]))


# ---- part 2: 1P1D in one process --------------------------------------------------------


class HandoverTimes:
    """Per handed-over request: its bytes and the device time of its export (gather) and
    import (scatter, before the decode engine's first step of it), benchmark only: the
    executors are wrapped, not changed. An import step holding several requests' KV is
    shared among them by their tokens."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._export: dict[str, Any] = {}  # req_id -> seconds or an event pair
        self._import: list[tuple[Any, dict[str, int]]] = []  # (timing, {req_id: tokens})

    @contextmanager
    def around(self, prefill: Any, decode: Any) -> Iterator[None]:
        transfer = decode.runner.kv_transfer
        export, apply = prefill.export_kv, transfer.apply
        on_cuda = prefill.device.type == "cuda"

        def timed_export(request: Any, num_tokens: int) -> Any:
            with _timed(on_cuda) as timing:
                kv = export(request, num_tokens)
            self._export[request.request_id] = timing
            self.bytes[request.request_id] = kv.num_bytes
            self.tokens[request.request_id] = num_tokens
            return kv

        def timed_apply(out: Any) -> None:
            before = {k: v.num_tokens for k, v in transfer._pending.items()}
            with _timed(on_cuda) as timing:
                apply(out)
            done = {k: n for k, n in before.items() if k not in transfer._pending}
            if done:
                self._import.append((timing, done))

        prefill.export_kv, transfer.apply = timed_export, timed_apply
        try:
            yield
        finally:
            del prefill.export_kv, transfer.apply

    def per_request(self) -> dict[str, dict[str, float]]:
        out = {
            rid: {"bytes": self.bytes[rid], "export_s": _seconds(t), "import_s": 0.0}
            for rid, t in self._export.items()
        }
        for timing, done in self._import:
            s, total = _seconds(timing), sum(done.values())
            for rid, n in done.items():
                if rid in out:
                    out[rid]["import_s"] += s * n / total if total else 0.0
        return out


@contextmanager
def _timed(on_cuda: bool) -> Iterator[list[Any]]:
    """Yields a list that holds, after the block, [seconds] (CPU) or [start, end] events
    recorded on the current stream (CUDA)."""
    if not on_cuda:
        t0 = time.perf_counter()
        timing: list[Any] = []
        yield timing
        timing.append(time.perf_counter() - t0)
        return
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timing = [start, end]
    start.record()
    yield timing
    end.record()


def _seconds(timing: list[Any]) -> float:
    if len(timing) == 1:
        return float(timing[0])
    timing[1].synchronize()
    return float(timing[0].elapsed_time(timing[1])) / 1e3


def pd_run(sides: Sides, cfg: EngineConfig, trace: Trace) -> dict[str, Any]:
    """`trace` through a prefill and a decode engine in this process, each handover timed,
    beside the simulator's PD cluster of the same engines over each default link."""
    from deepinfer.disaggregated_engine import DisaggregatedEngine
    from deepinfer.engine import EngineCore

    engine = cfg.replace(kv_host_cache_gib=0.0)
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    executors = [
        sides.build(engine.replace(role=role)) for role in (EngineRole.PREFILL, EngineRole.DECODE)
    ]
    times = HandoverTimes()
    try:
        cores = [
            EngineCore(ex.engine_config, ex, clock=clock, model_max_len=ex.max_model_len)
            for ex in executors
        ]
        pd = DisaggregatedEngine([cores[0]], [cores[1]], seed=engine.seed)
        requests = materialized_requests(trace, executors[0].config.vocab_size)
        with times.around(*executors):
            for req in requests:
                pd.add_request(req)
            while pd.has_unfinished():
                pd.step()
        tokens = [list(r.output_token_ids) for r in requests]
        statuses = sorted({r.status.value for r in requests})
        num_handovers, handover_bytes = pd.num_handovers, pd.handover_bytes
    finally:
        for ex in executors:
            ex.shutdown()
    per = times.per_request()
    total = [r["export_s"] + r["import_s"] for r in per.values()]
    real = {
        "handovers": num_handovers,
        "handover_bytes": handover_bytes,
        "bytes_per_request_p50": _pct([r["bytes"] for r in per.values()], 50),
        "export_s_p50": _pct([r["export_s"] for r in per.values()], 50),
        "import_s_p50": _pct([r["import_s"] for r in per.values()], 50),
        "handover_s_p50": _pct(total, 50),
        "handover_s_p99": _pct(total, 99),
        "gb_s": handover_bytes / sum(total) / 1e9 if sum(total) > 0 else None,
        "bytes_per_token": sum(times.bytes.values()) / max(1, sum(times.tokens.values())),
        "statuses": statuses,
        "per_request": per,
    }
    sims = {}
    for link in ("intra_node", "inter_node"):
        spec = cluster_from_dict(
            {
                "model": sides.sim_model
                if isinstance(sides.sim_model, str)
                else sides.sim_model.name,
                "pools": [
                    {"name": "prefill", "role": "prefill", "count": 1, "hardware": sides.hardware},
                    {"name": "decode", "role": "decode", "count": 1, "hardware": sides.hardware},
                ],
                "kv_transfer": {"link": link, "layerwise": False},
            },
            source=f"kv-tiers 1P1D over {link}",
            base_engine=engine,
            hardware=sides.hardware,
        )
        res = simulate_cluster(trace, spec, profile=sides.profile)
        sent = [ho for ho in res.handovers.values() if not math.isnan(ho.kv_arrived)]
        wire = [ho.kv_arrived - max(ho.ready, ho.reserved) for ho in sent]
        stages = res.meta["disaggregation"]
        sims[link] = {
            "link": {
                "bandwidth_gb_s": DEFAULT_LINKS[link].bandwidth / 1e9,
                "latency_us": DEFAULT_LINKS[link].latency_s * 1e6,
            },
            "handovers": len(sent),
            "handover_bytes": sum(ho.kv_bytes for ho in sent),
            "bytes_per_token": stages["kv_bytes_per_token"],
            "handover_s_p50": _pct(wire, 50),
            "handover_s_p99": _pct(wire, 99),
            # the link's price of the real run's bytes, handover by handover
            "real_bytes_s_p50": _pct(
                [
                    DEFAULT_LINKS[link].latency_s + r["bytes"] / DEFAULT_LINKS[link].bandwidth
                    for r in per.values()
                ],
                50,
            ),
        }
    return {"real": real, "sim": sims, "tokens": tokens}


# ---- the tables -------------------------------------------------------------------------


def _fmt(x: Any, scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) or (isinstance(x, int) and scale != 1.0):
        return f"{x * scale:.{digits}g}"
    return str(x)


def print_tier_table(rows: list[dict[str, Any]]) -> None:
    print("\n## Host KV tier: real | simulated\n")
    print("| figure | no tier | no tier (sim) | host tier | host tier (sim) |")
    print("|---|---|---|---|---|")
    figures = [
        ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
        ("TTFT p99 (ms)", "ttft_p99_s", 1e3),
        ("prompt tokens computed", "prompt_tokens_computed", 1.0),
        ("HBM prefix hits (blocks)", "hbm_hit_blocks", 1.0),
        ("host prefix hits (blocks)", "host_hit_blocks", 1.0),
        ("host GB saved", "host_bytes_saved", 1e-9),
        ("host GB loaded", "host_bytes_loaded", 1e-9),
        ("host slots (blocks)", "host_slots", 1.0),
    ]
    for label, key, scale in figures:
        cells = []
        for row in rows:
            real = row.get(key)
            cells += [_fmt(real, scale), _fmt(row["sim"].get(key), scale)]
        print(f"| {label} | " + " | ".join(cells) + " |")
    copies = rows[1]["copies"]
    if copies is not None:
        print(
            f"\nhost tier copies ({copies['timed_by']}): {copies['bytes_h2d'] / 1e9:.3f} GB "
            f"host to device in {copies['load_s'] * 1e3:.1f} ms on the copy stream "
            f"({_fmt(copies['h2d_gb_s'])} GB/s), {copies['bytes_d2h'] / 1e9:.3f} GB device "
            f"to host in {copies['save_s'] * 1e3:.1f} ms on the save stream "
            f"({_fmt(copies['d2h_gb_s'])} GB/s); the simulator prices "
            f"{_fmt(rows[1]['sim']['host_gb_s'])} GB/s for loads; "
            + ", ".join(f"{k} {v:g} GB/s" for k, v in LINKS_GB_S.items())
        )


def print_pd_table(pd: dict[str, Any]) -> None:
    real, sims = pd["real"], pd["sim"]
    print("\n## 1P1D in one process: real | simulated (handover sent whole after the prefill)\n")
    heads = [f"sim {k} ({v['link']['bandwidth_gb_s']:g} GB/s)" for k, v in sims.items()]
    print("| figure | real | " + " | ".join(heads) + " |")
    print("|---|---|" + "---|" * len(sims))
    figures = [
        ("handovers", "handovers", 1.0),
        ("bytes handed over (MB)", "handover_bytes", 1e-6),
        ("KV bytes per token", "bytes_per_token", 1.0),
        ("handover time p50 (ms)", "handover_s_p50", 1e3),
        ("handover time p99 (ms)", "handover_s_p99", 1e3),
    ]
    for label, key, scale in figures:
        cells = [_fmt(real.get(key), scale)] + [_fmt(s.get(key), scale) for s in sims.values()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = [_fmt(s["real_bytes_s_p50"], 1e3) for s in sims.values()]
    print("| the link's price of the real bytes, p50 (ms) | | " + " | ".join(cells) + " |")
    print(
        f"\nreal handover: export p50 {_fmt(real['export_s_p50'], 1e3)} ms + import p50 "
        f"{_fmt(real['import_s_p50'], 1e3)} ms (device copies on one GPU), "
        f"{_fmt(real['gb_s'])} GB/s over all handovers"
    )


# ---- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_replay_options(p)
    p.add_argument("--trace", default="mooncake_conversation_small.jsonl",
                   help="a trace file, or a name under traces/")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--max-prompt", type=int, default=8192)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--prefix-hit", type=float, default=0.7,
                   help="the slice's prefix blocks rewritten so that an unbounded cache "
                   "would serve this fraction of its prompt tokens, request i sharing "
                   "document i mod --documents (benchmarks/fidelity_workloads.py's "
                   "with_prefix_hit); 0: the trace's own hash ids")  # fmt: skip
    p.add_argument("--documents", type=int, default=8,
                   help="shared documents the requests take turns on (--prefix-hit)")  # fmt: skip
    p.add_argument("--hbm-fraction", type=float, default=0.25,
                   help="num_gpu_blocks: this fraction of the shared prefix blocks (unless "
                   "--num-gpu-blocks is given)")  # fmt: skip
    p.add_argument("--host-gib", type=float, default=None,
                   help="the host tier (default: room for every shared prefix block)")  # fmt: skip
    p.add_argument("--pd-requests", type=int, default=16,
                   help="requests of the 1P1D run (0: no 1P1D run)")  # fmt: skip
    add_engine_options(p)
    args = p.parse_args(argv)
    cfg = engine_config_from_args(args)
    if cfg.kv_host_cache_gib > 0:
        raise ValueError(
            "--kv-host-cache-gib: this benchmark runs without and with the tier; size it "
            "with --host-gib"
        )
    if cfg.role is not EngineRole.NORMAL or cfg.data_parallel_size > 1:
        raise ValueError("kv-tiers runs one engine (and its own 1P1D pair): leave role and "
                         "data_parallel_size unset")  # fmt: skip

    import torch

    from executors.loader import resolve_model_dir
    from executors.profile_env import hardware_name
    from executors.torch_executor import TorchExecutor

    dummy = args.model in known_models()
    spec = load_model_config(resolve_model_dir(args.model, weights=not dummy))
    sim_model = args.model if dummy else str(resolve_model_dir(args.model, weights=True))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hardware = args.hardware or hardware_name(device)
    path = Path(args.trace) if Path(args.trace).exists() else TRACES / args.trace
    limit = min(args.max_prompt, spec.max_position_embeddings - args.max_output)
    trace = trace_slice(path, args.num_requests, limit, args.max_output)
    if args.prefix_hit > 0:
        trace = with_prefix_hit(trace, args.prefix_hit, args.documents)
    bs = cfg.block_size
    shared = shared_prefix_blocks(trace, bs)
    if shared == 0:
        raise ValueError(f"{path.name}: its first {len(trace)} requests share no prefix block")
    blocks = cfg.num_gpu_blocks or hbm_blocks(trace, bs, args.hbm_fraction)
    block_bytes = bs * kv_bytes_per_token(spec, cfg.num_speculative_tokens > 0)
    host_gib = args.host_gib if args.host_gib is not None else shared * block_bytes / GIB
    cfg = cfg.replace(num_gpu_blocks=blocks, kv_host_cache_gib=host_gib)
    print(
        f"{len(trace)} requests of {path.name}: {shared} shared prefix blocks of {bs} tokens; "
        f"HBM {blocks} blocks, host tier {host_gib:.3f} GiB ({block_bytes} bytes a block); "
        f"{device}, simulator on {hardware}",
        flush=True,
    )

    def build(engine: EngineConfig) -> Any:
        return TorchExecutor(
            engine, args.model, device=str(device), dtype=args.dtype,
            load_format="dummy" if dummy else "auto",
        )  # fmt: skip

    sides = Sides(build, sim_model, hardware, args.profile)
    rows = tier_runs(sides, cfg, trace)
    print_tier_table(rows)
    same = rows[0].pop("tokens") == rows[1].pop("tokens")
    print(f"\ngreedy tokens with and without the host tier the same: {same}")
    pd = None
    if args.pd_requests > 0:
        pd_trace = Trace(trace.name, trace.source, trace.requests[: args.pd_requests])
        pd = pd_run(sides, cfg, pd_trace)
        pd.pop("tokens")
        print_pd_table(pd)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {
            "model": args.model,
            "trace": path.name,
            "num_requests": len(trace),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "hardware": hardware,
            "engine": cfg.to_dict(),
            "shared_prefix_blocks": shared,
            "block_bytes": block_bytes,
            "links_gb_s": LINKS_GB_S,
            "sim_host_link": {
                "bandwidth_gb_s": DEFAULT_HOST.bandwidth / 1e9,
                "latency_us": DEFAULT_HOST.latency_s * 1e6,
            },
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "tiers": {"without": rows[0], "with": rows[1], "same_greedy_tokens": same},
        "pd": pd,
    }
    (args.out / "kv_tiers.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out / 'kv_tiers.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

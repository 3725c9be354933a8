"""`deepinfer bench NAME [its options]`: run one of the benchmarks.

Each benchmark is a module of the `benchmarks` package with its own options and a
`main()`; `deepinfer bench NAME --help` prints them. The module is imported only when
its benchmark runs (most need torch, several a GPU), so the command line stays light.
Figures go to benchmarks/RESULTS.md with the command that measured them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# name -> (module of the benchmarks package, one line for `deepinfer bench --help`)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "model-speed": (
        "model_speed",
        "real-executor prefill and decode throughput in a preset's shapes (random weights), "
        "beside HF transformers and the roofline (CUDA)",
    ),
    "first-burst": (
        "first_burst",
        "start-up, then a fresh engine's first burst of requests against the same burst again",
    ),
    "speculative": (
        "speculative",
        "decode speed with MTP speculation over without, measured and simulated (CUDA)",
    ),
    "fidelity": (
        "fidelity",
        "the same requests through the real engine and the simulator: the simulator's errors "
        "per step and per request (--real DIR: simulate again, no GPU)",
    ),
    "sim-speed": ("sim_speed", "the simulator's wall time on whole public traces"),
    "cluster-plans": (
        "cluster_plans",
        "colocated replicas under each router and prefill/decode ratios on one trace",
    ),
    "kv-tiers": (
        "kv_tiers",
        "a trace with prefix reuse without and with the host KV tier, and 1P1D handovers, "
        "each beside the simulator's prediction",
    ),
    "deepseek-production": (
        "deepseek_production",
        "DeepSeek's published per-node throughput beside the simulator's for its plan",
    ),
    "sweep-speed": ("sweep_speed", "`deepinfer sweep` wall time against the worker count"),
    "kernels": (
        "kernels_bench",
        "the Triton kernels against their torch twins and the device's ceilings (CUDA)",
    ),
    "vidur": ("vidur_compare", "Vidur against this simulator on one public trace, timed alike"),
    "batch-invariant": (
        "batch_invariant",
        "decode and prefill step times with batch-invariant mode on and off (CUDA)",
    ),
    "structured-outputs": (
        "structured_mask",
        "the grammar token mask's cost, per token and per decode step (--mask-only: any CPU)",
    ),
    "data-parallel": (
        "data_parallel",
        "data + expert parallelism on N GPUs against one, measured and simulated",
    ),
    "serve": (
        "serving",
        "load an OpenAI-compatible endpoint with a trace: TTFT, TPOT, ITL, E2EL, goodput "
        "(--compare-sim: the simulator's error beside)",
    ),
    "host-overhead": (
        "host_overhead",
        "host time per scheduled request of a decode step, the forward left out",
    ),
}


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark (deepinfer bench --help lists them)",
        description="Run one benchmark with its own options: deepinfer bench NAME [OPTIONS] "
        "(deepinfer bench NAME --help lists them). The benchmarks live in the repository "
        "(an editable install, `pip install -e .`): they read its bundled traces.",
    )
    names = p.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, (_, line) in BENCHMARKS.items():
        # Everything after NAME belongs to the benchmark's own parser, --help included:
        # no prefix character, so this parser takes no option of its own.
        q = names.add_parser(name, help=line, add_help=False, prefix_chars="\0")
        q.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    module_name = f"benchmarks.{BENCHMARKS[args.benchmark][0]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        raise ValueError(
            "bench: the benchmarks package is not importable; run from the repository "
            "root, or install it (pip install -e .)"
        ) from e
    # The benchmark parses sys.argv as a script does; its usage line names the command.
    saved = sys.argv
    sys.argv = [f"deepinfer bench {args.benchmark}", *args.args]
    try:
        return int(module.main() or 0)
    finally:
        sys.argv = saved

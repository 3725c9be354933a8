"""Vidur vs deepinfer's simulator on one public trace: wall time and latency figures.

    python benchmarks/vidur_compare.py --vidur-python /tmp/vidur-venv/bin/python [--cpu 0]

Vidur (Microsoft's LLM inference simulator, PyPI `vidur`, tested with 0.0.26) runs
in its own virtual environment, never in this one:

    python3 -m venv /tmp/vidur-venv && /tmp/vidur-venv/bin/pip install vidur==0.0.26

What this script does:

1. Converts the Azure code trace (default ../shared/traces/azure2023_code.csv) into
   the CSV that Vidur 0.0.26's `trace_replay` request generator reads (columns
   Date, Time [s], PromptTokenCount, CompletionTokenCount), with every scale
   factor 1 so Vidur replays the same sizes and arrival times we do.
2. Vidur 0.0.26 takes its execution-time profiles from HuggingFace datasets
   (`project-vajra/...`); the wheel ships none. Unless `--profiling-dataset` names
   one already in the Hugging Face cache, this script writes a *synthetic*
   roofline profile of Llama-3-8B on one H100 (bf16; see `synth_profile`) into a
   local, offline Hugging Face cache layout, so Vidur trains its random-forest
   predictors on that. Vidur's latencies are then only as good as that roofline:
   indicative, not Vidur's measured profile.
3. Runs Vidur twice (cold: trains and caches its predictors; warm: the cached
   predictors, which is the simulator's own speed; by default with one random-forest
   setting instead of Vidur's 27-setting grid search, see --full-grid) with the Sarathi scheduler
   (chunked prefill, the policy closest to ours), batch cap 256, chunk 8192
   tokens, block 64; `--vidur-scheduler vllm` picks Vidur's vLLM scheduler.
4. Runs our `sim.simulate` on the same trace with our defaults (moonlight-16b-a3b
   on h200, 256 seqs, 8192 batched tokens, block 64), as benchmarks/sim_speed.py.
5. Prints wall seconds, per-request wall time, the ratio, and mean/p99 TTFT,
   TPOT and E2E for both. Models and hardware differ, so the latency columns
   compare policy-level behaviour only; the speed ratio is the figure.

With `--cpu N` both simulators are pinned to CPU N (Vidur's subprocess inherits
the affinity), so neither gets more cores than the other.
"""

from __future__ import annotations

import argparse
import csv
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASET_COMPUTE = "local/synthetic-roofline-llama-3-8b-h100"
DATASET_NETWORK = "local/synthetic-roofline-h100-dgx"
SNAPSHOT = "0" * 40


class VidurUnavailable(RuntimeError):
    pass


# --------------------------------------------------------------------------- trace


def convert_trace(src: Path, dst: Path, date: str) -> int:
    """Azure 2023 CSV (TIMESTAMP, ContextTokens, GeneratedTokens) -> Vidur trace_replay CSV."""

    def seconds(stamp: str) -> float:
        return datetime.fromisoformat(stamp.strip()[:26]).timestamp()

    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    t0 = seconds(rows[0]["TIMESTAMP"])
    with open(dst, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in rows:
            w.writerow(
                [
                    date,
                    f"{seconds(r['TIMESTAMP']) - t0:.6f}",
                    max(1, int(r["ContextTokens"])),
                    max(1, int(r["GeneratedTokens"])),
                ]
            )
    return len(rows)


# ------------------------------------------------------------ synthetic profile

# Llama-3-8B as Vidur 0.0.26 describes it (vidur.config.model_config).
L3 = dict(n_head=32, n_kv_head=8, n_embd=4096, n_expanded_embd=14336, vocab_size=128256)
# H100 SXM bf16: dense peak 989 TFLOP/s and 3.35 TB/s HBM, at 60 % / 80 % achieved.
FLOPS = 989e12 * 0.6
BW = 3.35e12 * 0.8
LAUNCH_MS = 0.004


def _op_ms(flops: float, nbytes: float) -> float:
    return max(flops / FLOPS, nbytes / BW) * 1e3 + LAUNCH_MS


def synth_profile(root: Path, block_size: int) -> None:
    """Write a roofline profile in the layout of Vidur's HF profiling datasets."""
    d, kvd, ff = L3["n_embd"], L3["n_embd"] * L3["n_kv_head"] // L3["n_head"], L3["n_expanded_embd"]
    gemms = {  # name: (in, out)
        "attn_pre_proj": (d, d + 2 * kvd),
        "attn_post_proj": (d, d),
        "mlp_up_proj": (d, 2 * ff),
        "mlp_down_proj": (ff, d),
    }
    tokens = sorted(set(list(range(1, 129)) + list(range(128, 16385, 64))))
    mlp_rows = []
    for t in tokens:
        row = dict(L3, use_gated_mlp=True, num_tensor_parallel_workers=1, num_tokens=t)
        for name, (i, o) in gemms.items():
            row[f"time_stats.{name}.median"] = _op_ms(2 * t * i * o, 2 * (i * o + t * (i + o)))
        row["time_stats.mlp_act.median"] = _op_ms(3 * t * ff, 2 * t * 3 * ff)
        for name in ("input_layernorm", "post_attention_layernorm", "add"):
            row[f"time_stats.{name}.median"] = _op_ms(4 * t * d, 2 * t * 3 * d)
        row["time_stats.attn_rope.median"] = _op_ms(6 * t * (d + kvd), 2 * t * 2 * (d + kvd))
        mlp_rows.append(row)

    attn_rows = []
    base = dict(
        n_embd=d,
        n_q_head=L3["n_head"],
        n_kv_head=L3["n_kv_head"],
        block_size=block_size,
        num_tensor_parallel_workers=1,
    )

    def attn_row(batch: int, chunk: int, kv: int) -> dict:
        if chunk:  # one prefill chunk attending to kv cached + chunk/2 causal tokens
            flops = 4 * chunk * (kv + chunk / 2) * d
            nbytes = 2 * (2 * (kv + chunk) * kvd + 2 * chunk * d)
            prefill, decode = _op_ms(flops, nbytes), 0.0
        else:
            flops = 4 * batch * kv * d
            nbytes = 2 * (2 * batch * kv * kvd + 2 * batch * d)
            prefill, decode = 0.0, _op_ms(flops, nbytes)
        n = max(chunk, batch)
        return dict(
            base,
            batch_size=batch,
            prefill_chunk_size=chunk,
            kv_cache_size=kv,
            **{
                "time_stats.attn_prefill.median": prefill,
                "time_stats.attn_decode.median": decode,
                "time_stats.attn_kv_cache_save.median": _op_ms(0, 2 * 2 * n * kvd * 2),
            },
        )

    for chunk in [32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192]:
        for kv in range(0, 16385 - chunk, 512):
            attn_rows.append(attn_row(1, chunk, kv))
    for batch in [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]:
        for kv in range(256, 16385, 512):
            attn_rows.append(attn_row(batch, 0, kv))

    net_rows = []
    for coll, dpn in (("all_reduce", 1), ("send_recv", 2)):
        for n in (1, 2, 4, 8):
            for size in (2**k for k in range(10, 31)):
                net_rows.append(
                    dict(
                        collective=coll,
                        num_workers=n,
                        devices_per_node=dpn if coll == "send_recv" else n,
                        size=size,
                        **{f"time_stats.{coll}.median": 0.01 + size / 200e9 * 1e3},
                    )
                )

    def dataset(repo: str, kind: str, files: dict[str, list[dict]], cfg: dict) -> None:
        top = root / "profiling_data" / kind / f"datasets--{repo.replace('/', '--')}"
        snap = top / "snapshots" / SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (top / "refs").mkdir(exist_ok=True)
        (top / "refs" / "main").write_text(SNAPSHOT)
        (snap / "config.json").write_text(json.dumps(cfg))
        for name, rows in files.items():
            with lzma.open(snap / f"{name}.csv.xz", "wt", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)

    dataset(
        DATASET_COMPUTE,
        "compute",
        {"mlp": mlp_rows, "attention": attn_rows},
        {"model": "meta-llama/Llama-3-8B", "device_sku": "h100", "synthetic": "roofline"},
    )
    dataset(
        DATASET_NETWORK,
        "network",
        {
            "all_reduce": [r for r in net_rows if r["collective"] == "all_reduce"],
            "send_recv": [r for r in net_rows if r["collective"] == "send_recv"],
        },
        {"sku": "h100_dgx", "synthetic": "roofline"},
    )


# ------------------------------------------------------------------------ Vidur


def check_vidur(python: str) -> str:
    if not python or not Path(python).exists():
        raise VidurUnavailable(
            f"no Vidur python at {python!r}; create one with:\n"
            "  python3 -m venv /tmp/vidur-venv && /tmp/vidur-venv/bin/pip install vidur==0.0.26"
        )
    p = subprocess.run(
        [python, "-c", "import importlib.metadata as m, vidur.main; print(m.version('vidur'))"],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise VidurUnavailable(
            f"`import vidur.main` fails in {python}:\n{p.stderr.strip()[-2000:]}"
        )
    return p.stdout.strip()


def vidur_args(trace_csv: Path, date: str, out_dir: Path, cache_dir: Path, args) -> list[str]:
    pred = "random_forrest_execution_time_predictor_config"
    a = [
        "--replica_config_model_name",
        "meta-llama/Llama-3-8B",
        "--replica_config_device",
        "h100",
        "--replica_config_network_device",
        "h100_dgx",
        "--replica_config_tensor_parallel_size",
        "1",
        "--replica_config_num_pipeline_stages",
        "1",
        "--cluster_config_num_replicas",
        "1",
        "--request_generator_config_type",
        "trace_replay",
        "--trace_request_generator_config_trace_file",
        str(trace_csv),
        "--trace_request_generator_config_date",
        date,
        "--trace_request_generator_config_prefill_scale_factor",
        "1",
        "--trace_request_generator_config_decode_scale_factor",
        "1",
        "--trace_request_generator_config_time_scale_factor",
        "1",
        "--trace_request_generator_config_max_tokens",
        str(args.max_tokens),
        "--replica_scheduler_config_type",
        args.vidur_scheduler,
        "--cache_config_block_size",
        str(args.block_size),
        "--execution_time_predictor_config_type",
        "random_forrest",
        f"--{pred}_model_profiling_dataset",
        args.profiling_dataset or DATASET_COMPUTE,
        f"--{pred}_network_profiling_dataset",
        args.network_dataset or DATASET_NETWORK,
        f"--{pred}_cache_dir",
        str(cache_dir),
        f"--{pred}_prediction_max_batch_size",
        str(args.max_num_seqs),
        f"--{pred}_prediction_max_prefill_chunk_size",
        str(args.max_batched_tokens),
        f"--{pred}_prediction_max_tokens_per_request",
        str(args.max_tokens),
        f"--{pred}_num_training_job_threads",
        "1",
    ]
    if not args.full_grid:  # one random-forest setting, 2-fold CV, instead of a 27-setting grid
        a += [
            f"--{pred}_num_estimators",
            "250",
            f"--{pred}_max_depth",
            "16",
            f"--{pred}_min_samples_split",
            "2",
            f"--{pred}_k_fold_cv_splits",
            "2",
        ]
    a += [
        "--metrics_config_output_dir",
        str(out_dir),
        "--no-metrics_config_store_plots",
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_write_json_trace",
        "--no-metrics_config_save_table_to_wandb",
        "--metrics_config_wandb_project",
        "",
        "--metrics_config_wandb_group",
        "",
        "--metrics_config_store_request_metrics",
    ]
    if args.vidur_scheduler == "sarathi":
        a += [
            "--sarathi_scheduler_config_batch_size_cap",
            str(args.max_num_seqs),
            "--sarathi_scheduler_config_chunk_size",
            str(args.max_batched_tokens),
        ]
    elif args.vidur_scheduler == "vllm":
        a += [
            "--vllm_scheduler_config_batch_size_cap",
            str(args.max_num_seqs),
            "--vllm_scheduler_config_max_tokens_in_batch",
            str(args.max_batched_tokens),
        ]
    return a


def run_vidur(python: str, argv: list[str], out_dir: Path, log: Path) -> tuple[float, Path]:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(
            [python, "-m", "vidur.main", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=out_dir,
        )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise VidurUnavailable(f"Vidur exited {p.returncode}; last lines of {log}:\n{tail}")
    found = sorted(out_dir.rglob("request_metrics.csv"), key=lambda q: q.stat().st_mtime)
    if not found:
        raise VidurUnavailable(f"Vidur wrote no request_metrics.csv under {out_dir}")
    return wall, found[-1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats(name: str, xs: list[float]) -> dict:
    return {f"{name}_mean": sum(xs) / len(xs) if xs else float("nan"), f"{name}_p99": pct(xs, 0.99)}


def vidur_latencies(path: Path) -> dict:
    """TTFT = prefill_e2e_time, TPOT = decode_time_execution_plus_preemption_normalized,
    E2E = request_e2e_time (Vidur's seconds, reported here in ms)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))

    def col(c):
        return [1e3 * float(r[c]) for r in rows if r.get(c) not in (None, "")]

    out = {"completed": len(rows)}
    out.update(stats("ttft", col("prefill_e2e_time")))
    out.update(stats("tpot", col("decode_time_execution_plus_preemption_normalized")))
    out.update(stats("e2e", col("request_e2e_time")))
    return out


# -------------------------------------------------------------------------- ours


def run_ours(trace_path: Path, args) -> dict:
    from deepinfer.config import EngineConfig
    from sim import load_trace, simulate

    trace = load_trace(trace_path)
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        block_size=args.block_size,
    )
    t0 = time.perf_counter()
    result = simulate(trace, model=args.model, hardware=args.hardware, engine=engine)
    wall = time.perf_counter() - t0
    done = [r for r in result.requests if r.first_token is not None and r.finish is not None]
    ttft = [1e3 * (r.first_token - r.arrival) for r in done]
    tpot = [
        1e3 * (r.finish - r.first_token) / (r.num_output_tokens - 1)
        for r in done
        if r.num_output_tokens > 1
    ]
    e2e = [1e3 * (r.finish - r.arrival) for r in done]
    out = {
        "wall": wall,
        "requests": len(trace),
        "completed": len(done),
        "steps": result.meta.get("num_steps"),
    }
    out.update(stats("ttft", ttft))
    out.update(stats("tpot", tpot))
    out.update(stats("e2e", e2e))
    return out


# -------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vidur-python", required=True, help="python of a venv with `vidur` installed")
    p.add_argument(
        "--trace",
        type=Path,
        default=ROOT.parent / "shared" / "traces" / "azure2023_code.csv",
        help="Azure 2023 LLM inference CSV",
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vidur_compare"))
    p.add_argument("--cpu", type=int, default=None, help="pin both simulators to this CPU")
    p.add_argument("--vidur-scheduler", default="sarathi", choices=["sarathi", "vllm"])
    p.add_argument(
        "--profiling-dataset",
        default=None,
        help="HF dataset id of a real Vidur compute profile already in the HF cache "
        "under WORKDIR/cache (default: write a synthetic roofline profile)",
    )
    p.add_argument("--network-dataset", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8192, help="Vidur's per-request token cap")
    p.add_argument("--model", default="moonlight-16b-a3b", help="our model preset")
    p.add_argument("--hardware", default="h200", help="our hardware preset")
    p.add_argument(
        "--full-grid",
        action="store_true",
        help="Vidur's default random-forest grid search (27 settings, 10-fold; ~2 min per "
        "operator on one core) instead of one setting, 2-fold",
    )
    p.add_argument("--skip-cold", action="store_true", help="reuse cached Vidur predictors")
    args = p.parse_args()

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        version = check_vidur(args.vidur_python)
    except VidurUnavailable as e:
        print(f"vidur_compare: Vidur is not available: {e}", file=sys.stderr)
        return 2

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    date = "2023-11-16"
    trace_csv = work / "trace_vidur.csv"
    n = convert_trace(args.trace, trace_csv, date)
    cache = work / "cache"
    if args.profiling_dataset is None and not args.skip_cold:
        shutil.rmtree(cache, ignore_errors=True)
        synth_profile(cache, args.block_size)

    runs = {}
    try:
        for label in ["warm"] if args.skip_cold else ["cold", "warm"]:
            out = work / f"out_{label}"
            shutil.rmtree(out, ignore_errors=True)
            wall, metrics = run_vidur(
                args.vidur_python,
                vidur_args(trace_csv, date, out, cache, args),
                out,
                work / f"vidur_{label}.log",
            )
            runs[label] = dict(wall=wall, **vidur_latencies(metrics), metrics=str(metrics))
    except VidurUnavailable as e:
        print(f"vidur_compare: Vidur failed: {e}", file=sys.stderr)
        return 3

    ours = run_ours(args.trace, args)
    v = runs["warm"]
    print(
        f"trace {args.trace.name}: {n} requests; vidur {version} ({args.vidur_scheduler}, "
        f"Llama-3-8B/H100, {'synthetic roofline' if not args.profiling_dataset else args.profiling_dataset} "
        f"profile); ours {args.model}/{args.hardware}; cpu pin {args.cpu}"
    )
    print(
        f"{'simulator':22} {'done':>6} {'wall s':>8} {'ms/req':>8} "
        f"{'TTFT mean':>10} {'TTFT p99':>10} {'TPOT mean':>10} {'TPOT p99':>9} {'E2E mean':>10} {'E2E p99':>10}"
    )

    def line(name, r):
        print(
            f"{name:22} {r['completed']:6d} {r['wall']:8.2f} {1e3 * r['wall'] / n:8.3f} "
            f"{r['ttft_mean']:10.1f} {r['ttft_p99']:10.1f} {r['tpot_mean']:10.2f} {r['tpot_p99']:9.2f} "
            f"{r['e2e_mean']:10.1f} {r['e2e_p99']:10.1f}"
        )

    line("deepinfer sim", ours)
    for label, r in runs.items():
        line(f"vidur ({label})", r)
    print(
        f"speed ratio, vidur warm / ours: {v['wall'] / ours['wall']:.2f}x"
        + (
            f"; vidur cold / ours: {runs['cold']['wall'] / ours['wall']:.2f}x"
            if "cold" in runs
            else ""
        )
    )
    print(
        "latencies in ms; models and GPUs differ, so compare them as policy-level indications only"
    )
    (work / "result.json").write_text(
        json.dumps(
            {
                "vidur_version": version,
                "ours": ours,
                "vidur": runs,
                "args": {k: str(x) for k, x in vars(args).items()},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

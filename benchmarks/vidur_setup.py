"""Vidur's side of benchmarks/vidur_compare.py: its trace, an offline profile, its flags.

Vidur 0.0.26 replays Splitwise-style CSVs and takes its execution-time profiles from
Hugging Face datasets, which this machine cannot reach; `synth_profile` writes a
roofline profile of Llama-3-8B on one H100 in that dataset layout, so Vidur trains its
random-forest predictors offline. Its scheduler and event loop are real; its latencies
come from that made-up profile.
"""

from __future__ import annotations

import csv
import json
import lzma
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

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


def vidur_args(trace_csv: Path, date: str, out_dir: Path, cache_dir: Path, args: Any) -> list[str]:
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

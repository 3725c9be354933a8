"""All-to-all time against message size over N GPUs of one host (NCCL), beside the link
figures the simulator prices expert parallelism with (sim/data/hardware.json).

    python benchmarks/investigations/all_to_all.py [--ranks 2,4,8] [--hidden 2048] [--json OUT.json]

For each N and each number of rows R a rank sends (its tokens x top_k), every rank sends
R / N rows of `hidden` bf16 to every rank (itself included) with all_to_all_single, as
the MoE dispatch does; the median of 20 calls (CUDA events) after 5 warm-ups. Reported:
seconds, the bytes leaving a rank ((N - 1) / N x R x hidden x 2) and those bytes over
the seconds; then a least-squares fit time = latency + bytes / bandwidth per N, the two
figures nvlink_bandwidth and all_to_all_latency_s stand for in hardware.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executors.distributed.process_group import free_port, init_group, leave_group

ROWS = [64, 256, 1024, 4096, 16384, 65536]


def _rank(rank: int, world: int, init: str, hidden: int, out: str) -> None:
    dev = torch.device("cuda", rank)
    init_group(rank, world, dev, init)
    results = []
    for rows in ROWS:
        rows -= rows % world
        x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        times = []
        for i in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            dist.all_to_all_single(y, x)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) / 1e3)
        t = torch.tensor([statistics.median(times)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank ends the exchange
        crossing = rows * (world - 1) / world * hidden * 2
        results.append({"rows": rows, "seconds": t.item(), "bytes_out": crossing,
                        "bytes_per_s": crossing / t.item()})  # fmt: skip
    if rank == 0:
        s = np.array([r["seconds"] for r in results])
        b = np.array([r["bytes_out"] for r in results])
        slope, latency = np.polyfit(b, s, 1)
        fit = {"latency_s": float(latency), "bandwidth_bytes_per_s": float(1.0 / slope)}
        Path(out).write_text(json.dumps({"ranks": world, "hidden": hidden, "sizes": results,
                                         "fit": fit}, indent=2))  # fmt: skip
        print(
            f"{world} ranks: latency {latency * 1e6:.1f} us, {1 / slope / 1e9:.0f} GB/s out of a rank"
        )
        for r in results:
            print(
                f"  {r['rows']:>6} rows  {r['seconds'] * 1e6:9.1f} us  {r['bytes_per_s'] / 1e9:7.1f} GB/s"
            )
    leave_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--hidden", type=int, default=2048)  # Moonlight-16B-A3B
    ap.add_argument("--json", default="all_to_all.json")
    args = ap.parse_args()
    from sim.hardware import get_hardware

    h200 = get_hardware("h200")
    report = {"simulator_h200": {"nvlink_bandwidth": h200.nvlink_bandwidth,
                                 "all_to_all_latency_s": h200.all_to_all_latency_s}, "runs": []}  # fmt: skip
    for world in (int(n) for n in args.ranks.split(",")):
        if torch.cuda.device_count() < world:
            print(f"{world} ranks: skipped, {torch.cuda.device_count()} GPUs visible")
            continue
        tmp = Path(args.json).with_suffix(f".{world}.json")
        init = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_rank, args=(world, init, args.hidden, str(tmp)), nprocs=world, join=True)
        report["runs"].append(json.loads(tmp.read_text()))
        tmp.unlink()
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

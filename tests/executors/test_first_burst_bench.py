"""benchmarks/first_burst.py times whole bursts on one engine: each later burst has the
same sizes as the first and new token ids (no prefix-cache hit makes it cheaper), and every
request of every burst finishes (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer.entrypoints.cli import main
from executors.demo import DEMO_MODEL_DIR


def _bench():  # type: ignore[no-untyped-def]
    from benchmarks import first_burst

    return first_burst


def test_later_bursts_have_the_first_ones_sizes_and_new_ids() -> None:
    bench = _bench()
    first = bench.burst_requests(12, 300, 9, 8192, seed=0)
    again = bench.burst_requests(12, 300, 9, 8192, seed=1)
    assert [(len(p), n) for p, n in first] == [(len(p), n) for p, n in again]
    assert all(len(p) <= 300 and 1 <= n <= 9 for p, n in first)
    assert all(p != q for (p, _), (q, _) in zip(first, again))


def test_the_benchmark_runs_every_burst_to_the_end(tmp_path: Path) -> None:
    out = tmp_path / "first.json"
    argv = [
        "bench", "first-burst", "--model", str(DEMO_MODEL_DIR / "config.json"),
        "--num-prompts", "6", "--bursts", "2", "--max-prompt", "96", "--max-output", "4",
        "--block-size", "16", "--num-gpu-blocks", "256", "--max-num-batched-tokens", "256",
        "--max-num-seqs", "8", "--json", str(out),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert len(doc["bursts"]) == 2 and doc["first_over_later"] > 0
    assert all(b["steps"] > 0 and b["seconds"] > 0 for b in doc["bursts"])
    assert doc["bursts"][0]["steps"] == doc["bursts"][1]["steps"]  # the same work twice

"""benchmarks/host_overhead.py times real host work: every timed step is a decode step of
the whole batch whose inputs are prepared for a decode graph (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import host_overhead as bench
from deepinfer.entrypoints.cli import main


def test_decode_steps_of_the_whole_batch_prepare_graph_inputs(tmp_path: Path) -> None:
    cfg, runner, blocks = bench.build(32, 4)
    loads = []
    graphs = runner.graphs
    load = graphs._load
    graphs._load = lambda ids, pos, tables: loads.append(len(tables)) or load(ids, pos, tables)
    rows = [bench.measure(b, 4, cfg, runner, blocks) for b in (2, 32)]
    assert loads.count(2) >= 4 and loads.count(32) >= 4  # every timed step, graph inputs
    assert all(r["prepare_s"] > 0 and r["schedule_s"] > 0 for r in rows)
    out = tmp_path / "host.json"
    argv = ["bench", "host-overhead", "--batches", "1,8", "--steps", "3", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0  # (sets one torch thread, as it measures: restored after)
    finally:
        torch.set_num_threads(threads)
    mixed = json.loads(out.read_text())["mixed"]  # eager steps' inputs, timed
    assert [m["decodes"] for m in mixed] == [16, 64, 240, 240, 0]
    assert all(m["to_device_s"] > 0 for m in mixed)

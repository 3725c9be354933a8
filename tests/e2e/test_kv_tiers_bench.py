"""benchmarks/kv_tiers.py end to end on the CPU with the shipped demo model, tiny sizes:
the host tier's run and the 1P1D run, each beside the simulator (no timing assertions:
the device run gives the figures)."""

from __future__ import annotations

import json
from pathlib import Path

from sim.traces import Trace, TraceRequest


def _trace(path: Path) -> Path:
    """Two groups sharing a 64-token prefix (four 16-token trace blocks), interleaved so
    that each group's prefix is evicted from a 6-block HBM by the other's before it comes
    back; every prompt ends in a block of its own."""
    lines = [json.dumps({"version": 1, "name": "reuse", "source": "test"})]
    for i in range(8):
        group = [10, 11, 12, 13] if i % 2 == 0 else [20, 21, 22, 23]
        lines.append(json.dumps({
            "id": f"r{i}", "arrival": 0.0, "prompt_len": 72, "output_len": 4,
            "prefix_blocks": [*group, 100 + i], "prefix_block_size": 16,
        }))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shared_prefix_blocks_count_chains_two_requests_share() -> None:
    from benchmarks.kv_tiers import hbm_blocks, shared_prefix_blocks

    def req(i: int, blocks: list[int]) -> TraceRequest:
        return TraceRequest(f"r{i}", 0.0, 40, 2, prefix_blocks=blocks, prefix_block_size=8)

    trace = Trace("t", "test", [req(0, [1, 2, 3]), req(1, [1, 2, 4]), req(2, [5])])
    assert shared_prefix_blocks(trace, 4) == 4  # chains (1,) and (1, 2): 16 tokens
    assert hbm_blocks(trace, 4, 0.5) == 12  # the longest request's 11 blocks, plus one


def test_kv_tiers_bench_runs_the_host_tier_and_1p1d_beside_the_simulator(tmp_path: Path) -> None:
    """Host hits only with the tier, fewer prompt tokens computed with it, the same greedy
    tokens; the 1P1D run hands every request over with its bytes timed; the simulator's
    figures sit beside each."""
    from benchmarks import kv_tiers

    code = kv_tiers.main([
        "--out", str(tmp_path), "--model", "deepinfer-demo", "--device", "cpu",
        "--trace", str(_trace(tmp_path / "reuse.jsonl")), "--num-requests", "8",
        "--max-output", "4", "--prefix-hit", "0", "--num-gpu-blocks", "6", "--block-size", "16",
        "--max-num-seqs", "2", "--max-num-batched-tokens", "256", "--pd-requests", "3",
    ])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "kv_tiers.json").read_text())
    without, with_ = doc["tiers"]["without"], doc["tiers"]["with"]
    assert doc["tiers"]["same_greedy_tokens"] is True
    assert doc["meta"]["engine"]["num_gpu_blocks"] == 6
    assert without["host_hit_blocks"] == 0 and without["copies"] is None
    assert with_["host_hit_blocks"] > 0 and with_["host_bytes_loaded"] > 0
    assert with_["prompt_tokens_computed"] < without["prompt_tokens_computed"]
    assert with_["copies"]["bytes_h2d"] == with_["host_bytes_loaded"]
    copies = with_["copies"]
    assert copies["bytes_d2h"] > 0 and copies["load_s"] > 0 and copies["save_s"] > 0
    assert copies["h2d_gb_s"] > 0 and copies["d2h_gb_s"] > 0
    for row in (without, with_):
        assert row["statuses"] == ["finished"]
        for key in ("ttft_p50_s", "ttft_p99_s", "prompt_tokens_computed", "host_hit_blocks"):
            assert row[key] is not None and row["sim"][key] is not None
    assert without["sim"]["host_hit_blocks"] == 0 and with_["sim"]["host_hit_blocks"] > 0
    real = doc["pd"]["real"]
    assert real["handovers"] == 3 and real["statuses"] == ["finished"]
    assert real["handover_bytes"] == sum(r["bytes"] for r in real["per_request"].values()) > 0
    assert all(r["export_s"] > 0 and r["import_s"] > 0 for r in real["per_request"].values())
    for link, sim in doc["pd"]["sim"].items():
        assert sim["handovers"] == 3, link
        assert sim["handover_s_p50"] > 0 and sim["real_bytes_s_p50"] > 0

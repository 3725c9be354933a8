"""`deepinfer profile` end to end on the CPU: the demo model, the quick grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.entrypoints.cli import main
from sim.profiled_cost_model import load_profile


def test_profile_measures_every_step_kind_and_the_host(tmp_path: Path) -> None:
    """Each point is executed `reps` times after a first run that gives the runner its
    state; a decode point repeats as real decoding does (its context grows by one a
    step), so the runner's own bookkeeping accepts it (it refused the same position
    twice: 'scheduled at 256 computed tokens, but 257 are in the cache')."""
    out = tmp_path / "demo.json"
    # Requests of at most 512 tokens: the quick grid's longest fits, and the host sample's
    # prompts stay as short.
    rc = main([
        "profile", "--model", "deepinfer-demo", "--device", "cpu", "--quick", "--reps", "3",
        "--block-size", "16", "--num-gpu-blocks", "256", "--max-model-len", "512",
        "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    data = load_profile(out)
    kinds = {p["kind"] for p in data["points"]}
    assert kinds == {"decode", "prefill", "mixed", "short_prompts"}
    for p in data["points"]:
        assert p["reps"] == 3 and 0 < p["p10_s"] <= p["median_s"] <= p["p90_s"], p
    assert data["host"] and all(h["num_reqs"] > 0 for h in data["host"])
    # The host is also sampled at the engine's largest batch (max_num_seqs, 256 here),
    # decoding: a wave of 32 short prompts in quick mode, all running together.
    assert any(h["num_reqs"] == 32 and h["num_tokens"] == 32 for h in data["host"])
    meta = json.loads(out.read_text())["meta"]
    assert meta["engine"]["num_gpu_blocks"] == 256
    assert meta["kernel_backend"] == "torch"  # on the CPU, the torch twins


@pytest.mark.parametrize(
    "flag",
    [
        ["--async-scheduling", "false"],
        ["--role", "prefill"],
        ["--policy", "priority"],
        ["--prefill-watermark", "0.5"],
        ["--enable-chunked-prefill", "false"],
    ],
)
def test_engine_options_the_profile_does_not_measure_are_refused(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The profile times every step alone and pipelined, outside any scheduler: a
    scheduling option given to it would be accepted and then change nothing (or, for
    role=prefill, leave its host sample without decode steps)."""
    out = tmp_path / "demo.json"
    assert main(["profile", "--model", "deepinfer-demo", "--out", str(out), *flag]) == 2
    assert capsys.readouterr().err.startswith(f"deepinfer: {flag[0]}: ")
    assert not out.exists()

"""benchmarks/step_roofline.py: a roofline bounds every measured step of the shipped
profiles (a step faster than its roofline would mean the FLOP or byte count is wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.model_config import load_model_config

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "sim" / "data" / "profiles").glob("*__h[12]00.json"))
# Bandwidth and bf16 peak a step is bounded by: the H200's as measured on it, the H100's
# from its datasheet (sim/data/hardware.json).
LIMITS = {"h200": (4.25e12, 751e12), "h100": (3.35e12, 989.4e12)}


@pytest.fixture(scope="module")
def step_roofline():
    from benchmarks import step_roofline

    return step_roofline


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_no_measured_step_beats_its_roofline(step_roofline, path: Path) -> None:
    profile = json.loads(path.read_text())
    spec = load_model_config(profile["model"])
    bw, peak = LIMITS[path.stem.rsplit("__", 1)[1]]
    fractions = [
        step_roofline.step_roofline_s(spec, p["groups"], bw, peak) / p["median_s"]
        for p in profile["points"]
        if not p.get("drafter")
    ]
    assert len(fractions) > 50
    assert min(fractions) > 0.05 and max(fractions) < 1.0


def test_compute_bound_prefill_and_weight_bound_decode(step_roofline) -> None:
    """A long prompt is priced by its FLOPs, a lone decode by the weights it reads."""
    spec = load_model_config("moonlight-16b-a3b")
    bw, peak = 4.25e12, 751e12
    prefill = step_roofline.step_roofline_s(spec, [[1, 16384, 0, True]], bw, peak)
    assert prefill == pytest.approx(2 * 16384 * spec.active_params / peak, rel=0.3)
    decode = step_roofline.step_roofline_s(spec, [[1, 1, 0, False]], bw, peak)
    # Every active weight once, but of the embedding table only the token's row.
    weights = spec.dtype_bytes * (spec.active_params - spec.embed_params)
    assert decode == pytest.approx(weights / bw, rel=0.02)

"""The profiled cost model prices a speculating engine's steps: verify steps and the MTP
drafter after every step, from a profile's verify points, or (saying so) by physics."""

from __future__ import annotations

import copy
import json
import statistics
import warnings
from pathlib import Path

import numpy as np
import pytest

from deepinfer.config import EngineConfig
from deepinfer.entrypoints import cli
from deepinfer.model_config import load_model_config
from sim import simulate
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.hardware import get_hardware
from sim.profiled_cost_model import PROFILES_DIR, ProfiledCostModel, load_profile, shape_output
from sim.profiled_speculation import VerifyPhysics
from sim.traces import TraceRequest
from tests.sim.profile_names import named_model

DEMO_DIR = Path(__file__).resolve().parents[2] / "executors" / "demo" / "deepinfer-demo"
DEMO_PROFILE = PROFILES_DIR / "deepinfer-demo__cpu.json"
# Held-out verify points (a whole batch size left out of the fit, predicted from its
# neighbours): (median, max) relative error. CPU timings on a shared 2-core machine move by
# 30% between rounds of the same point (the demo profile's verify step of 2 drafts at
# batch 4 measured faster than that of 1), so its bounds are loose.
# Regression guards at what was measured, not targets: leaving a batch size out, the H200
# Moonlight profile (2026-12-03) predicted its verify points at median 13%, max 51% (batch
# 64 held out lies between 16 and 256 measured: over-predicted by 30-50%); CPU noise moves
# single points by 2x.
# (median, max) relative error. The H200 profile of 2026-12-04 has verify graphs for
# 2 and 3 tokens a request up to 512 and 341 requests: its 3-token steps at batch 512 ran
# piecewise, slower, so batch 256 held out is interpolated towards them (60% high). Its
# re-measure with random context latents (no longer zeros, so small decode batches route
# to as many experts as served ones and got up to 1.7x slower): median 3.1%, max 68%
# (batch 64 held out, over-predicted by 40-68% from 16 and 256); DeepSeek-V2-Lite's first
# verify points, same day: median 3.9%, max 72% (batch 64 again).
HELD_OUT_TOLERANCE = {"cpu": (0.25, 0.75), "h200": (0.15, 0.75), "h100": (0.15, 0.75)}
WITH_VERIFY_POINTS = sorted(p for p in PROFILES_DIR.glob("*.json") if '"verify"' in p.read_text())
ENGINE = EngineConfig(
    num_gpu_blocks=512, block_size=16, max_num_seqs=64, max_num_batched_tokens=1024
)


@pytest.fixture(scope="module")
def demo():
    return load_model_config(DEMO_DIR)


def _verify(batch: int, k: int, ctx: int = 256):
    return shape_output([[batch, 1 + k, ctx, False, k]])


def test_the_shipped_demo_profile_measures_verify_steps(demo) -> None:
    profile = json.loads(DEMO_PROFILE.read_text())
    assert profile["meta"]["num_speculative_tokens"] == 2
    spec = [p for p in profile["points"] if p.get("drafter")]
    decode_nodes = {
        (p["groups"][0][0], p["groups"][0][2]) for p in spec if p["kind"] == "spec_decode"
    }
    for k in (1, 2):
        nodes = {
            (p["groups"][0][0], p["groups"][0][2])
            for p in spec
            if p["kind"] == "verify" and p["groups"][0][4] == k
        }
        assert nodes == decode_nodes and len(nodes) >= 6
    assert all(0 < p["draft_s"] < p["median_s"] for p in spec)
    assert ProfiledCostModel(DEMO_PROFILE, demo, get_hardware("cpu"), 2).prices_speculation


@pytest.mark.parametrize("path", WITH_VERIFY_POINTS, ids=lambda p: p.stem)
def test_held_out_verify_points_are_predicted_within_tolerance(path: Path) -> None:
    """Leave each inner batch size's speculative points out of the fit in turn; the
    model predicts its verify points (target and drafter) from the rest."""
    model, hardware = named_model(
        path, DEMO_DIR if path.stem.startswith("deepinfer-demo") else None
    )
    profile = load_profile(path)
    spec = [p for p in profile["points"] if p.get("drafter")]
    batches = sorted({p["groups"][0][0] for p in spec if p["kind"] == "verify"})
    errors = []
    for held in batches[1:-1]:
        fit = copy.deepcopy(profile)
        fit["points"] = [
            p for p in profile["points"]
            if not (p.get("drafter") and p["kind"] != "spec_prefill"
                    and p["groups"][0][0] == held)
        ]  # fmt: skip
        cm = ProfiledCostModel(fit, model, hardware, spec[0]["drafter"])
        for p in spec:
            if p["kind"] == "verify" and p["groups"][0][0] == held:
                predicted = cm.step_time(shape_output(p["groups"]))
                errors.append(abs(predicted - p["median_s"]) / p["median_s"])
    median_tol, max_tol = HELD_OUT_TOLERANCE[hardware.name]
    assert len(errors) >= 4
    assert statistics.median(errors) <= median_tol, errors
    assert max(errors) <= max_tol, errors


GPU_VERIFY_PROFILES = [p for p in WITH_VERIFY_POINTS if not p.stem.endswith("__cpu")]


@pytest.mark.parametrize("path", GPU_VERIFY_PROFILES, ids=lambda p: p.stem)
def test_verify_steps_past_the_grids_longest_context_follow_the_verify_physics(
    path: Path,
) -> None:
    """The verify points at the grid's longest context, left out of the fit, are priced
    from the shorter contexts by the verify physics (a verify step's attention over its
    context grows faster than a decode step's): median |error| <= 4.5%, none over 10%
    (a grid that reaches 64k extrapolates four times as far as the 7k grids, on which
    the plain fit's physics scaled them at median 4% and up to 18% short; the maximum
    is what separates the two there)."""
    model, hardware = named_model(path)
    profile = load_profile(path)
    longest = max(p["groups"][0][2] for p in profile["points"] if p["kind"] == "verify")
    held = [p for p in profile["points"] if p["kind"] == "verify" and p["groups"][0][2] == longest]
    fit = copy.deepcopy(profile)
    fit["points"] = [p for p in profile["points"] if p not in held]
    cm = ProfiledCostModel(fit, model, hardware, 3)
    assert cm._spec.verify_physics.ready
    errors = [
        abs(cm.step_time(shape_output(p["groups"])) - p["median_s"]) / p["median_s"]
        for p in held
    ]  # fmt: skip
    assert len(errors) >= 6
    assert statistics.median(errors) <= 0.045, errors
    assert max(errors) <= 0.10, errors


def test_the_verify_physics_reads_a_requests_context_once_for_all_its_query_rows(demo) -> None:
    """kv_read counts each request's context once whatever its drafts; pairs (the
    attention's FLOPs) counts it once a query row; longest_piece is the longest context
    (on a CPU: its attention splits no context)."""
    cm = ProfiledCostModel(DEMO_PROFILE, demo, get_hardware("cpu"), 2)
    physics = cm._spec.verify_physics
    names = physics.FEATURES
    one = dict(zip(names, physics.features(_verify(4, 1, ctx=300))))
    three = dict(zip(names, physics.features(_verify(4, 3, ctx=300))))
    assert one["kv_read"] == three["kv_read"] == 4 * 300
    assert (one["pairs"], three["pairs"]) == (4 * 2 * 300, 4 * 4 * 300)
    assert (one["tokens"], three["tokens"]) == (8, 16)
    assert one["longest_piece"] == 300 and one["reqs"] == 4


def test_a_verify_step_waits_for_its_longest_piece_of_split_kv() -> None:
    """The decode kernel's verify launch runs a program a request (16 heads, up to 4
    query rows) and cuts each context into as many pieces as fill one wave of SMs, at
    most 64: a batch of 1 or 2 waits for 1/64 of its longest context, a batch of 4 for
    1/33, of 132 and more for all of it. Prompt chunks beside it take no part."""
    spec = load_model_config("deepseek-v2-lite")
    analytic = AnalyticCostModel(spec, get_hardware("h100"), load_cost_coefficients())
    physics = VerifyPhysics([], np.zeros(0), analytic, num_heads=16, num_sms=132)
    piece = physics.FEATURES.index("longest_piece")
    ctx = 66_000
    for batch, pieces in ((1, 64), (2, 64), (4, 33), (16, 8), (132, 1), (256, 1)):
        assert physics.features(_verify(batch, 3, ctx=ctx))[piece] == ctx / pieces
    wide = VerifyPhysics([], np.zeros(0), analytic, num_heads=128, num_sms=132)
    assert wide.splits(1) == 64 and wide.splits(4) == 16  # two programs a row: 128 heads


def test_more_drafts_never_cost_less_and_the_drafter_is_paid_every_step(demo) -> None:
    hw = get_hardware("cpu")
    plain = ProfiledCostModel(DEMO_PROFILE, demo, hw)
    spec = ProfiledCostModel(DEMO_PROFILE, demo, hw, 2)
    for batch in (1, 3, 8):
        decode = _verify(batch, 0)
        assert spec.step_time(decode) > plain.step_time(decode)  # the drafter after it
        times = [spec.step_time(_verify(batch, k)) for k in (0, 1, 2)]
        assert times == sorted(times)
        # Varlen: requests verifying different numbers of drafts fall in between.
        mixed = shape_output([[batch, 2, 256, False, 1], [batch, 3, 256, False, 2]])
        assert times[1] <= spec.step_time(mixed) <= spec.step_time(_verify(2 * batch, 2))
    # A prompt chunk of a speculating engine pays for the drafter's pass over it, and
    # beside it decodes verifying drafts cost more than plain decodes.
    chunk = shape_output([[1, 512, 0, True]])
    assert spec.step_time(chunk) > plain.step_time(chunk)
    mixed_decode = shape_output([[4, 1, 256, False], [1, 256, 0, True]])
    mixed_verify = shape_output([[4, 3, 256, False, 2], [1, 256, 0, True]])
    assert plain.step_time(mixed_decode) < spec.step_time(mixed_decode)
    assert spec.step_time(mixed_decode) < spec.step_time(mixed_verify)
    more = ProfiledCostModel(DEMO_PROFILE, demo, hw, 3)
    with pytest.warns(UserWarning, match="beyond the profile's verify points"):
        assert more.step_time(_verify(4, 3)) >= more.step_time(_verify(4, 2))


def _steps_by_batch(steps, verify: bool) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for s in steps:
        if s.num_prompt_tokens or not s.num_scheduled_reqs:
            continue
        if (s.num_batched_tokens > s.num_scheduled_reqs) == verify:
            out.setdefault(s.num_scheduled_reqs, []).append(s.duration)
    return out


def test_a_speculating_simulation_prices_verify_steps_above_plain_decode(demo) -> None:
    reqs = [TraceRequest(f"r{i}", 0.0, 200, 40) for i in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the profile has verify points: nothing to say
        spec = simulate(reqs, demo, "cpu", ENGINE.replace(num_speculative_tokens=2))
    plain = simulate(reqs, demo, "cpu", ENGINE)
    assert spec.meta["cost_model"] == "profiled" and spec.meta["verify_steps"] == "profiled"
    verify = _steps_by_batch(spec.steps, verify=True)
    decode = _steps_by_batch(plain.steps, verify=False)
    shared = set(verify) & set(decode)
    assert shared
    for batch in shared:
        assert min(verify[batch]) > max(decode[batch]), batch


def test_a_profile_without_verify_points_warns_and_falls_back_to_physics(
    demo, tmp_path: Path
) -> None:
    profile = json.loads(DEMO_PROFILE.read_text())
    profile["points"] = [p for p in profile["points"] if not p.get("drafter")]
    path = tmp_path / "plain__cpu.json"
    path.write_text(json.dumps(profile))
    hw = get_hardware("cpu")
    with pytest.warns(UserWarning, match="no verify points") as caught:
        cm = ProfiledCostModel(path, demo, hw, 2)
    message = str(caught[0].message)
    assert "plain__cpu.json" in message and "--num-speculative-tokens 2" in message
    assert not cm.prices_speculation
    plain = ProfiledCostModel(path, demo, hw)
    analytic = AnalyticCostModel(demo, hw, load_cost_coefficients())
    for batch in (1, 4, 16):
        decode, verify = _verify(batch, 0), _verify(batch, 2)
        drafter = analytic.drafter_seconds(verify, 2)
        assert cm.step_time(decode) == pytest.approx(
            plain.step_time(decode) + analytic.drafter_seconds(decode, 2)
        )
        assert cm.step_time(verify) > cm.step_time(decode)
        assert cm.step_time(verify) >= plain.step_time(decode) + drafter
    reqs = [TraceRequest(f"r{i}", 0.0, 200, 20) for i in range(4)]
    with pytest.warns(UserWarning, match="no verify points"):
        res = simulate(reqs, demo, "cpu", ENGINE.replace(num_speculative_tokens=2), profile=path)
    assert res.meta["verify_steps"] == "analytic"


def test_the_cli_says_when_verify_steps_are_uncalibrated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = json.loads(DEMO_PROFILE.read_text())
    profile["points"] = [p for p in profile["points"] if not p.get("drafter")]
    plain = tmp_path / "plain__cpu.json"
    plain.write_text(json.dumps(profile))
    trace = DEMO_DIR.parents[2] / "traces" / "example.jsonl"
    args = ["simulate", str(trace), "--model", str(DEMO_DIR), "--hardware", "cpu",
            "--num-gpu-blocks", "512", "--block-size", "16", "--num-speculative-tokens", "2",
            "--no-progress", "--out", str(tmp_path / "r.json")]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main([*args, "--profile", str(plain)]) == 0
        assert "verify steps and the drafter: uncalibrated" in capsys.readouterr().out
        assert cli.main(args) == 0
        out = capsys.readouterr().out
    assert "calibrated on deepinfer-demo__cpu.json" in out and "uncalibrated" not in out


def test_a_graphed_profile_prices_each_number_of_drafts_as_measured() -> None:
    """The H200 engine captures verify graphs for every 1 + k tokens a request, so at
    batch 1 more drafts cost more (before, only 1 + K had graphs and 2 drafts, eager,
    cost more than 3); the model prices k = 1..3 within 10% of the measured steps.
    (Measured over the profile's three contexts: one point alone is within the noise of
    the next k's, a few percent apart.)"""
    spec = load_model_config("moonlight-16b-a3b")
    path = PROFILES_DIR / "moonlight-16b-a3b__h200.json"
    points = {
        (p["groups"][0][4], p["groups"][0][2]): p["median_s"]
        for p in load_profile(path)["points"]
        if p["kind"] == "verify" and p["num_reqs"] == 1
    }
    contexts = sorted({c for _, c in points})
    measured = {k: sum(points[k, c] for c in contexts) / len(contexts) for k in (1, 2, 3)}
    assert measured[1] < measured[2] < measured[3]
    model = ProfiledCostModel(path, spec, get_hardware("h200"), 3)
    for c in contexts:  # the model orders k as the means do
        prices = [model.step_time(shape_output([[1, 1 + k, c, False, k]])) for k in (1, 2, 3)]
        assert prices == sorted(prices), (c, prices)
    for k, c in points:
        predicted = model.step_time(shape_output([[1, 1 + k, c, False, k]]))
        measured_k = points[k, c]
        assert abs(predicted - measured_k) < 0.1 * measured_k, (k, c, predicted, measured_k)


def test_decodes_verifying_beside_a_prompt_chunk_pay_the_verify_attention() -> None:
    """A step with a prompt chunk runs eagerly and its decodes verifying drafts take the
    decode kernel's verify launch, which reads long contexts slower than a decode step
    (fewer pieces a request): their attention is the verify physics', not the plain
    fit's decode terms. So 30 requests verifying at 80k tokens add to an 8k chunk about
    what their attention costs in a verify step of their own."""
    spec = load_model_config("deepseek-v2-lite").replace(num_nextn_predict_layers=1)
    cm = ProfiledCostModel(PROFILES_DIR / "deepseek-v2-lite__h100.json", spec,
                           get_hardware("h100"), 3)  # fmt: skip
    verify = [[30, 4, 80_000, False, 3]]
    chunk = [[1, 8000, 4000, True]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (beyond the grid's verify contexts)
        both = cm.step_time(shape_output(verify + chunk))
        alone = cm.step_time(shape_output(chunk))
        attention = cm._spec.verify_physics.attention_time(shape_output(verify))
    assert both - alone > 0.8 * attention > 0


def test_on_a_host_cpu_decodes_beside_a_prompt_chunk_keep_the_plain_fit(demo) -> None:
    """The CPU's reference attention has no verify launch: a speculating step with a
    prompt chunk is priced by the plain fit's physics and the drafter, as before the
    verify launch's correction existed."""
    cm = ProfiledCostModel(DEMO_PROFILE, demo, get_hardware("cpu"), 2)
    assert cm._spec.ready and cm._spec.verify_physics.ready
    out = shape_output([[4, 3, 300, False, 2], [1, 64, 100, True]])
    step = cm._measure(out, 0)
    want = cm._physics_of(step) + cm._spec.drafter_time(out, step.num_drafts)
    assert cm.step_time(out) == want

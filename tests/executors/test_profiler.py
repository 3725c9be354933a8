"""`deepinfer profile`: whole engine steps of the real executor, speculating ones too."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from deepinfer.entrypoints import cli
from deepinfer.model_config import load_model_config, write_config_with_mtp_layer

# Requests of at most 512 tokens: the quick grid's longest fits, and the host sample's
# prompts stay as short.
SMALL_ENGINE = [
    "--device", "cpu", "--quick", "--reps", "1", "--block-size", "16",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "256",
    "--max-model-len", "512",
]  # fmt: skip


def _profile(out: Path, *flags: str) -> Path:
    assert cli.main(["profile", "--model", "deepinfer-demo", *SMALL_ENGINE, *flags,
                     "--out", str(out)]) == 0  # fmt: skip
    return out


# Each profile is measured once for the tests that read it (each test loads its own copy).
@pytest.fixture(scope="module")
def plain_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's quick profile in two rounds over the grid."""
    return _profile(tmp_path_factory.mktemp("plain") / "p.json", "--rounds", "2")


@pytest.fixture(scope="module")
def speculating_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's quick profile with --num-speculative-tokens 2."""
    out = tmp_path_factory.mktemp("speculating") / "p.json"
    return _profile(out, "--num-speculative-tokens", "2")


def test_a_speculating_profile_of_the_demo_model_holds_verify_points(
    speculating_profile: Path,
) -> None:
    """With --num-speculative-tokens 2: verify steps of 1 + k tokens a request for k = 1, 2
    over every (batch, context) of the grid, each followed by the drafter's proposal of 2
    drafts (timed apart); the plain grid runs without the drafter."""
    profile = json.loads(speculating_profile.read_text())
    assert profile["meta"]["num_speculative_tokens"] == 2
    assert profile["meta"]["mtp_layer_added"] is False
    points = profile["points"]
    verify = [p for p in points if p["kind"] == "verify"]
    by_k: dict[int, set[tuple[int, int]]] = {1: set(), 2: set()}
    for p in verify:
        [[count, q, ctx, is_prompt, k]] = p["groups"]
        assert q == 1 + k and not is_prompt
        by_k[k].add((count, ctx))
    assert by_k[1] == by_k[2] and len(by_k[1]) >= 4
    spec = [p for p in points if p.get("drafter")]
    assert {p["kind"] for p in spec} == {"verify", "spec_decode", "spec_prefill"}
    for p in spec:
        assert p["drafter"] == 2 and 0 < p["draft_s"] < p["median_s"], p
        # Verify steps chain under async scheduling; a prompt chunk beside drafts does not.
        assert ("pipelined_s" in p) == (p["kind"] != "spec_prefill"), p
    plain = [p for p in points if p["kind"] in ("decode", "prefill", "mixed", "short_prompts")]
    assert plain and all("drafter" not in p for p in plain)
    assert sum(p["compiled"] for p in points) == 0


def test_pipelined_verify_points_chain_each_step_on_the_one_in_flight() -> None:
    """A verify point's pipelined steps are built as the async scheduler builds them
    (placeholders, every draft assumed accepted): after the first, each takes all its
    input ids from the step in flight and moves its rows back by what that rejected."""
    from deepinfer import LLM
    from executors.profile_grid import StepShape
    from executors.profiler import profile_steps
    from tests.executors.test_spec_chain import count_chained

    llm = LLM("deepinfer-demo", device="cpu", dtype="float32", block_size=16,
              num_gpu_blocks=128, num_speculative_tokens=2)  # fmt: skip
    runner = llm.executor.runner  # type: ignore[attr-defined]
    chained = count_chained(runner)
    shape = StepShape("verify", ((2, 3, 40, False, 2),), drafter=True)
    [point] = profile_steps(llm.executor, [shape], reps=3)
    assert point["pipelined_s"] > 0 and 0 < point["draft_s"] < point["median_s"]
    # 1 + 3 sequential steps, then 3 + 2 pipelined: all but the first chain (2 x 3 ids).
    assert chained[:4] == [0] * 4 and chained[4:] == [0] + [6] * 4, chained


def test_a_stall_in_the_pipelined_run_does_not_carry_into_the_point() -> None:
    """The pipelined time is the median gap between consecutive results: one launch
    stalled by 0.5 s (a collection, another tenant) leaves it near a step, where the
    mean over the 6 steps it used to take carried 0.5 / 6 s into the point."""
    import time

    from deepinfer import LLM
    from executors.profile_grid import StepShape
    from executors.profiler import profile_steps

    llm = LLM("deepinfer-demo", device="cpu", dtype="float32", block_size=16,
              num_gpu_blocks=128)  # fmt: skip
    ex = llm.executor
    launch, calls = ex.execute_async, []

    def stalling(out):  # the third pipelined launch stalls
        calls.append(out)
        if len(calls) == 3:
            time.sleep(0.5)
        return launch(out)

    ex.execute_async = stalling  # type: ignore[method-assign]
    [point] = profile_steps(ex, [StepShape("decode", ((4, 1, 40, False, 0),))], reps=5)
    assert len(calls) == 7  # the stall landed in the pipelined run
    assert point["pipelined_s"] < point["median_s"] + 0.04, point


def test_a_plain_profile_steps_decodes_forward_as_the_scheduler_does(plain_profile: Path) -> None:
    """Decode requests are timed over several runs, each after the tokens the last gave
    them (the runner refuses a step that repeats computed positions), in rounds."""
    profile = json.loads(plain_profile.read_text())
    assert profile["meta"]["num_speculative_tokens"] == 0
    kinds = {p["kind"] for p in profile["points"]}
    assert kinds == {"decode", "prefill", "mixed", "short_prompts"}
    # Two rounds over the grid, one timed run of each point in each.
    assert all(p["reps"] == 2 and p["p10_s"] <= p["median_s"] for p in profile["points"])
    # Each point also ran pipelined (async scheduling: launched before the step before
    # it is read). How long against one by one is a measurement, not a rule: a loaded
    # machine stretches either (benchmarks judge times, tests do not).
    for p in profile["points"]:
        assert math.isfinite(p["pipelined_s"]) and p["pipelined_s"] > 0, p


def test_async_scheduling_prices_plain_steps_from_the_pipelined_times(
    plain_profile: Path,
) -> None:
    """The profiled model under async scheduling fits the pipelined times (halved here:
    its steps cost half); a profile without them is priced sequentially, with a warning;
    so is every profile of a device that is the host's CPU (no warning: nothing there
    overlaps), which the hardware says (runs_on_host; a copy says it is a GPU here)."""
    from deepinfer.outputs import ScheduledRequest, SchedulerOutput
    from executors.demo import demo_model_path
    from sim.hardware import get_hardware
    from sim.profiled_cost_model import ProfiledCostModel

    profile = json.loads(plain_profile.read_text())
    for p in profile["points"]:
        p["pipelined_s"] = p["median_s"] / 2
    spec, cpu = load_model_config(demo_model_path() / "config.json"), get_hardware("cpu")
    hw = dataclasses.replace(cpu, runs_on_host=False)
    step = SchedulerOutput(0, [ScheduledRequest(str(i), 1, 300, False, True, []) for i in range(4)])
    plain = ProfiledCostModel(profile, spec, hw).step_time(step)
    piped = ProfiledCostModel(profile, spec, hw, async_scheduling=True)
    assert piped.prices_pipelining and piped.pipelined
    assert piped.step_time(step) == pytest.approx(plain / 2, rel=1e-6)
    on_host = ProfiledCostModel(profile, spec, cpu, async_scheduling=True)
    assert not on_host.pipelined
    assert on_host.step_time(step) == pytest.approx(plain, rel=1e-6)
    for p in profile["points"]:
        del p["pipelined_s"]
    with pytest.warns(UserWarning, match="no pipelined step times"):
        old = ProfiledCostModel(profile, spec, hw, async_scheduling=True)
    assert old.step_time(step) == pytest.approx(plain, rel=1e-6)


def test_async_scheduling_prices_verify_steps_from_their_pipelined_times(
    speculating_profile: Path,
) -> None:
    """A speculating engine's steps chain on the step in flight: under async scheduling
    its verify steps are priced from the verify points' pipelined times (less the
    drafter's) and a step with a prompt chunk from the plain fit's, so halved times give
    cheaper steps; a profile whose verify points lack them (measured before they
    chained) is priced sequentially, with a warning."""
    from deepinfer.outputs import ScheduledRequest, SchedulerOutput
    from executors.demo import demo_model_path
    from sim.hardware import get_hardware
    from sim.profiled_cost_model import ProfiledCostModel

    profile = json.loads(speculating_profile.read_text())
    for p in profile["points"]:
        p["pipelined_s"] = p["median_s"] / 2
    spec = load_model_config(demo_model_path() / "config.json")
    hw = dataclasses.replace(get_hardware("cpu"), runs_on_host=False)
    verify = SchedulerOutput(0, [
        ScheduledRequest(str(i), 3, 300, False, True, [], draft_token_ids=[7, 8])
        for i in range(4)
    ])  # fmt: skip
    beside_prompt = SchedulerOutput(0, [
        ScheduledRequest("p", 64, 0, True, True, []),
        ScheduledRequest("v", 3, 300, False, True, [], draft_token_ids=[7, 8]),
    ])  # fmt: skip
    one_by_one = ProfiledCostModel(profile, spec, hw, 2)
    sequential = one_by_one.step_time(verify)
    piped = ProfiledCostModel(profile, spec, hw, 2, async_scheduling=True)
    assert piped.pipelined
    assert piped.step_time(verify) < 0.9 * sequential
    assert piped.step_time(beside_prompt) < 0.9 * one_by_one.step_time(beside_prompt)
    for p in profile["points"]:
        if p["kind"] == "verify":
            del p["pipelined_s"]
    with pytest.warns(UserWarning, match="no pipelined step times"):
        old = ProfiledCostModel(profile, spec, hw, 2, async_scheduling=True)
    assert not old.pipelined
    assert old.step_time(verify) == pytest.approx(sequential, rel=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-speculative-tokens", "2"], "add --add-mtp-layer"),
        (["--add-mtp-layer"], "--add-mtp-layer: only with --num-speculative-tokens"),
        (
            ["--add-mtp-layer", "--num-speculative-tokens", "2", "--load-format", "auto"],
            "needs --load-format dummy",
        ),
    ],
)
def test_speculating_on_a_model_without_an_mtp_layer_needs_one_added(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["profile", "--model", "moonlight-16b-a3b", "--device", "cpu", *flags,
         "--out", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_config_with_an_added_mtp_layer_keeps_the_model_and_its_name(tmp_path: Path) -> None:
    folder = write_config_with_mtp_layer("moonlight-16b-a3b", tmp_path)
    base, added = load_model_config("moonlight-16b-a3b"), load_model_config(folder)
    assert base.num_nextn_predict_layers == 0 and added.num_nextn_predict_layers == 1
    assert added.name == "moonlight-16b-a3b"
    assert added.replace(num_nextn_predict_layers=0) == base


@pytest.mark.gpu
def test_a_speculating_profile_on_the_gpu_replays_graphs_and_times_the_drafter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA the verify steps of K drafts replay the verify graphs, decode steps the
    decode graphs (the drafter reads their hidden states), with the drafter timed."""
    out = tmp_path / "p.json"
    code = cli.main(
        ["profile", "--model", "deepinfer-demo", "--device", "cuda", "--quick", "--reps", "2",
         "--block-size", "16", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
         "--num-gpu-blocks", "256", "--num-speculative-tokens", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    profile = json.loads(out.read_text())
    assert profile["meta"]["cuda_graphs"] and profile["meta"]["verify_graphs"]
    spec = [p for p in profile["points"] if p.get("drafter")]
    assert {p["kind"] for p in spec} == {"verify", "spec_decode", "spec_prefill"}
    assert all(0 < p["draft_s"] < p["median_s"] for p in spec)


def test_profiled_contexts_hold_random_latents_not_a_fresh_cache_s_zeros() -> None:
    """Every block of every layer (MTP layers too) gets N(0, 1) latents, the same for a
    seed: with zeros all requests of a decode point attend alike and route to the same
    experts, so the profile timed MoE steps that read a fraction of the served weights."""
    import torch

    from executors.kv_cache import PagedKVCache
    from executors.profiler import fill_context_kv

    def filled(seed: int) -> PagedKVCache:
        cache = PagedKVCache(2, 8, 4, 16, torch.float32, torch.device("cpu"), True, 1)
        fill_context_kv(cache, seed)
        return cache

    cache = filled(0)
    for layer in [*cache.layers, *cache.mtp_layers]:
        per_block = layer.flatten(1)  # [blocks, entries]
        assert (per_block.std(dim=1) > 0.5).all() and abs(float(layer.mean())) < 0.2
    assert not torch.equal(cache.layers[0], cache.layers[1])
    assert torch.equal(filled(0).layers[1], cache.layers[1])
    assert not torch.equal(filled(1).layers[1], cache.layers[1])


def test_the_grid_times_chunks_after_a_cached_prefix_beside_decodes() -> None:
    """Mixed points include a chunk after a cached prefix (a conversation's next turn
    while others decode), up to the long priors the model's length allows; the profiler
    runs such a step as it runs a lone chunk after a prefix."""
    from deepinfer import LLM
    from executors.profile_grid import GridLimits, StepShape, default_grid
    from executors.profiler import profile_steps

    def prefixed(grid: list[StepShape]) -> set[tuple[int, int, int, int]]:
        return {
            (s.groups[0][0], s.groups[1][1], s.groups[0][2], s.groups[1][2])
            for s in grid
            if s.kind == "mixed" and s.groups[1][2] > 0
        }

    long = prefixed(default_grid(GridLimits(16384, 512, 163840, 1 << 22)))
    assert (16, 2048, 65536, 65536) in long and (64, 512, 4096, 4096) in long
    assert max(p for *_, p in prefixed(default_grid(GridLimits(16384, 512, 8192, 1 << 22)))) == 4096
    llm = LLM("deepinfer-demo", device="cpu", dtype="float32", block_size=16,
              num_gpu_blocks=128)  # fmt: skip
    [point] = profile_steps(
        llm.executor, [StepShape("mixed", ((3, 1, 40, False, 0), (1, 48, 64, True, 0)))], reps=2
    )
    assert point["kind"] == "mixed" and point["median_s"] > 0
    assert [list(g) for g in point["groups"]] == [[3, 1, 40, False], [1, 48, 64, True]]


def test_the_grid_times_lone_chunks_between_the_token_buckets() -> None:
    """The runner pads a lone chunk to its piecewise graph's token bucket, and the cost
    model prices it there: the grid holds lone chunks between buckets (besides those of
    a bucket's size), so the fit and the held-out check see what padding costs."""
    from executors.piecewise_graphs import default_token_buckets
    from executors.profile_grid import GridLimits, default_grid

    buckets = set(default_token_buckets(8192))
    lone = [
        s.groups[0][1]
        for s in default_grid(GridLimits(8192, 512, 32768, 1 << 22))
        if s.kind == "prefill" and s.groups[0][2] == 0
    ]
    assert len([q for q in lone if q not in buckets]) >= 3
    assert len([q for q in lone if q in buckets]) >= 5


@pytest.mark.gpu
def test_a_profile_on_the_gpu_times_each_launch_and_the_devices_own_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA every pipelined point also has its launch's host seconds and the device's
    own seconds (its kernels all queued behind a sleep first), which the pipelined time
    bounds; on the CPU neither (executors/profiler.py, `_device_only`)."""
    out = tmp_path / "p.json"
    code = cli.main(
        ["profile", "--model", "deepinfer-demo", "--device", "cuda", "--quick", "--reps", "2",
         "--block-size", "16", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
         "--num-gpu-blocks", "256", "--out", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    points = [p for p in json.loads(out.read_text())["points"] if "pipelined_s" in p]
    assert points and all(p["launch_s"] > 0 for p in points)
    timed = [p for p in points if p["device_s"] is not None]
    assert len(timed) >= 0.9 * len(points)
    assert all(0 < p["device_s"] <= 1.1 * p["pipelined_s"] for p in timed)

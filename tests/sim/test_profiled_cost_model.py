"""The profiled cost model: fits its profile, follows the physics, says when it guesses."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from sim import simulate
from sim.cost_model import EngineSettings
from sim.hardware import get_hardware
from sim.profile_fit import StepSurface, graph_batch
from sim.profiled_cost_model import FEATURES, PROFILES_DIR, ProfiledCostModel, shape_output
from sim.traces import TraceRequest
from tests.sim.launch_profiles import with_launch_times
from tests.sim.profile_names import named_model

SHIPPED = sorted(PROFILES_DIR.glob("*__h[12]00.json"))


def _model(path):
    return ProfiledCostModel(path, named_model(path)[0], get_hardware("h200"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_reproduces_its_own_profile_points(path) -> None:
    cm = _model(path)
    points = json.loads(path.read_text())["points"]
    for p, err in zip(points, cm.point_errors):
        if p["kind"] == "decode":  # the measured grid itself, made monotone: a point
            # that noise put above its longer-context neighbour (Moonlight 2026-12-05:
            # batch 512 at context 256, 6% above 512) is split with it
            assert abs(err) < 0.035, (p["groups"], err)
    assert cm.fit.median_abs_err < 0.1


def _nondecreasing(xs: list[float]) -> bool:
    """Each at least the one before, up to rounding (a flat stretch's last bits differ)."""
    return all(b >= a * (1 - 1e-12) for a, b in zip(xs, xs[1:]))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_monotone_in_tokens_context_and_batch(path) -> None:
    cm = _model(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sweeps go past the profile on purpose
        for ctx in (0, 1000, 5000):
            times = [cm.step_time(shape_output([[1, n, ctx, True]])) for n in range(16, 20000, 97)]
            assert _nondecreasing(times)
        for batch in (1, 7, 60, 300):
            times = [
                cm.step_time(shape_output([[batch, 1, c, False]])) for c in range(1, 20000, 211)
            ]
            assert _nondecreasing(times)
        for ctx in (10, 900, 6000):
            times = [cm.step_time(shape_output([[b, 1, ctx, False]])) for b in range(1, 1100, 13)]
            assert _nondecreasing(times)
        mixed = [
            cm.step_time(shape_output([[d, 1, 800, False], [1, 300, 0, True]]))
            for d in range(1, 400, 9)
        ]
        assert _nondecreasing(mixed)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_decode_step_waits_for_its_longest_request_past_the_grid_too(path) -> None:
    """While the batch fits one wave of split-KV programs, every context is cut into the
    same pieces and a decode step waits for the longest request's: one request past the
    grid's longest context beside short ones costs the uniform batch at their mean
    context and its pieces' keys past the mean at a lone piece's rate, more the longer
    it is, never as if every request held its context (DeepSeek-V2-Lite on the Mooncake
    trace, H100: 32 requests, one at 87k, took 34 ms; a uniform batch at 87k, 40 ms)."""
    from sim.profile_fit import one_wave_decode

    cm = _model(path)
    top = int(cm._decode.contexts[-1])
    heads = load_model_config(path.name.split("__")[0]).num_attention_heads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (8, 36, 120):
            times = []
            for c in (top, top * 4 // 3, top * 2):
                mean = ((batch - 1) * 2000 + c) / batch
                surface, pieces = one_wave_decode(batch, 256, heads, 132)
                at_mean = cm._decode.predict_at(surface, mean)
                alone = cm._piece_key_s * (c - mean) / pieces
                step = shape_output([[batch - 1, 1, 2000, False], [1, 1, c, False]])
                times.append(cm.step_time(step))
                uniform = cm.step_time(shape_output([[batch, 1, c, False]]))
                assert times[-1] == pytest.approx(min(at_mean + alone, uniform), rel=1e-12)
                assert at_mean < times[-1] <= uniform
            assert _nondecreasing(times)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_one_long_request_costs_between_the_short_batch_and_the_long_one(path) -> None:
    """A decode step with one long request among short ones waits for the long one's
    pieces: it costs more than the batch with every request short, and never more than
    the batch with every request as long (each of whose pieces is as long as its), on
    every one-wave batch and at contexts in and past the grid."""
    cm = _model(path)
    top = int(cm._decode.contexts[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (2, 3, 8, 17, 36, 64, 120, 200):
            short = cm.step_time(shape_output([[batch, 1, 300, False]]))
            for c in (top // 4, top // 2, top, top * 2):
                one = cm.step_time(shape_output([[batch - 1, 1, 300, False], [1, 1, c, False]]))
                uniform = cm.step_time(shape_output([[batch, 1, c, False]]))
                assert short < one <= uniform, (batch, c)


def test_warns_once_when_a_step_is_beyond_the_profile() -> None:
    cm = _model(PROFILES_DIR / "moonlight-16b-a3b__h200.json")
    with pytest.warns(UserWarning, match="extrapolates beyond the profile"):
        cm.step_time(shape_output([[2000, 1, 100, False]]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.step_time(shape_output([[3000, 1, 100, False]]))  # the same key: said once
        cm.step_time(shape_output([[8, 1, 100, False]]))


def test_simulate_uses_the_profile_where_one_is_shipped_and_says_so_elsewhere() -> None:
    reqs = [TraceRequest(f"r{i}", 0.1 * i, 200, 20) for i in range(8)]
    cfg = EngineConfig(num_gpu_blocks=400)
    profiled = simulate(reqs, engine=cfg)
    assert profiled.meta["cost_model"] == "profiled" and profiled.meta["calibrated"]
    assert profiled.meta["profile"].endswith("moonlight-16b-a3b__h200.json")
    other = simulate(reqs, hardware="b200", engine=cfg)
    assert other.meta["cost_model"] == "analytic" and not other.meta["calibrated"]
    with pytest.raises(ValueError, match="no profile of 'moonlight-16b-a3b' on 'b200'"):
        simulate(reqs, hardware="b200", engine=cfg, cost_model="profiled")
    h100 = simulate(reqs, hardware="h100", engine=cfg)
    assert h100.meta["profile"].endswith("moonlight-16b-a3b__h100.json")


def test_host_time_grows_with_the_requests_of_a_step() -> None:
    cm = _model(PROFILES_DIR / "moonlight-16b-a3b__h200.json")
    small = cm.cpu_time(shape_output([[4, 1, 100, False]]))
    big = cm.cpu_time(shape_output([[256, 1, 100, False]]))
    assert 0 < small < big < 0.02


def test_a_ragged_decode_batch_waits_for_its_longest_pieces_on_a_gpu_not_on_the_cpu() -> None:
    """A decode batch that fits one wave of a GPU's split-KV attention costs a batch at
    its mean context and then waits for its longest request's pieces (its keys past the
    mean, at a lone piece's rate: never as if every request held the longest context);
    the CPU's attention runs requests of similar length together (kernels/reference.py),
    so there the batch costs what a batch at its mean context does (one 1,500-token
    request beside 15 of 100 tokens)."""
    from executors.demo import demo_model_path

    path = PROFILES_DIR / "deepinfer-demo__cpu.json"
    spec = load_model_config(demo_model_path() / "config.json")
    ragged = shape_output([[1, 1, 1500, False], [15, 1, 100, False]])
    mean = shape_output([[16, 1, round((1500 + 15 * 100) / 16), False]])
    longest = shape_output([[16, 1, 1500, False]])
    cpu = ProfiledCostModel(path, spec, get_hardware("cpu"))
    gpu_like = ProfiledCostModel(
        path, spec, dataclasses.replace(get_hardware("cpu"), runs_on_host=False)
    )
    assert cpu.step_time(ragged) == pytest.approx(cpu.step_time(mean), rel=0.02)
    assert cpu._piece_key_s == 0.0
    at_mean = gpu_like._decode.predict_at(16, (1500 + 15 * 100) / 16)
    alone = gpu_like._piece_key_s * (1500 - (1500 + 15 * 100) / 16)  # (no SMs: one piece)
    assert gpu_like._piece_key_s > 0
    assert gpu_like.step_time(ragged) == pytest.approx(at_mean + alone, rel=1e-12)
    assert cpu.step_time(ragged) < gpu_like.step_time(ragged) < gpu_like.step_time(longest)


@pytest.mark.parametrize("name", ["deepseek-v2-lite__h100", "moonlight-16b-a3b__h100"])
def test_a_lone_pieces_rate_is_one_requests_without_a_batch_1_row(name: str) -> None:
    """A grid without batches 1 and 2 (a log-fitted one: batches are bucket medians)
    takes a lone piece's per-key rate from the batch-1 row its physics extrapolates, not
    from its smallest row, where four requests' pieces share the GPU (1.7-2.8x the
    rate of the whole grid's batch-1 row at these shapes); the physics that extrapolates
    it reads the longest decode's piece, the same at batches 1 and 4, so the rest of the
    slope scales down with the batch (0.56 of the measured rate on one shipped grid)."""
    model, hw = name.split("__")
    data = json.loads((PROFILES_DIR / f"{name}.json").read_text())
    full = ProfiledCostModel(data, load_model_config(model), get_hardware(hw))
    points = [p for p in data["points"] if not (p["kind"] == "decode" and p["num_reqs"] <= 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fewer = ProfiledCostModel(
            dict(data, points=points), load_model_config(model), get_hardware(hw)
        )
    assert fewer._decode.batches[0] == 4
    assert 0.5 < fewer._piece_key_s / full._piece_key_s < 1.7


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_async_scheduling_never_prices_a_step_above_its_sequential_time(path) -> None:
    """Launching a step while the one before runs only hides host work: at every point
    of the profile the async price is at most the sequential one, even where a point's
    few pipelined rounds measured more (noise: that point keeps its median)."""
    name = path.name.split("__")[0]
    model, hw = load_model_config(name), get_hardware("h200")
    for k in (0, 3):  # plain steps; verify steps of a speculating engine
        seq = ProfiledCostModel(path, model, hw, k)
        overlap = ProfiledCostModel(path, model, hw, k, async_scheduling=True)
        for p in json.loads(path.read_text())["points"]:
            if bool(p.get("drafter")) == bool(k) and not any(g[3] for g in p["groups"]):
                out = shape_output(p["groups"])
                assert overlap.step_time(out) <= seq.step_time(out) * 1.001, (k, p["groups"])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_speculating_async_model_reports_its_verify_points_against_their_pipelined_times(
    path,
) -> None:
    """Under async scheduling a speculating engine's verify steps are priced from their
    pipelined times, so its fit report must measure them against those, not the medians
    (which read 13-26% above the prices at batch 256 and made a faithful fit look off)."""
    name = path.name.split("__")[0]
    cm = ProfiledCostModel(
        path, load_model_config(name), get_hardware("h200"), 3, async_scheduling=True
    )
    points = json.loads(path.read_text())["points"]
    verify = [
        (p, err)
        for p, err in zip(points, cm.point_errors)
        if p["kind"] == "verify" and p.get("drafter") == 3
    ]
    assert verify
    for p, err in verify:
        priced = cm.step_time(shape_output(p["groups"]))
        measured = min(p["pipelined_s"], p["median_s"])
        assert err == pytest.approx(priced / measured - 1), p["groups"]
    assert sorted(abs(e) for _, e in verify)[len(verify) // 2] < 0.05


def test_a_step_launched_on_an_idle_device_costs_its_sequential_time() -> None:
    """Under async scheduling a step is priced from its pipelined time, which hides its
    host part behind the step before it. The first step after the engine idles has
    nothing to hide behind: it costs the profile's sequential time (the medians), and
    the steps launched behind it their pipelined times again."""
    path = PROFILES_DIR / "moonlight-16b-a3b__h200.json"
    spec, hw = load_model_config("moonlight-16b-a3b"), get_hardware("h200")
    pipelined = ProfiledCostModel(path, spec, hw, async_scheduling=True)
    sequential = ProfiledCostModel(path, spec, hw)
    decode = shape_output([[1, 1, 1024, False]])
    priced, extra = pipelined.launch_cost(decode)
    assert priced == pipelined.step_time(decode) and extra > 0.0
    assert priced + extra == pytest.approx(sequential.step_time(decode))
    assert sequential.launch_cost(decode) == (sequential.step_time(decode), 0.0)

    cfg = EngineConfig(max_num_seqs=8, async_scheduling=True)
    res = simulate([TraceRequest("a", 0.0, 512, 8)], spec, "h200", cfg)
    prompt, first_decode = res.steps[0], res.steps[1]
    prompt_out = shape_output([[1, 512, 0, True]])  # (its record starts after scheduling)
    assert prompt.duration == pytest.approx(sequential.step_time(prompt_out), rel=1e-6)
    decode_out = shape_output([[1, 1, 512, False]])  # launched behind the prompt step
    assert first_decode.duration == pytest.approx(pipelined.step_time(decode_out), rel=1e-6)


@pytest.mark.parametrize("k", [0, 3])
def test_a_launch_reads_its_step_once_for_both_fits(k: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`launch_cost` prices a step with the pipelined fit and the sequential one from a
    single reading of it (one `_measure`), and gives exactly what the two fits' own
    `step_time` give: decodes inside and beyond the grid, prompt chunks, mixed steps,
    verify steps."""
    path = PROFILES_DIR / "moonlight-16b-a3b__h200.json"
    spec, hw = load_model_config("moonlight-16b-a3b"), get_hardware("h200")
    spec = dataclasses.replace(spec, num_nextn_predict_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipelined = ProfiledCostModel(path, spec, hw, k, async_scheduling=True)
        sequential = ProfiledCostModel(path, spec, hw, k)
    assert pipelined.pipelined
    pipelined.launch_cost(shape_output([[1, 1, 64, False]]))  # (fits the sequential one)
    shapes = [
        [[1, 1, 1024, False]],
        [[7, 1, 100, False]],  # below the grid's contexts
        [[3, 1, 9000, False], [2, 1, 300, False]],  # beyond them
        [[1, 512, 0, True]],
        [[1, 300, 200, True], [4, 1, 2000, False]],
        [[4, 1 + k, 2000, False, k]] if k else [[600, 1, 512, False]],
    ]
    measured = 0
    measure = ProfiledCostModel._measure

    def counting(self, out, num_drafts):  # type: ignore[no-untyped-def]
        nonlocal measured
        measured += 1
        return measure(self, out, num_drafts)

    for groups in shapes:
        out = shape_output(groups)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = pipelined.step_time(out)
            extra = max(0.0, sequential.step_time(out) - want)
            monkeypatch.setattr(ProfiledCostModel, "_measure", counting)
            measured = 0
            assert pipelined.launch_cost(out) == (want, extra), groups
            monkeypatch.setattr(ProfiledCostModel, "_measure", measure)
        assert measured == 1


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_decode_runs_prices_are_its_steps_to_the_bit(path) -> None:
    """The fast-forward prices a run's steps with `StepSurface.run_costs`: it must give
    `predict_at`'s floats exactly, inside the grid and past it on either side, contexts
    rising, falling back and staying in one cell, beside a second surface or not."""
    model = _model(path)
    surface = model._decode
    contexts = [1.0, 1.5, 7.0, 7.5, 63.5, 100.25, 511.0, 64.0, 4096.0, 4097.0, 9999.9, 1e6, 2.0]
    besides = [None, model._sequential_model()._decode, _shifted(surface)]
    for batch in (1.0, 3.0, 17.0, 256.0, 257.0, 1000.0, 20000.0):
        for beside in besides:
            want = []
            for c in contexts:
                priced = surface.predict_at(batch, c)
                more = 0.0 if beside is None else beside.predict_at(batch, c) - priced
                want.append((0.5, priced, max(0.0, more), 0.25))
            assert list(surface.run_costs(batch, contexts, 0.5, beside, launch=0.25)) == want


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_one_wave_runs_capped_prices_are_its_steps_to_the_bit(path) -> None:
    """With a one-wave tail, each step adds the longest request's pieces past the mean
    and is capped at the uniform batch at the longest context, on each surface with its
    own key rate: the fast path's floats are the step formula's, the cap binding at some
    steps and not at others, the longest context inside the grid and past it."""
    model = _model(path)
    surface = model._decode
    top_ctx = float(surface.contexts[-1])
    besides = [None, _doubled(surface), _shifted(surface)]
    for batch in (2.0, 17.0, 120.0):
        for top in (300, 1022, 4094, int(top_ctx) - 3, int(top_ctx) * 2):
            means = [top / 4 + 7.5 * s for s in range(6)]
            for key_s, beside_key_s in ((1e-7, 3e-7), (1e-4, 2e-6), (0.0, 1e-3)):
                for beside in besides:
                    want = []
                    for s, c in enumerate(means):
                        far = float(top + s)
                        priced = surface.predict_at(batch, c) + key_s * (far - c) / 4
                        priced = min(priced, surface.predict_at(batch, far))
                        more = 0.0
                        if beside is not None:
                            other = beside.predict_at(batch, c) + beside_key_s * (far - c) / 4
                            more = min(other, beside.predict_at(batch, far)) - priced
                        want.append((0.5, priced, max(0.0, more), 0.0))
                    tail = (top, key_s, beside_key_s, 4)
                    got = list(surface.run_costs(batch, means, 0.5, beside, tail))
                    assert got == want, (batch, top, key_s, beside is None)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("launch", [False, True])
def test_a_ragged_decode_runs_prices_are_its_steps_to_the_bit(async_scheduling, launch) -> None:
    """The fast-forward prices a ragged batch's steps (one wave: the mean's surface and
    the longest request's pieces past it; past a wave: the mean) exactly as `cpu_time`,
    `launch_cost` and `launch_seconds` price each step, pipelined or not, with the
    launches timed apart or not."""
    from deepinfer.decode_run import Batch

    path = PROFILES_DIR / "deepseek-v2-lite__h100.json"
    profile = with_launch_times(path.stem) if launch else path
    cm = ProfiledCostModel(
        profile, load_model_config("deepseek-v2-lite"), get_hardware("h100"),
        async_scheduling=async_scheduling,
    )  # fmt: skip
    assert (cm.launch_seconds(shape_output([[3, 1, 100, False]])) > 0) == (
        launch and async_scheduling
    )
    sequential = cm._sequential_model() if cm.pipelined else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for groups in (
            [[5, 300], [1, 87000]], [[30, 0], [1, 9000]], [[300, 100], [2, 5000]],
            [[1, 300], [1, 70000]],  # (the uniform batch's cap binds)
        ):  # fmt: skip
            n = sum(count for count, _ in groups)
            ctx_max = max(ctx for _, ctx in groups)
            ctx_sum = sum(count * ctx for count, ctx in groups)
            got = list(cm._decode_batch(Batch(0, 12, n, ctx_max, ctx_sum), sequential))
            for s, priced in enumerate(got):
                out = shape_output([[count, 1, ctx + s, False] for count, ctx in groups])
                assert priced == (cm.cpu_time(out), *cm.launch_cost(out), cm.launch_seconds(out))


def _doubled(surface: StepSurface) -> StepSurface:
    """A copy of `surface` on the same nodes at twice its times (it shares the weights,
    not the values)."""
    other = copy.copy(surface)
    other._grid = [[2 * g for g in row] for row in surface._grid]
    return other


def _shifted(surface: StepSurface) -> StepSurface:
    """A copy of `surface` on other context nodes (it cannot share the weights)."""
    other = copy.copy(surface)
    other._log_contexts = [x + 0.25 for x in surface._log_contexts]
    other._grid = [[2 * g for g in row] for row in surface._grid]
    return other


def test_a_short_chunk_waits_for_its_whole_cached_prefix_in_one_wave() -> None:
    """Prefill attention runs a program a (128 query rows, request, head): while a step's
    chunks fill one wave of the GPU's SMs, it waits for its longest program, which reads
    the chunk's whole cached prefix whatever its query count; past a wave the keys of
    every program, shared by the SMs, set it. So 3,072 more cached tokens cost a 16-token
    chunk about what they cost a 512-token one (not 16/512 of it: the longest program
    reads them all), and the CPU's attention has no waves."""
    from sim.profiled_cost_model import FEATURES

    wave = FEATURES.index("prefill_wave")
    path = PROFILES_DIR / "deepseek-v2-lite__h100.json"
    spec = load_model_config("deepseek-v2-lite")
    cm = ProfiledCostModel(path, spec, get_hardware("h100"))

    def chunk(q: int, ctx: int) -> float:
        return cm.step_time(shape_output([[1, q, ctx, True]]))

    assert cm.features(shape_output([[1, 16, 4096, True]]))[wave] == 4112
    assert cm.features(shape_output([[1, 8192, 4096, True]]))[wave] > 8192 + 4096
    short, long = chunk(16, 4096) - chunk(16, 1024), chunk(512, 4096) - chunk(512, 1024)
    assert 0.75 < short / long < 1.25  # (per query: 16 / 512)
    cpu = ProfiledCostModel(path, spec, get_hardware("cpu"))
    assert cpu.features(shape_output([[1, 16, 4096, True]]))[wave] == 0.0


def _engine_model(path, **limits) -> ProfiledCostModel:
    return ProfiledCostModel(path, *named_model(path), **limits)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_decode_batch_is_priced_in_the_graph_it_replays(path) -> None:
    """A pure-decode step replays the smallest captured graph that holds its batch,
    padded with rows alike (one token, no context). While it fits one wave of split-KV
    the padding rows cost one row more of the surface (the projections read their
    weights once for all rows, the experts see the padding as one token), not the
    graph's whole batch; a batch the engine captured as it is (max_num_seqs 12) costs
    the surface there. Past one wave the padding rows' pieces are empty and the
    requests set the price."""

    def at(cm: ProfiledCostModel, n: int) -> float:
        return cm.step_time(shape_output([[n, 1, 2000, False]]))

    cm = _engine_model(path)
    for n in (8, 16):  # (graphs of their own size)
        assert at(cm, n) == pytest.approx(cm._decode.predict_at(n, 2000), rel=1e-12)
    for n in (9, 12, 97):  # (in the graphs of 16, 16 and 128 rows)
        assert at(cm, n) == pytest.approx(cm._decode.predict_at(n + 1, 2000), rel=1e-12)
        assert at(cm, n) < at(cm, graph_batch(n))
    small = _engine_model(path, max_num_seqs=12)
    assert at(small, 12) == pytest.approx(small._decode.predict_at(12, 2000), rel=1e-12)
    assert at(small, 12) < at(cm, 12)
    wide = _engine_model(path, max_num_seqs=512)
    assert at(wide, 300) == pytest.approx(wide._decode.predict_at(300, 2000), rel=1e-12)


@pytest.mark.parametrize("path", SHIPPED[:1], ids=lambda p: p.stem)
def test_a_prompt_chunk_pads_to_the_engines_own_top_token_bucket(path) -> None:
    """Piecewise graphs are captured at token buckets up to the engine's token budget: a
    chunk of 900 tokens under a budget of 1,000 replays the 1,000-token graph (the top),
    under the default 8,192 the 1,024-token one; a chunk of 700, the 768 one in both."""
    default, tight = _engine_model(path), _engine_model(path, max_num_batched_tokens=1000)
    nine, seven = shape_output([[1, 900, 0, True]]), shape_output([[1, 700, 0, True]])
    assert tight.step_time(nine) < default.step_time(nine)
    assert tight.step_time(seven) == default.step_time(seven)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_lone_chunk_counts_the_rows_its_graph_runs(path) -> None:
    """A lone prompt chunk (one request, nothing beside it: the first step after the
    engine idled) runs its piecewise graph's bucket of rows between attention layers:
    its tokens feature is the bucket's, its attention its own tokens', in the fit and in
    the price alike. Past the top bucket (eager) and beside decodes it counts its own."""
    cm = _engine_model(path)
    tokens, wave = FEATURES.index("tokens"), FEATURES.index("prefill_wave")
    for ctx in (0, 3000):
        between, bucket = shape_output([[1, 2600, ctx, True]]), shape_output([[1, 3072, ctx, True]])
        f, g = cm.features(between), cm.features(bucket)
        assert f[tokens] == g[tokens] == 3072
        assert f[wave] < g[wave]
        assert cm.step_time(between) == pytest.approx(cm._physics(between), rel=1e-12)
        assert cm.step_time(shape_output([[1, 2000, ctx, True]])) < cm.step_time(between)
    assert cm.features(shape_output([[1, 9000, 0, True]]))[tokens] == 9000
    mixed = shape_output([[4, 1, 1000, False], [1, 2600, 0, True]])
    assert cm.features(mixed)[tokens] == 2604


@pytest.mark.parametrize("path", SHIPPED[:2], ids=lambda p: p.stem)
def test_the_fit_reads_its_points_with_their_own_runners_limits(path) -> None:
    """The engine's limits choose how its steps are priced, never how the profile's
    points are fitted: the fit and its report are the same for any engine."""
    base, small = _engine_model(path), _engine_model(path, max_num_seqs=12)
    assert small.fit == base.fit and small.point_errors == base.point_errors
    assert small._coef == base._coef


@pytest.mark.parametrize("path", SHIPPED[:2], ids=lambda p: p.stem)
def test_a_decodes_piece_is_cut_for_the_rows_that_run(path) -> None:
    """decode_max_context is the keys of the longest decode's split-KV piece: a pure-decode
    step's pieces are chosen for its graph's rows (9 requests in the 16-row graph), a
    step's decodes beside a prompt chunk for those decode rows themselves."""
    from sim.profile_fit import decode_splits
    from sim.profiled_cost_model import FEATURES

    cm = _engine_model(path)
    at = FEATURES.index("decode_max_context")
    heads, sms = cm._heads, cm._sms
    graph = cm.features(shape_output([[9, 1, 100_000, False]]))[at]
    assert graph == pytest.approx(100_000 / decode_splits(16, heads, sms))
    mixed = cm.features(shape_output([[9, 1, 100_000, False], [1, 512, 0, True]]))[at]
    assert mixed == pytest.approx(100_000 / decode_splits(9, heads, sms))


def test_a_model_built_for_another_engine_prices_the_engine_it_is_given_to() -> None:
    """A ProfiledCostModel passed to simulate prices that engine's steps: built with the
    defaults (sync, 256 sequences, 8192 tokens) and given to an async engine of other
    limits, it runs as the model simulate fits for that engine; built for the engine, it
    is used as it is."""
    path = PROFILES_DIR / "moonlight-16b-a3b__h200.json"
    spec, hw = load_model_config("moonlight-16b-a3b"), get_hardware("h200")
    built = ProfiledCostModel(path, spec, hw)
    cfg = EngineConfig(async_scheduling=True, max_num_seqs=24, max_num_batched_tokens=2048)
    reqs = [TraceRequest(f"r{i}", 0.01 * i, 300 + 97 * i, 40 + 7 * i) for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        given = simulate(reqs, spec, "h200", cfg, cost_model=built)
        fitted = simulate(reqs, spec, "h200", cfg, cost_model="profiled")
        sync = EngineConfig(async_scheduling=False)
        as_built = simulate(reqs, spec, "h200", sync, cost_model=built)
        default = simulate(reqs, spec, "h200", sync, cost_model="profiled")
    assert given.summary == fitted.summary and given.requests == fitted.requests
    assert as_built.summary == default.summary
    assert given.summary["duration_s"] != as_built.summary["duration_s"]
    assert built.for_engine(spec, hw, EngineSettings()) is built

    class Slower(ProfiledCostModel):
        def step_time(self, out):
            return 2 * super().step_time(out)

    again = Slower(path, spec, hw).for_engine(spec, hw, EngineSettings(0, True, 24, 2048))
    assert type(again) is Slower and again.pipelined and again._max_num_seqs == 24
    with pytest.raises(ValueError, match="cannot price moonlight-16b-a3b on h100"):
        simulate(reqs, spec, "h100", cfg, cost_model=built)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_uniform_decode_physics_is_the_built_steps_to_the_bit(path) -> None:
    """Past its grid the decode surface scales by the physics of a uniform step it does
    not build (`_uniform_decode_physics`): the plain physics of the built step, to the
    bit, inside and past the captured graphs' batches and one wave's pieces."""
    for cm in (_model(path), _engine_model(path), _engine_model(path, max_num_seqs=12)):
        assert cm._decode._uniform == cm._uniform_decode_physics
        for n in (1, 3, 8, 13, 64, 200, 512, 700):
            for c in (1, 63, 1000, 7169, 9000, 70000):
                built = cm._physics(shape_output([[n, 1, c, False]]))
                assert cm._uniform_decode_physics(n, c) == built, (n, c)
        # The surface's prices with it, and without it (the step built each time),
        # inside and past its grid, a one-wave run's capped prices past it included.
        fast = cm._decode
        slow = copy.copy(fast)
        slow._uniform, slow._physics_of_synthetic = None, {}
        top_b, top_c = fast._bounds[1], fast._bounds[3]
        for b in (1.0, 2.5, 12.4, 13.0, 300.0, top_b * 1.5 + 0.5):
            for c in (0.4, 1.0, 7.5, top_c + 0.5, top_c * 3 + 0.6):
                assert fast.predict_at(b, c) == slow.predict_at(b, c), (b, c)
        contexts = [top_c - 40.0 + s for s in range(80)]
        tail = (int(top_c) + 200, 1e-4, 0.0, 4)  # (the cap binds past the grid)
        for b in (2.0, 9.0):
            assert list(fast.run_costs(b, contexts, 0.0, None, tail)) == list(
                slow.run_costs(b, contexts, 0.0, None, tail)
            ), b

"""Specification of the simulator's hardware/model specs and cost models."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import PRESETS_DIR, ModelConfig, load_model_config
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim import simulate
from sim.analytic_cost_model import AnalyticCostModel, expected_distinct_experts
from sim.cost_coefficients import load_cost_coefficients
from sim.cost_model import CostModel, UnitCostModel
from sim.cost_model_registry import get_cost_model
from sim.hardware import get_hardware, known_hardware
from sim.kv_capacity import kv_capacity_blocks
from sim.traces import TraceRequest


def _req(i: int, q: int, ctx: int, prompt: bool, will_sample: bool = True, drafts: int = 0):
    return ScheduledRequest(
        req_id=f"r{i}",
        num_tokens=q,
        num_computed_tokens=ctx,
        is_prompt=prompt,
        will_sample=will_sample,
        new_block_ids=[],
        draft_token_ids=list(range(drafts)),
    )


def decode_step(batch: int, ctx: int) -> SchedulerOutput:
    return SchedulerOutput(0, [_req(i, 1, ctx, prompt=False) for i in range(batch)])


def prefill_step(q: int, ctx: int = 0, will_sample: bool = True) -> SchedulerOutput:
    return SchedulerOutput(0, [_req(0, q, ctx, prompt=True, will_sample=will_sample)])


@pytest.fixture(scope="module")
def moonlight() -> ModelConfig:
    return load_model_config("moonlight-16b-a3b")


@pytest.fixture(scope="module")
def h200_model(moonlight: ModelConfig) -> AnalyticCostModel:
    return AnalyticCostModel(moonlight, get_hardware("h200"), load_cost_coefficients())


# --- hardware -------------------------------------------------------------------


def test_hardware_presets_carry_spec_sheet_figures() -> None:
    assert {"h100", "h200", "h800", "b200"} <= set(known_hardware())
    h200 = get_hardware("H200")
    assert h200.hbm_bandwidth == pytest.approx(4.8e12)
    assert h200.peak_bf16_flops == pytest.approx(989.4e12)
    assert 140e9 < h200.memory_bytes < 152e9
    assert get_hardware("b200").peak_bf16_flops > h200.peak_bf16_flops
    assert all(get_hardware(n).source for n in known_hardware())


def test_a_gpu_entry_without_its_sm_count_is_named(monkeypatch) -> None:
    """A GPU's SMs set its kernels' waves: an entry that lacks them is refused by name
    rather than priced as a host CPU (which has none)."""
    import sim.hardware as hardware

    table = hardware._table()
    gpu = {k: v for k, v in table["h100"].items() if k != "num_sms"}
    monkeypatch.setattr(hardware, "_table", lambda: {**table, "h100": gpu})
    with pytest.raises(ValueError, match="'h100' lacks field 'num_sms'"):
        get_hardware("h100")
    assert get_hardware("cpu").num_sms == 0


def test_unknown_hardware_lists_known_names() -> None:
    with pytest.raises(ValueError, match="h200"):
        get_hardware("tpu-v9")


# --- model specs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total_b", "active_b", "active_tol"),
    [
        # Moonlight's "3B activated" is the rounded A3B label, hence the wider band.
        ("moonlight-16b-a3b", 16.0, 3.0, 0.2),
        ("deepseek-v2-lite", 15.7, 2.4, 0.1),
        ("deepseek-v3", 671.0, 37.0, 0.1),
    ],
)
def test_preset_parameter_counts_match_published_totals(
    name: str, total_b: float, active_b: float, active_tol: float
) -> None:
    spec = load_model_config(name)
    assert spec.total_params / 1e9 == pytest.approx(total_b, rel=0.1)
    assert spec.active_params / 1e9 == pytest.approx(active_b, rel=active_tol)


def test_moonlight_shapes_and_latent_kv_bytes(moonlight: ModelConfig) -> None:
    assert moonlight.num_hidden_layers == 27 and moonlight.num_moe_layers == 26
    assert moonlight.q_lora_rank is None and moonlight.dtype_bytes == 2
    assert moonlight.kv_bytes_per_token == (512 + 64) * 27 * 2
    assert moonlight.num_mtp_layers == 0


def test_deepseek_v3_is_fp8_and_mtp_is_not_served_by_default() -> None:
    v3 = load_model_config("deepseek-v3")
    assert v3.dtype_bytes == 1  # quantization_config.quant_method == "fp8"
    assert v3.num_mtp_layers == 1
    assert v3.mtp_params / 1e9 == pytest.approx(14.0, rel=0.1)  # 685B checkpoint - 671B
    assert v3.weight_bytes < v3.total_params * 1.01  # about one byte per weight
    assert load_model_config("deepseek-v3", dtype_bytes=2).weight_bytes > 1.3e12


def test_config_json_path_and_folder_load(tmp_path) -> None:
    d = json.loads((PRESETS_DIR / "deepseek-v2-lite.json").read_text())
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    by_file = load_model_config(folder / "config.json")
    by_dir = load_model_config(str(folder))
    assert by_file.name == by_dir.name == "my-model"
    assert by_file.total_params == load_model_config("deepseek-v2-lite").total_params


def test_missing_key_names_the_key_and_the_file(tmp_path) -> None:
    d = json.loads((PRESETS_DIR / "moonlight-16b-a3b.json").read_text())
    del d["kv_lora_rank"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="kv_lora_rank") as e:
        load_model_config(path)
    assert str(path) in str(e.value)


def test_unknown_model_type_is_named(tmp_path) -> None:
    d = json.loads((PRESETS_DIR / "moonlight-16b-a3b.json").read_text())
    d["model_type"] = "llama"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="'llama'"):
        load_model_config(path)


def test_unknown_model_name_lists_presets() -> None:
    with pytest.raises(ValueError, match="moonlight-16b-a3b"):
        load_model_config("no-such-model")


# --- KV capacity ---------------------------------------------------------------------


def test_kv_capacity_is_positive_for_moonlight_on_h200(moonlight: ModelConfig) -> None:
    h200 = get_hardware("h200")
    blocks = kv_capacity_blocks(moonlight, h200, block_size=64, gpu_memory_utilization=0.9)
    assert blocks > 0
    # The cache fills what the weights leave: within the usable memory, above half of it.
    cache = blocks * 64 * moonlight.kv_bytes_per_token
    usable = 0.9 * h200.memory_bytes - moonlight.weight_bytes
    assert 0.5 * usable < cache <= usable
    assert kv_capacity_blocks(moonlight, h200, 16, 0.9) >= 4 * blocks


@pytest.mark.parametrize("dtype_bytes", [2, None])
def test_kv_capacity_raises_when_deepseek_v3_does_not_fit(dtype_bytes: int | None) -> None:
    v3 = load_model_config("deepseek-v3", dtype_bytes=dtype_bytes)
    with pytest.raises(ValueError, match="does not fit") as e:
        kv_capacity_blocks(v3, get_hardware("h200"), 64, 0.9)
    msg = str(e.value)
    assert "--num-gpu-blocks" not in msg and "GB" in msg  # no way around it: it cannot fit
    assert ("bf16" if dtype_bytes == 2 else "fp8") in msg


def test_an_explicit_kv_cache_beside_weights_that_do_not_fit_is_refused() -> None:
    """DeepSeek-V3 on one H200 with --num-gpu-blocks was accepted: its weights alone
    exceed the memory."""
    reqs = [TraceRequest("a", 0.0, 10, 2)]
    with pytest.raises(ValueError, match=r"weights 672\.9 GB plus num_gpu_blocks=100"):
        simulate(reqs, model="deepseek-v3", engine=EngineConfig(num_gpu_blocks=100))
    with pytest.raises(ValueError, match="exceed the .* GB usable"):
        simulate(reqs, engine=EngineConfig(num_gpu_blocks=2_000_000))  # Moonlight: KV too big


# --- cost models -------------------------------------------------------------------------


def test_unit_cost_model_costs_one_ms_per_nonempty_step() -> None:
    unit = UnitCostModel()
    assert unit.step_time(decode_step(7, 100)) == 0.001
    assert unit.step_time(SchedulerOutput(0, [])) == 0.0
    assert unit.cpu_time(decode_step(7, 100)) == 0.0


def test_get_cost_model_by_name_or_object(moonlight: ModelConfig) -> None:
    h200 = get_hardware("h200")
    assert isinstance(get_cost_model("unit", moonlight, h200), UnitCostModel)
    assert isinstance(get_cost_model("analytic", moonlight, h200), AnalyticCostModel)
    mine = UnitCostModel(0.5)
    assert get_cost_model(mine, moonlight, h200) is mine

    class StepOnly(CostModel):  # every other hook keeps its default
        def step_time(self, out: SchedulerOutput) -> float:
            return 2.0

    own = get_cost_model(StepOnly(), moonlight, h200)
    step = decode_step(1, 1)
    assert own.step_time(step) == 2.0 and own.cpu_time(step) == 0.0
    assert own.launch_cost(step) == (2.0, 0.0) and own.grammar_mask_per_token_s == 0.0

    class Unrelated:  # the hooks are not probed: a cost model says it is one
        def step_time(self, out: SchedulerOutput) -> float:
            return 2.0

    with pytest.raises(TypeError, match="CostModel"):
        get_cost_model(Unrelated(), moonlight, h200)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="analytic"):
        get_cost_model("vidur", moonlight, h200)


def test_decode_at_batch_1_is_near_the_weight_bandwidth_bound(
    h200_model: AnalyticCostModel, moonlight: ModelConfig
) -> None:
    bound = moonlight.active_params * moonlight.dtype_bytes / get_hardware("h200").hbm_bandwidth
    t = h200_model.step_time(decode_step(1, 1024))
    assert 1.2 * bound <= t <= 3.0 * bound


def test_more_tokens_never_cost_less(h200_model: AnalyticCostModel) -> None:
    """Monotone in batch size, in context length, and in prefill chunk size."""
    for ctx in (0, 128, 1024, 8192, 32768):
        times = [h200_model.step_time(decode_step(b, ctx)) for b in (1, 2, 4, 16, 64, 128, 256)]
        assert times == sorted(times)
    for batch in (1, 32, 256):
        times = [h200_model.step_time(decode_step(batch, c)) for c in (0, 100, 1000, 10000)]
        assert times == sorted(times)
    chunks = [h200_model.step_time(prefill_step(q)) for q in (2, 16, 256, 2048, 8192, 16384)]
    assert chunks == sorted(chunks)
    later = [h200_model.step_time(prefill_step(2048, c)) for c in (0, 2048, 8192)]
    assert later == sorted(later)
    mixed = SchedulerOutput(0, decode_step(64, 1024).scheduled + prefill_step(512).scheduled)
    assert h200_model.step_time(mixed) >= h200_model.step_time(decode_step(64, 1024))


def test_prefill_of_16k_tokens_is_compute_bound(
    h200_model: AnalyticCostModel, moonlight: ModelConfig
) -> None:
    out = prefill_step(16384)
    t = h200_model.step_time(out)
    parts = h200_model.breakdown(out)
    assert sum(p.seconds for p in parts.values()) == pytest.approx(t)
    for name in ("dense", "experts", "attn_pre"):
        flops, nbytes, _ = parts[name]
        assert flops / get_hardware("h200").peak_bf16_flops > nbytes / 4.8e12, name
    # Independent FLOP count: 2 * tokens * non-embedding weights touched, plus causal attention.
    m, n = moonlight, 16384
    linear = 2 * n * (m.active_params - m.lm_head_params)
    attn = 2 * m.num_hidden_layers * m.num_attention_heads * (192 + 128) * n * (n + 1) / 2
    ideal = (linear + attn) / get_hardware("h200").peak_bf16_flops
    assert ideal / 0.8 < t < ideal / 0.4


def test_lm_head_is_priced_only_for_sampled_positions(h200_model: AnalyticCostModel) -> None:
    mid_prompt = h200_model.step_time(prefill_step(512, will_sample=False))
    last_chunk = h200_model.step_time(prefill_step(512, will_sample=True))
    assert last_chunk > mid_prompt
    plain = SchedulerOutput(0, [_req(0, 1, 500, prompt=False)])
    verify = SchedulerOutput(0, [_req(0, 4, 500, prompt=False, drafts=3)])
    assert h200_model.step_time(verify) > h200_model.step_time(plain)


def test_expected_distinct_experts_saturates_at_num_experts() -> None:
    assert expected_distinct_experts(0, 64, 6) == 0.0
    assert expected_distinct_experts(1, 64, 6) == pytest.approx(6.0)
    values = [expected_distinct_experts(t, 64, 6) for t in (1, 2, 8, 64, 512, 100_000)]
    assert values == sorted(values) and all(v <= 64 for v in values)
    assert values[-1] == pytest.approx(64.0)
    assert expected_distinct_experts(5, 8, 8) == 8.0


def test_cpu_time_has_fixed_and_per_request_parts(h200_model: AnalyticCostModel) -> None:
    c = h200_model.coeffs
    assert h200_model.cpu_time(SchedulerOutput(0, [])) == 0.0
    assert h200_model.cpu_time(decode_step(10, 5)) == pytest.approx(
        c.cpu_step_overhead_s + 10 * c.cpu_per_request_s
    )


def test_empty_step_costs_nothing(h200_model: AnalyticCostModel) -> None:
    assert h200_model.step_time(SchedulerOutput(0, [])) == 0.0


def test_coefficients_load_with_overrides_and_reject_unknown_names() -> None:
    c = load_cost_coefficients(matmul_efficiency=0.5)
    assert c.matmul_efficiency == 0.5
    with pytest.raises(ValueError, match="bogus"):
        load_cost_coefficients(bogus=1.0)
    with pytest.raises(ValueError, match="matmul_efficiency"):
        load_cost_coefficients(matmul_efficiency=1.5)


def test_step_time_is_cheap_for_a_full_batch(h200_model: AnalyticCostModel) -> None:
    out = decode_step(256, 2000)
    start = time.perf_counter()
    for _ in range(200):
        h200_model.step_time(out)
    assert (time.perf_counter() - start) / 200 < 1e-3  # ~30 us typical; loose for slow CI


def test_a_speculating_engine_pays_for_the_drafter_after_every_step(
    moonlight: ModelConfig,
) -> None:
    """The real engine runs the MTP drafter after every step once it speculates: a decode
    step (no drafts to verify yet) and a prompt chunk cost more than without speculation,
    a verify step pays for the engine's K drafts (not only the k it verifies), and more
    drafts proposed cost more."""
    hw, coeffs = get_hardware("h200"), load_cost_coefficients()
    plain = AnalyticCostModel(moonlight, hw, coeffs)
    spec = {k: AnalyticCostModel(moonlight, hw, coeffs, num_speculative_tokens=k) for k in (1, 3)}
    for out in (decode_step(8, 1000), prefill_step(2048)):
        assert plain.step_time(out) < spec[1].step_time(out) < spec[3].step_time(out)
        assert "mtp" in spec[1].breakdown(out) and "mtp" not in plain.breakdown(out)
    verify = SchedulerOutput(0, [_req(i, 2, 1000, prompt=False, drafts=1) for i in range(8)])
    assert spec[1].step_time(verify) < spec[3].step_time(verify)
    # Without the engine's K, a step's drafts say that the engine speculates.
    assert plain.step_time(verify) == pytest.approx(spec[1].step_time(verify))
    # A chunk that ends before its prompt drafts nothing: no chained passes, no head.
    mid = prefill_step(2048, will_sample=False)
    assert spec[1].breakdown(mid)["mtp"].seconds == pytest.approx(
        spec[3].breakdown(mid)["mtp"].seconds
    )
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AnalyticCostModel(moonlight, hw, coeffs, num_speculative_tokens=-1)

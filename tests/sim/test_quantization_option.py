"""`quantization="fp8"` means the same to the simulator as to the torch executor: the
model's linear weights at one byte each, priced by an FP8 profile or the roofline."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from sim.cost_model_registry import engine_cost_model, profile_key
from sim.hardware import get_hardware
from sim.profiled_cost_model import find_profile
from sim.simulator import simulate
from sim.traces.model import TraceRequest


def test_fp8_halves_the_linear_weights_and_keeps_embeddings_and_kv() -> None:
    bf16 = load_model_config("moonlight-16b-a3b")
    fp8 = bf16.with_quantization("fp8")
    assert (fp8.dtype_bytes, fp8.quant_method, fp8.weight_block_size) == (1, "fp8", (128, 128))
    assert (fp8.embed_dtype_bytes, fp8.kv_dtype_bytes) == (bf16.embed_dtype_bytes, 2)
    assert fp8.weight_bytes < 0.6 * bf16.weight_bytes
    v3 = load_model_config("deepseek-v3")  # FP8 as published: the option changes nothing
    assert v3.with_quantization("fp8") is v3 and v3.with_quantization(None) is v3
    with pytest.raises(ValueError, match="quantization='int8'"):
        bf16.with_quantization("int8")


def test_fp8_engine_is_priced_by_an_fp8_profile_or_the_roofline() -> None:
    """The shipped Moonlight profile is bf16: an FP8 engine takes the analytic model (no
    `moonlight-16b-a3b__fp8` profile ships) and refuses the bf16 profile by name."""
    model, hw = load_model_config("moonlight-16b-a3b"), get_hardware("h200")
    bf16_profile = find_profile(profile_key(model), "h200")
    assert bf16_profile is not None
    _, meta = engine_cost_model(None, model, hw, None, EngineConfig(quantization="fp8"))
    assert meta["cost_model"] == "analytic"
    with pytest.raises(ValueError, match="measured with quantization=None"):
        engine_cost_model(None, model, hw, bf16_profile, EngineConfig(quantization="fp8"))
    assert profile_key(model.with_quantization("fp8")) == "moonlight-16b-a3b__fp8"


def test_simulated_decode_is_faster_with_fp8_weights() -> None:
    """Small-batch decode reads every weight each step: FP8 takes fewer seconds."""
    trace = [TraceRequest("r0", arrival=0.0, prompt_len=64, output_len=32)]
    times = {}
    for quant in (None, "fp8"):
        engine = EngineConfig(quantization=quant, num_gpu_blocks=64)
        res = simulate(trace, model="moonlight-16b-a3b", hardware="h200",
                       engine=engine, cost_model="analytic")  # fmt: skip
        times[quant] = res.summary["tpot_ms_mean"]
    assert times["fp8"] < 0.75 * times[None]

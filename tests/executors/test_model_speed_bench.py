"""benchmarks/model_speed.py times decode only over steps that run the whole batch,
and sizes the KV cache so that such steps exist (above the prefill watermark)."""

from __future__ import annotations

import math

import pytest

from executors.torch_executor import TorchExecutor
from tests.executors.tiny_models import TinyModel


@pytest.fixture(scope="module")
def model_speed():
    from benchmarks import model_speed

    return model_speed


def test_whole_batch_decode_steps_exist_only_with_room_above_the_watermark(
    model_speed, tiny_models: dict[str, TinyModel]
) -> None:
    tiny = tiny_models["v3_plain"]
    batch, context, new, budget = 16, 200, 3, 1024  # long prompts: the cache fills up
    cfg = model_speed.sweep_config(batch, context, new, 64, block=4, budget=budget)
    prompts = model_speed.random_prompts(batch, context, 200, 0)
    ex = TorchExecutor(cfg, str(tiny.path), device="cpu", dtype="float32")
    _, step = model_speed.ours(ex, cfg, prompts, new, "roomy")
    assert step > 0 and not math.isnan(step)
    # A cache the batch just fills: the watermark holds the last prompts back until the
    # first requests finish, so no step decodes all 16 and the benchmark says NaN.
    per_request = -(-(context + new + -(-batch * context // budget)) // 4)
    tight = cfg.replace(num_gpu_blocks=batch * per_request)
    ex = TorchExecutor(tight, str(tiny.path), device="cpu", dtype="float32")
    _, step = model_speed.ours(ex, tight, prompts, new, "tight")
    assert math.isnan(step)


def test_mixed_short_prompt_and_served_rows(model_speed, tiny_models: dict[str, TinyModel]) -> None:
    """The sweep's rows beyond prefill and decode: each mixed and short-prompt shape is
    timed with its roofline beside it, and the served trace finishes every request it
    admits, with latencies and the summed roofline of the steps it ran."""
    from deepinfer.model_config import load_model_config

    tiny = tiny_models["v3_plain"]
    cfg = model_speed.sweep_config(4, 64, 4, 256, block=4, budget=512)
    ex = TorchExecutor(cfg, str(tiny.path), device="cpu", dtype="float32")
    spec = load_model_config(tiny.path / "config.json")
    bw, peak = 1e11, 1e13
    rows = model_speed.step_rows(ex, spec, [(2, 16)], [(3, 8)], 32, bw, peak, reps=2)
    assert [r["kind"] for r in rows] == ["mixed", "short_prompts"]
    assert all(r["ours_step_ms"] > 0 and r["roofline_step_ms"] > 0 for r in rows)
    served = model_speed.served_row(ex, cfg, spec, 50.0, 4, bw, peak)
    assert served["requests"] == 4 and served["steps"] > 0
    assert 0 < served["ttft_p50_ms"] <= served["ttft_p99_ms"]
    assert served["roofline_s"] > 0 and served["busy_s"] > 0

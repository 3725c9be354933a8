"""benchmarks/model_speed.py times decode only over steps that run the whole batch,
and sizes the KV cache so that such steps exist (above the prefill watermark)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from executors.torch_executor import TorchExecutor
from tests.executors.tiny_models import TinyModel

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "model_speed.py"


@pytest.fixture(scope="module")
def model_speed():
    spec = importlib.util.spec_from_file_location("model_speed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

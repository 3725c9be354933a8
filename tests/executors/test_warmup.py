"""Start-up warm-up: served steps never compile a kernel (the stalls of the first minutes)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from deepinfer import EngineConfig
from deepinfer.config import EngineRole
from deepinfer.engine import EngineCore
from deepinfer.model_config import PRESETS_DIR
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.warmup import warm_up
from tests.executors.harness import load_runner
from tests.executors.tiny_models import TinyModel


def test_warm_up_runs_every_shape_class_and_leaves_no_state(
    tiny_models: dict[str, TinyModel],
) -> None:
    runner = load_runner(tiny_models["v3_plain"].path, block_size=4, num_blocks=64)
    report = warm_up(runner, max_num_batched_tokens=64, max_num_seqs=8)
    # prefill buckets 1..64 (powers of two and the config tables' edges) + 3 decode steps
    assert report.num_steps >= 8 and report.num_compiled == 0  # nothing compiles on the CPU
    assert len(runner.requests) == 0


def test_a_decode_engine_warms_up_without_imports(tiny_models: dict[str, TinyModel]) -> None:
    """A decode engine counts a prompt it never computed as computed and imports its KV;
    the warm-up's decode steps count context too, but read blocks nobody holds: they
    import nothing and are not failed for it."""
    runner = load_runner(
        tiny_models["v3_plain"].path, block_size=4, num_blocks=64, role=EngineRole.DECODE
    )
    report = warm_up(runner, max_num_batched_tokens=64, max_num_seqs=8)
    assert report.num_steps >= 8 and len(runner.requests) == 0
    assert runner.kv_transfer.imports and runner.kv_transfer.num_imported_tokens == 0


@pytest.mark.gpu
def test_no_served_step_compiles_a_kernel_after_start_up(tmp_path: Path) -> None:
    """Moonlight's layer shapes (two layers): a random mix of prompt lengths, chunking,
    decode batch sizes and contexts after start-up compiles nothing new."""
    from executors.torch_executor import TorchExecutor
    from kernels.compile_stats import total_compiled

    raw = json.loads((PRESETS_DIR / "moonlight-16b-a3b.json").read_text())
    raw.update(num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = EngineConfig(
        block_size=64, num_gpu_blocks=3000, max_num_seqs=96, max_num_batched_tokens=4096
    )
    ex = TorchExecutor(cfg, str(tmp_path), load_format="dummy")
    assert ex.warmup is not None and ex.warmup.num_steps > 0
    compiled = total_compiled()
    engine = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
    rng = random.Random(0)
    for i in range(150):
        n = rng.choice([1, 3, 17, 64, 65, 200, 511, 1000, 3000, 7000])
        params = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)
        engine.add_request(Request(str(i), [rng.randrange(163840) for _ in range(n)], params))
    while engine.has_unfinished():
        engine.step()
    assert total_compiled() == compiled
    torch.cuda.synchronize()
    ex.shutdown()


def test_the_start_up_heap_is_frozen_and_garbage_still_goes() -> None:
    """freeze_heap: what is alive at start-up leaves the collector's generations (a full
    collection no longer scans it), while a cycle made after it is still collected, and
    a frozen one dropped since goes at the next freeze (its executor's device memory with
    it)."""
    import gc
    import weakref

    from executors.warmup import freeze_heap

    class Node:
        pass

    before = Node()
    before.self = before  # a live cycle at start-up
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # frozen: not scanned
        after = Node()
        after.self = after
        ref = weakref.ref(after)
        del after
        gc.collect()
        assert ref() is None  # garbage made after the freeze is collected
        dropped = weakref.ref(before)
        del before  # frozen, then dropped without an unfreeze (an executor not shut down)
        gc.collect()
        assert dropped() is not None  # a frozen cycle stays...
        freeze_heap()
        assert dropped() is None  # ...until the next start-up's freeze
    finally:
        gc.unfreeze()


@pytest.mark.gpu
def test_a_cuda_executor_freezes_its_heap_and_frees_a_dropped_one_first() -> None:
    import gc

    from executors.demo import DEMO_MODEL_DIR
    from executors.torch_executor import TorchExecutor

    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.45)
    ex = TorchExecutor(cfg, str(DEMO_MODEL_DIR), device="cuda", dtype="float32")
    blocks = ex.num_kv_blocks()
    assert not any(o is ex.runner for o in gc.get_objects())  # frozen: never scanned
    del ex  # dropped without a shutdown: its KV cache sits in frozen cycles
    ex = TorchExecutor(cfg, str(DEMO_MODEL_DIR), device="cuda", dtype="float32")
    try:
        assert ex.num_kv_blocks() >= 0.95 * blocks  # the first one's memory was freed first
    finally:
        ex.shutdown()
    # Shut down, its objects are the collector's again. (Not `get_freeze_count() == 0`:
    # on CPython 3.12 a collection leaves a few hundred objects counted there with nothing
    # frozen at all.)
    assert any(o is ex.runner for o in gc.get_objects())

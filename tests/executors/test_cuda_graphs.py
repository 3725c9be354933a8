"""Decode steps through DecodeGraphs: padded static buffers and a scratch block.

On the CPU the graphs are not captured, but `run` executes the same padded forward
over the same buffers, so the padding rules (scratch block, positions, slots) are
checked in CI; the `gpu` tests capture and replay for real.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from executors.cuda_graphs import default_capture_sizes
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner
from tests.executors.harness import Driver, max_rel_error
from tests.executors.test_llm import hf_greedy, prompts
from tests.executors.tiny_models import TinyModel


def graph_runner(tiny: TinyModel, sizes: list[int], num_blocks: int = 64) -> ModelRunner:
    cfg = ModelConfig.from_dict(read_hf_config(tiny.path))
    model = load_model(tiny.path, cfg, dtype=torch.float32, device=torch.device("cpu"))
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        num_blocks,
        4,
        cfg.kv_entry_dim,
        torch.float32,
        torch.device("cpu"),
        scratch_block=True,
    )
    runner = ModelRunner(
        model, cache, EngineConfig(block_size=4, num_gpu_blocks=num_blocks), max_model_len=128
    )
    runner.enable_cuda_graphs(sizes, capture=False)
    return runner


def graph_calls(runner: ModelRunner) -> list[int]:
    """Record the batch size of every step that the graphs serve."""
    calls: list[int] = []
    graphs = runner.graphs
    assert graphs is not None
    run = graphs.run
    graphs.run = lambda ids, pos, tables, *f: calls.append(len(ids)) or run(ids, pos, tables, *f)
    return calls


def test_capture_sizes_cover_every_batch_up_to_the_maximum() -> None:
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(600)[-1] == 600
    assert sizes == sorted(set(sizes))


def test_padded_decode_matches_transformers_and_writes_only_the_scratch_block(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v3_mtp"]
    runner = graph_runner(tiny, sizes=[1, 4, 8])
    calls = graph_calls(runner)
    d = Driver(runner)
    for name, p in zip("abc", prompts(4, [9, 5, 14])):
        d.add(name, p)
    d.step({"a": 9, "b": 5, "c": 14})  # prefill: eager
    d.decode_all(5)  # 3 requests -> the size-4 buffers, one padding row
    d.step({"a": 1}, finished={"b", "c"})  # 1 request -> size 1, no padding
    assert calls == [3] * 5 + [1]
    assert max_rel_error(d, tiny.hf) < 1e-4
    # The scheduler's blocks past those the Driver handed out were never written.
    for layer in runner.kv_cache.layers:
        assert layer[d.next_block : runner.kv_cache.num_blocks].abs().sum() == 0
        assert layer[runner.kv_cache.scratch_block].abs().sum() > 0


def test_batches_larger_than_every_graph_and_prefill_steps_run_eagerly(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v3_plain"]
    runner = graph_runner(tiny, sizes=[2])
    calls = graph_calls(runner)
    d = Driver(runner)
    for name, p in zip("abc", prompts(5, [6, 7, 8])):
        d.add(name, p)
    d.step({"a": 6, "b": 7, "c": 8})
    d.decode_all(2)  # 3 > 2: eager
    d.step({"a": 1, "b": 1}, finished={"c"})  # graph of 2
    assert calls == [2]
    assert max_rel_error(d, tiny.hf) < 1e-4


def test_loaded_buffers_follow_each_row_s_table_with_shared_tables_and_device_ids(
    tiny_models: dict[str, TinyModel],
) -> None:
    """The static buffers a step loads: ids, positions, slots (page of the row's own
    table), seq lens, padding on the scratch block; tables shared by consecutive rows
    (`repeats`, the drafter's first pass) load as if listed per row, ids given as a
    device tensor land as the list would, and a position past its table is refused."""
    graphs = graph_runner(tiny_models["v3_plain"], sizes=[8]).graphs
    assert graphs is not None
    bs, scratch = graphs.block_size, graphs.scratch_block
    tables = [[5, 9], [7], [3, 4, 6]]
    positions = [4, 5, 2, 9, 10]  # rows: two of tables[0], one of [1], two of [2]
    per_row = [tables[0], tables[0], tables[1], tables[2], tables[2]]

    def snapshot() -> tuple[list[list[int]], list[list[int]]]:
        return graphs._rows[:, :8].tolist(), graphs.block_tables[:8, :3].tolist()

    assert graphs._load([11, 12, 13, 14, 15], positions, per_row) == 8
    listed = snapshot()
    ids = torch.tensor([11, 12, 13, 14, 15])
    assert graphs._load(ids, positions, tables, repeats=[2, 1, 2]) == 8
    assert snapshot() == listed
    rows, table = listed
    assert rows[0][:5] == [11, 12, 13, 14, 15]
    assert rows[1] == positions + [0, 0, 0]
    assert (
        rows[2] == [9 * bs + 0, 9 * bs + 1, 7 * bs + 2, 6 * bs + 1, 6 * bs + 2] + [scratch * bs] * 3
    )
    assert rows[3] == [5, 6, 3, 10, 11, 1, 1, 1]
    assert table[:5] == [[5, 9, scratch], [5, 9, scratch], [7, scratch, scratch]] + [[3, 4, 6]] * 2
    assert table[5:] == [[scratch] * 3] * 3
    with pytest.raises(ValueError, match="past its request's block table"):
        graphs._load([1], [bs], [[7]])


def test_cpu_runner_refuses_to_capture(tiny_models: dict[str, TinyModel]) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graph_runner(tiny_models["v3_plain"], sizes=[1]).enable_cuda_graphs([1], capture=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_generates_what_eager_decode_generates(
    tiny_models: dict[str, TinyModel], dtype: str
) -> None:
    """Greedy outputs of 5 requests (batches 5..1 as they finish, padded) with graphs on
    equal eager CUDA's; in float32 also transformers'."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(6, [7, 13, 3, 9, 20])
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 8, 16, 30, 12)
    ]
    outs = {}
    for eager in (False, True):
        llm = LLM(
            str(tiny.path),
            device="cuda",
            dtype=dtype,
            block_size=16,
            enforce_eager=eager,
            max_num_seqs=8,
        )
        assert (llm.executor.runner.graphs is None) == eager
        res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in res]
        llm.executor.shutdown()
    if dtype == "float32":
        assert outs[False] == outs[True]
        for p, sp, got in zip(batch, params, outs[False]):
            assert got == hf_greedy(tiny, p, sp.max_tokens)
    else:  # bf16: rounding may flip a near-tie late in a sequence; the starts agree
        assert all(g[:4] == e[:4] for g, e in zip(outs[False], outs[True]))


def test_the_simulators_graph_rows_are_the_runners_capture_sizes() -> None:
    """sim/profile_fit.py `graph_batch` restates the capture sizes of an engine of
    max_num_seqs 256 (the simulator cannot import executors): the smallest one holding
    a batch, the rows a decode step replays."""
    from sim.profile_fit import graph_batch

    sizes = default_capture_sizes(256)
    for n in range(1, 257):
        assert graph_batch(n) == min(s for s in sizes if s >= n), n

"""Prefill and mixed steps through PiecewiseGraphs: the forward cut at attention, padded
to a token bucket, pads writing only the scratch block.

On the CPU the pieces are not captured, but `run` executes the same padded pieces over
the same buffers, so the padding rules are checked in CI; the `gpu` test captures them.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from executors.model_runner import ModelRunner
from executors.piecewise_graphs import default_token_buckets
from tests.executors.harness import Driver, max_rel_error
from tests.executors.test_cuda_graphs import graph_runner
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel


def piecewise_calls(runner: ModelRunner) -> list[int]:
    """Record the token count of every step the piecewise graphs serve."""
    calls: list[int] = []
    pw = runner.piecewise
    assert pw is not None
    run = pw.run
    pw.run = lambda ids, pos, slots, md, *f: calls.append(len(ids)) or run(ids, pos, slots, md, *f)
    return calls


def test_token_buckets_cover_every_count_up_to_the_limit() -> None:
    small = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536]
    assert default_token_buckets(16384) == small + list(range(2048, 8193, 512))
    assert default_token_buckets(3000) == small + [2048, 2560, 3000]
    assert default_token_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert default_token_buckets(16) == [16]


def test_mixed_steps_match_transformers_and_pads_write_only_the_scratch_block(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Prompt chunks beside decodes, a larger step then a smaller one in the same bucket
    (stale rows of the buffers must not leak into the smaller step), a chunk continuing
    over its own cached context, and a step past the largest bucket (eager)."""
    tiny = tiny_models["v3_mtp"]
    runner = graph_runner(tiny, sizes=[1, 4], num_blocks=96)
    runner.enable_cuda_graphs([1, 4], capture=False, token_buckets=[8, 32])
    calls = piecewise_calls(runner)
    d = Driver(runner)
    for name, p in zip("abcd", prompts(7, [20, 9, 30, 40])):
        d.add(name, p)
    d.step({"a": 20, "b": 9})  # 29 tokens -> bucket 32, 3 pad rows
    d.step({"a": 1, "b": 1, "c": 5})  # 7 -> bucket 8; c's first chunk beside decodes
    d.step({"a": 1, "c": 25})  # 26 -> 32: c continues over its 5 cached tokens
    d.step({"a": 1, "b": 1, "c": 1, "d": 40})  # 43 > 32: eager
    d.step({"a": 1, "b": 1, "c": 1, "d": 1})  # pure decode: the decode graphs
    d.step({"b": 1, "d": 1})
    assert calls == [29, 7, 26]
    assert max_rel_error(d, tiny.hf) < 1e-4
    for layer in runner.kv_cache.layers:
        assert layer[d.next_block : runner.kv_cache.num_blocks].abs().sum() == 0
        assert layer[runner.kv_cache.scratch_block].abs().sum() > 0


@pytest.mark.gpu
def test_piecewise_graphs_generate_what_eager_steps_generate(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Chunked prompts beside decodes (small token budget: every step is mixed), float32
    on CUDA: graphs on and off give the same greedy tokens, and the graphs served steps."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(8, [37, 13, 50, 9, 64, 21])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(
            str(tiny.path),
            device="cuda",
            dtype="float32",
            block_size=16,
            enforce_eager=eager,
            max_num_seqs=8,
            max_num_batched_tokens=48,
            enable_chunked_prefill=True,
        )
        runner = llm.executor.runner
        assert (runner.piecewise is None) == eager
        calls = [] if eager else piecewise_calls(runner)
        res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in res]
        assert eager or len(calls) > 3
        llm.executor.shutdown()
    assert outs[False] == outs[True]


@pytest.mark.parametrize("max_tokens", [1024, 4096, 8192, 16384])
def test_the_simulators_token_bucket_is_the_runners(max_tokens) -> None:
    """sim/profile_fit.py `token_bucket` restates the runner's buckets (the simulator
    cannot import executors): the rows a step of each token count replays, up to the top
    bucket (a profile's piecewise_max_tokens)."""
    from sim.profile_fit import token_bucket

    buckets = default_token_buckets(max_tokens)
    for tokens in range(1, buckets[-1] + 1):
        want = min(b for b in buckets if b >= tokens)
        assert token_bucket(tokens, buckets[-1]) == want, tokens

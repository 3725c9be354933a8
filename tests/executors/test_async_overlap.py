"""Async scheduling on the real executor: step N+1 is launched before step N is read,
its requests taking N's sampled tokens on the device (ModelRunner.launch).

The same outputs as without it; the overlap really happens (deferred input ids), for
verify steps too (tests/executors/test_spec_chain.py has more); and what needs N's
tokens on the host (seeds, penalties, min_tokens) is served by finishing N first, with
the same outputs again.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import SchedulerOutput
from executors.model_runner import ModelRunner
from tests.executors.harness import load_runner
from tests.executors.test_cuda_graphs import graph_runner
from tests.executors.test_llm import hf_greedy, prompts
from tests.executors.test_torch_executor import _decode_step, _prompt_step
from tests.executors.tiny_models import TinyModel

GREEDY_10 = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _cpu_llm(tiny: TinyModel, **engine: object) -> LLM:
    """The tiny model in float32 on the CPU, 4-token blocks, `engine` settings on top."""
    return LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4, **engine)


def _count_deferred(llm: LLM) -> list[int]:
    """Per launched step, how many input ids came from the step before on the device."""
    runner: ModelRunner = llm.executor.runner  # type: ignore[attr-defined]
    counts: list[int] = []
    collect = runner.inputs.collect

    def spy(scheduled, prev=None, *, drafting):  # type: ignore[no-untyped-def]
        host = collect(scheduled, prev, drafting=drafting)
        counts.append(len(host.deferred))
        return host

    runner.inputs.collect = spy  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize(
    ("graphs", "mixed"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["eager", "eager-mixed", "decode-graphs", "piecewise"],
)
def test_launch_reads_the_tokens_of_the_step_in_flight_on_the_device(
    tiny_models: dict[str, TinyModel], graphs: bool, mixed: bool
) -> None:
    """Two steps launched back to back, the first unread: the second's input is the
    first's sampled token (on every forward path: eager, the decode graphs, the piecewise
    graphs beside a prompt), and reading both gives the sequential runner's tokens."""
    tiny = tiny_models["v3_mtp"]
    prompt, other = prompts(4, [9, 5])
    want = hf_greedy(tiny, prompt, 3)
    if graphs:  # (not captured: the graphs' padded buffers, run eagerly)
        runner = graph_runner(tiny, sizes=[1, 2])
        runner.enable_cuda_graphs([1, 2], capture=False, token_buckets=[8, 32])
    else:
        runner = load_runner(tiny.path)
    first = runner.execute(SchedulerOutput(1, [_prompt_step("a", prompt, [0, 1, 2])]))
    assert first.sampled_token_ids["a"] == want[:1]
    n = len(prompt)
    second = runner.launch(SchedulerOutput(2, [_decode_step("a", n, want[0])]))
    third_step = [_decode_step("a", n + 1, None)]  # its token: the second step's
    if mixed:
        third_step.append(_prompt_step("b", other, [5, 6]))
    third = runner.launch(SchedulerOutput(3, third_step))
    assert not second.done() and not third.done()
    assert second.result().sampled_token_ids["a"] == want[1:2]
    sampled = third.result().sampled_token_ids
    assert sampled["a"] == want[2:3]
    if mixed:
        assert sampled["b"] == hf_greedy(tiny, other, 1)
    state = runner.requests["a"]
    assert state.sampling.output_token_ids == want and state.last_token == want[2]


def test_async_generate_overlaps_steps_and_matches_transformers(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v3_mtp"]
    batch = prompts(11, [7, 13, 5, 10])
    llm = _cpu_llm(tiny, async_scheduling=True)
    deferred = _count_deferred(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny, p, 12)
    # Every decode step after the first took its requests' ids from the step before.
    assert sum(1 for d in deferred if d == len(batch)) >= 10, deferred


@pytest.mark.parametrize(
    ("params", "overlaps"),
    [
        (dict(temperature=0.9, seq_seed=5), False),  # the seeded draw counts outputs
        (dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4), False),
        (dict(temperature=0.0, min_tokens=6, logprobs=2), True),  # once it has 6 outputs
    ],
    ids=["seeded", "penalties", "min-tokens-logprobs"],
)
def test_history_dependent_requests_give_the_same_outputs_with_async_scheduling(
    tiny_models: dict[str, TinyModel], params: dict, overlaps: bool
) -> None:
    """A step with a request whose sampler reads its own history is not overlapped (the
    step before is read first): the same tokens and logprobs with async scheduling as
    without, for it and for the greedy requests beside it."""
    tiny = tiny_models["v2_group"]
    batch = prompts(12, [6, 9, 4])
    sps = [
        SamplingParams(max_tokens=10, ignore_eos=True, **params),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7),
    ]
    results = []
    for async_ in (False, True):
        llm = _cpu_llm(tiny, async_scheduling=async_)
        deferred = _count_deferred(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sps, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, _logprobs(o.outputs[0].logprobs)) for o in outs])
        assert any(deferred) == (async_ and overlaps), deferred
    assert [tokens for tokens, _ in results[0]] == [tokens for tokens, _ in results[1]]
    for (_, want), (_, got) in zip(*results):  # (batches differ: float rounding too)
        assert [[(t, r) for t, _, r in row] for row in got] == [
            [(t, r) for t, _, r in row] for row in want
        ]
        assert [v for row in got for _, v, _ in row] == pytest.approx(
            [v for row in want for _, v, _ in row], abs=1e-5
        )


def _logprobs(rows: list[dict] | None) -> list[list[tuple[int, float, int]]]:
    return [sorted((t, lp.logprob, lp.rank) for t, lp in row.items()) for row in rows or []]


def test_verify_steps_with_rejections_chain_on_the_step_before(
    tiny_models: dict[str, TinyModel],
) -> None:
    """With an MTP drafter (random weights: most drafts are rejected) a verify step takes
    its newest token and drafts from the step in flight, moved back by what it rejected
    (executors/spec_chain.py): async scheduling still matches transformers' greedy."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(13, [8, 5])
    llm = _cpu_llm(tiny, async_scheduling=True, num_speculative_tokens=2)
    deferred = _count_deferred(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY_10, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny, p, 10)
    # Both requests' 1 + 2 ids came from the step before.
    assert sum(1 for d in deferred if d == 2 * 3) >= 4, deferred


@pytest.mark.gpu
def test_overlapped_steps_on_cuda_graphs_generate_what_sequential_steps_do(
    tiny_models: dict[str, TinyModel],
) -> None:
    """On CUDA with graphs (decode and piecewise, chunked prompts beside decodes), in
    float32: async scheduling overlaps steps and generates transformers' greedy tokens."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(14, [7, 30, 3, 19, 25])
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 9, 14)]
    sps += [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True), GREEDY_10]
    outs = {}
    for async_ in (False, True):
        llm = LLM(
            str(tiny.path),
            device="cuda",
            dtype="float32",
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            async_scheduling=async_,
        )
        assert llm.executor.runner.graphs is not None
        deferred = _count_deferred(llm)
        res = llm.generate([{"prompt_token_ids": p} for p in batch], sps, use_tqdm=False)
        outs[async_] = [o.outputs[0].token_ids for o in res]
        assert any(deferred) == async_
        llm.executor.shutdown()
    for i, (p, sp) in enumerate(zip(batch, sps)):
        if sp.temperature == 0.0:
            assert outs[True][i] == outs[False][i] == hf_greedy(tiny, p, sp.max_tokens)
        else:  # unseeded: another batch composition draws other noise
            assert len(outs[True][i]) == len(outs[False][i]) == sp.max_tokens


def test_a_failed_read_fails_the_step_launched_after_it_without_aborting_its_own_requests(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Step N's result fails when it is read (here: inside the launch of N+1, which wants
    prompt logprobs and so reads N first). N's requests end aborted with the error; a
    request only in N+1 is requeued and ends normally, and the runner keeps no step of
    theirs in flight."""
    tiny = tiny_models["v3_mtp"]
    llm = _cpu_llm(tiny, async_scheduling=True)
    runner: ModelRunner = llm.executor.runner  # type: ignore[attr-defined]
    finish = runner._finish
    calls = {"n": 0}

    def flaky(*args):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:  # N4, read inside the launch of N5 (c wants prompt logprobs)
            raise RuntimeError("transient read failure")
        return finish(*args)

    runner._finish = flaky  # type: ignore[method-assign]
    a, c = prompts(15, [6, 5])
    sps = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
    ]
    engine = llm.engine
    from deepinfer.request import Request

    engine.add_request(Request("a", a, sps[0]))
    for _ in range(3):  # a's prompt, then decodes launched before the last is read
        engine.step()
    engine.add_request(Request("c", c, sps[1]))
    while engine.has_unfinished():
        engine.step()
    by_id = {r.req_id: r for r in engine.records}
    assert by_id["a"].status == "aborted" and "transient read failure" in by_id["a"].reason
    assert by_id["c"].status == "finished" and by_id["c"].num_output_tokens == 3
    assert runner._pending is None or runner._pending.done()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_runner_drops_the_state_of_requests_that_ended_as_the_engine_drained(
    tiny_models: dict[str, TinyModel], async_scheduling: bool
) -> None:
    """The step that would announce the last requests' end is empty and never launched:
    the next launched step announces them, so the runner holds no state of a past wave."""
    from deepinfer.request import Request

    tiny = tiny_models["v3_mtp"]
    llm = _cpu_llm(tiny, async_scheduling=async_scheduling)
    runner: ModelRunner = llm.executor.runner  # type: ignore[attr-defined]
    engine = llm.engine
    for wave, lengths in enumerate(([5, 7], [6])):
        for i, p in enumerate(prompts(16 + wave, lengths)):
            engine.add_request(Request(f"w{wave}.{i}", p, GREEDY_10))
        while engine.has_unfinished():
            engine.step()
    assert not [rid for rid in runner.requests if rid.startswith("w0.")]


def test_a_step_that_cannot_overlap_is_launched_after_the_one_in_flight_is_applied(
    tiny_models: dict[str, TinyModel],
) -> None:
    """A prompt wanting prompt logprobs arrives while a plain decode runs: its step needs
    the host to have read the decode, so the engine applies the decode first and then
    launches it; every step's time is its own."""
    from deepinfer.request import Request

    tiny = tiny_models["v3_mtp"]
    llm = _cpu_llm(tiny, max_num_batched_tokens=256)
    engine = llm.engine
    engine.add_request(Request("a", prompts(17, [6])[0], GREEDY_10))
    for _ in range(3):
        engine.step()
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    engine.add_request(Request("p", prompts(18, [120])[0], sp))
    while engine.has_unfinished():
        engine.step()
    durations = {s.step_id: s.duration for s in engine.steps}
    # (Credited with the prompt's work, the decode before it left the prompt's step less
    # than none.)
    assert min(durations.values()) >= 0, durations


def test_on_a_cpu_each_step_is_timed_by_its_own_launch() -> None:
    """On a CPU the launch runs the step. A prompt step launched beside a decode in flight
    ran inside its launch, before the decode was read: the decode's recorded time took
    the prompt's work and the prompt's came out near zero (fidelity's per-step table read
    mixed steps +180% at p50). Each step's time is now its own launch."""
    from deepinfer.config import EngineConfig
    from deepinfer.engine import EngineCore
    from deepinfer.request import Request
    from executors.torch_executor import TorchExecutor

    cfg = EngineConfig(block_size=16, max_num_batched_tokens=2048, async_scheduling=True)
    executor = TorchExecutor(cfg, "deepinfer-demo", device="cpu")
    engine = EngineCore(cfg, executor, model_max_len=executor.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request(Request("short", [5, 7, 9, 11], params))
    for _ in range(4):
        engine.step()
    engine.add_request(Request("long", [13 + i % 50 for i in range(1500)], params))
    while engine.has_unfinished():
        engine.step()
    steps = engine.steps
    first = next(i for i, s in enumerate(steps) if s.num_prompt_tokens >= 1500)
    decodes = [s.duration for s in steps[2:first]]  # (the short prompt's step left out)
    assert steps[first].duration > 3 * max(decodes), [round(s.duration, 4) for s in steps]

"""Verify steps chained on the device under async scheduling (executors/spec_chain.py):
step N+1 is launched before N is read, takes its requests' newest tokens and drafts from
N on the device and moves their rows back by the drafts N rejected. Greedy output stays
token for token what sequential steps give, on every forward path (eager, the verify
and drafter graphs' buffers, the piecewise graphs), beside requests that cannot chain."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.demo import DEMO_MODEL_DIR
from executors.input_builder import HostBatch
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner
from executors.step_handle import PendingStep
from tests.executors.test_speculative_llm import CODE, _RunnerExecutor, needs_demo


def count_chained(runner: ModelRunner, rows: list[int] | None = None) -> list[int]:
    """Per step the runner builds from now on, how many input ids it took from a verify
    step in flight (0: it chained on none); `rows` gets each step's input ids."""
    chained: list[int] = []
    collect = runner.inputs.collect

    def spy(scheduled, prev=None, *, drafting) -> HostBatch:  # type: ignore[no-untyped-def]
        host = collect(scheduled, prev, drafting=drafting)
        chained.append(len(host.deferred) if host.rejected_index is not None else 0)
        if rows is not None:
            rows.append(len(host.input_ids))
        return host

    runner.inputs.collect = spy  # type: ignore[method-assign]
    return chained


class _AsyncRunnerExecutor(_RunnerExecutor):
    """A bare runner behind the executor contract, its steps launched (async scheduling)."""

    def execute_async(self, out: SchedulerOutput) -> PendingStep:
        return self.runner.launch(out)

    def can_overlap(self, out: SchedulerOutput) -> bool:
        return self.runner.can_overlap(out)

    def discard_pending(self) -> None:
        self.runner.discard_pending()


def _demo_runner(
    path: str, k: int, varlen: bool = False, **engine: int
) -> tuple[ModelRunner, EngineConfig]:
    """A CPU runner of the demo model with k drafts. path: "host" verifies and drafts on
    the host (the reference), "sync" on the device without async scheduling; "eager",
    "graphs" (decode, verify and drafter graphs) and "piecewise" with it."""
    cfg = ModelConfig.from_dict(read_hf_config(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, cfg, dtype=torch.float32, device=torch.device("cpu"))
    engine_cfg = EngineConfig(
        block_size=16, num_gpu_blocks=64, num_speculative_tokens=k, enable_mtp_varlen=varlen,
        async_scheduling=path not in ("sync", "host"), **engine,
    )  # fmt: skip
    cache = PagedKVCache(
        cfg.num_hidden_layers, 64, 16, cfg.kv_entry_dim, torch.float32, torch.device("cpu"),
        scratch_block=True, num_mtp_layers=1,
    )  # fmt: skip
    runner = ModelRunner(model, cache, engine_cfg, eos_token_id=1, max_model_len=512)
    if path == "host":  # the reference: verified and drafted from the host's view
        assert runner.speculator is not None
        runner.speculator.verifies_on_device = lambda out: False  # type: ignore[method-assign]
    if path == "graphs":  # (not captured: their padded buffers, run eagerly)
        runner.enable_cuda_graphs([1, 2, 4], capture=False)
    elif path == "piecewise":  # three requests exceed the largest decode graph
        runner.enable_cuda_graphs([1, 2], capture=False, token_buckets=[16, 64])
    return runner, engine_cfg


def _serve(
    runner: ModelRunner, engine_cfg: EngineConfig, params: list[SamplingParams]
) -> tuple[list[list[int]], list[int], int, int, dict]:
    """Outputs of CODE's prompts; per step, the input ids taken from the step in flight;
    drafts verified and accepted; the drafts proposed and their confidences, by request
    and output count."""
    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    chained = count_chained(runner)
    proposed: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    launch = runner.launch

    def spy_launch(out: SchedulerOutput) -> PendingStep:
        handle = launch(out)
        read = handle.step_result

        def step_result():  # type: ignore[no-untyped-def]
            res = read()
            for rid, drafts in res.output.draft_token_ids.items():
                state = runner.requests.get(rid)
                if state is not None:
                    conf = res.output.draft_confidences[rid]
                    proposed[rid, len(state.sampling.output_token_ids)] = (drafts, conf)
            return res

        handle.step_result = step_result  # type: ignore[method-assign]
        return handle

    runner.launch = spy_launch  # type: ignore[method-assign]
    ex = _AsyncRunnerExecutor(runner) if engine_cfg.async_scheduling else _RunnerExecutor(runner)
    engine = EngineCore(engine_cfg, ex, model_max_len=512)
    reqs = [Request(f"r{i}", tok.encode(c).ids, p) for i, (c, p) in enumerate(zip(CODE, params))]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    s = engine.scheduler
    _serve.logprobs = [r.logprobs for r in reqs]  # type: ignore[attr-defined]
    outs = [r.output_token_ids for r in reqs]
    return outs, chained, s.num_draft_tokens, s.num_accepted_drafts, proposed


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@needs_demo
@pytest.mark.parametrize("path", ["sync", "eager", "graphs", "piecewise"])
def test_chained_verify_steps_give_the_sequential_greedy_output(path: str) -> None:
    """Three requests, k = 3, against the engine verifying and drafting on the host: the
    same tokens, drafts (and their confidences) and acceptances; with async scheduling
    most decode steps chain on the step in flight, and drafts are both accepted and
    rejected (so rows really move)."""
    params = [GREEDY] * 3
    want, none, _, want_accepted, want_drafts = _serve(*_demo_runner("host", 3), params)
    assert not any(none)
    runner, engine_cfg = _demo_runner(path, 3)
    served: list[int] = []  # batch sizes the verify graphs (or piecewise tokens) served
    graphs = runner.verify_graphs if path == "graphs" else runner.piecewise
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda ids, *a: served.append(len(ids)) or run(ids, *a)  # type: ignore[method-assign]
    got, chained, drafted, accepted, drafts = _serve(runner, engine_cfg, params)
    assert (graphs is not None) == (path in ("graphs", "piecewise"))
    assert served.count(3 * 4) >= 8 or graphs is None, served  # 3 requests x (1 + 3)
    assert got == want
    assert (sum(1 for c in chained if c) >= 8) == (path != "sync"), chained
    # The drafter's rows moved too: it proposed what it proposes at the true positions.
    assert len(want_drafts) > 20
    for key, (ids, conf) in want_drafts.items():
        assert drafts[key][0] == ids and drafts[key][1] == pytest.approx(conf, abs=1e-5), key
    assert accepted == want_accepted
    assert 0 < accepted < drafted


@needs_demo
def test_requests_that_cannot_chain_end_the_chain_and_keep_their_output() -> None:
    """Beside greedy requests (varlen drafts), one with a repetition penalty needs its
    history on the host: the steps it joins read the step before first (no chain), and
    every output equals the host-verifying engine's."""
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3,
                                     ignore_eos=True), GREEDY, GREEDY]  # fmt: skip
    want, _, _, _, _ = _serve(*_demo_runner("host", 4, varlen=True), params)
    got, chained, _, _, _ = _serve(*_demo_runner("eager", 4, varlen=True), params)
    assert got == want
    assert any(chained) and not all(chained), chained


@needs_demo
def test_a_step_of_chained_and_unchained_requests_gives_the_sequential_output() -> None:
    """Varlen drafts under a token budget too small for every request each step: a
    request the step in flight did not run joins a chained step with ids the host knows
    (its rows stay where the scheduler put them) beside chained ones (moved back);
    outputs as the host engine's."""
    params = [GREEDY] * 4
    budget = dict(max_num_batched_tokens=10)
    want, _, _, _, _ = _serve(*_demo_runner("host", 3, varlen=True, **budget), params)
    runner, engine_cfg = _demo_runner("eager", 3, varlen=True, **budget)
    rows: list[int] = []
    chained = count_chained(runner, rows)
    got, _, _, _, _ = _serve(runner, engine_cfg, params)
    assert got == want
    mixed = [(c, n) for c, n in zip(chained, rows) if 0 < c < n]
    assert mixed, list(zip(chained, rows))


@pytest.mark.gpu
@needs_demo
def test_chained_verify_steps_on_cuda_graphs_give_the_host_paths_greedy_output() -> None:
    """On CUDA with every graph captured (decode, verify, piecewise, the drafter's), in
    float32: the async engine, whose verify steps chain on the step in flight, gives the
    greedy tokens of a synchronous engine verifying and drafting on the host."""
    from deepinfer import LLM

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs, accepted = {}, {}
    for path in ("host", "chained"):
        llm = LLM(
            str(DEMO_MODEL_DIR), device="cuda", dtype="float32", block_size=16,
            num_speculative_tokens=3, async_scheduling=path == "chained",
        )  # fmt: skip
        runner = llm.executor.runner  # type: ignore[attr-defined]
        speculator = runner.speculator
        assert runner.verify_graphs is not None and speculator.drafter.graphs is not None
        if path == "host":
            speculator.verifies_on_device = lambda out: False
        chained = count_chained(runner)
        outs[path] = [o.outputs[0].token_ids for o in llm.generate(CODE, params, use_tqdm=False)]
        accepted[path] = llm.engine.scheduler.num_accepted_drafts
        assert (sum(1 for c in chained if c) >= 10) == (path == "chained"), chained
        llm.executor.shutdown()  # the next engine takes 0.9 of the device too
    assert outs["chained"] == outs["host"]
    assert accepted["chained"] == pytest.approx(accepted["host"], rel=0.1)


@needs_demo
def test_chained_steps_return_the_logprobs_the_host_path_returns() -> None:
    """Requests asking for logprobs chain too: each output token's logprob, rank and
    top-3 (read back with the step's one copy) equal the host verification's."""
    lp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    params = [lp, GREEDY, lp]
    want, _, _, _, _ = _serve(*_demo_runner("host", 3), params)
    want_lp = _serve.logprobs  # type: ignore[attr-defined]
    got, chained, _, _, _ = _serve(*_demo_runner("eager", 3), params)
    got_lp = _serve.logprobs  # type: ignore[attr-defined]
    assert got == want and sum(1 for c in chained if c) >= 8, chained
    for i in (0, 2):  # (one row an output token)
        a, b = got_lp[i], want_lp[i]
        assert len(a) == len(b) == len(got[i])
        for row_a, row_b in zip(a, b):  # the chosen token, then the top 3
            assert [(x.token_id, x.rank) for x in row_a] == [(x.token_id, x.rank) for x in row_b]
            assert [x.logprob for x in row_a] == pytest.approx([x.logprob for x in row_b], abs=1e-5)


@needs_demo
def test_steps_with_prompt_chunks_verify_on_the_device_and_chain() -> None:
    """Chunked prompts beside decoding requests (a 24-token budget, staggered prompts):
    steps that carry a prompt chunk verify and draft on the device too (the chunk's rows
    take their next ids from the step's own input, its last chunk its sampled token, a
    chunk that does not sample leaves its last position pending), chain on the step in
    flight, and give the host path's tokens, drafts and confidences."""
    budget = dict(max_num_batched_tokens=24)
    params = [GREEDY] * 4
    want, _, _, _, want_drafts = _serve(*_demo_runner("host", 3, **budget), params)
    runner, engine_cfg = _demo_runner("eager", 3, **budget)
    kinds: list[tuple[bool, bool]] = []  # per step: chained, carries a prompt chunk
    collect = runner.inputs.collect

    def spy(scheduled, prev=None, *, drafting) -> HostBatch:  # type: ignore[no-untyped-def]
        host = collect(scheduled, prev, drafting=drafting)
        kinds.append((host.rejected_index is not None, host.num_decode < len(host.req_ids)))
        return host

    runner.inputs.collect = spy  # type: ignore[method-assign]
    got, _, _, _, drafts = _serve(runner, engine_cfg, params)
    assert got == want
    assert (True, True) in kinds, kinds  # a chained step with a prompt chunk in it
    # (where both proposed: the two schedules may verify at different output counts)
    common = want_drafts.keys() & drafts.keys()
    assert len(common) >= 20
    for key in common:
        ids, conf = want_drafts[key]
        assert drafts[key][0] == ids and drafts[key][1] == pytest.approx(conf, abs=1e-5), key

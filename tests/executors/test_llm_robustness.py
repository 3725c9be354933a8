"""Nothing a user types breaks the engine, and the offline API speaks vLLM's names."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import RequestFailed
from tests.executors.test_llm import GREEDY, hf_greedy, prompts
from tests.executors.tiny_models import TinyModel


@pytest.fixture
def llm(tiny_models: dict[str, TinyModel]) -> LLM:
    return LLM(
        str(tiny_models["v2_group"].path),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
    )


def test_a_token_id_outside_the_vocabulary_is_a_clear_error_and_the_llm_goes_on(
    llm: LLM, tiny_models: dict[str, TinyModel]
) -> None:
    good = prompts(1, [6])[0]
    with pytest.raises(ValueError, match=r"prompt 1: token id 1000000000 is outside"):
        llm.generate([good, [10**9]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing of the bad call was queued
    out = llm.generate([good], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_models["v2_group"], good, 24)


def test_a_request_whose_work_fails_ends_alone_and_the_others_are_unchanged(
    llm: LLM, tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = prompts(2, [5, 9, 7])
    runner = llm.executor.runner
    real_check = runner.inputs._check
    calls = {"n": 0}

    def check(scheduled):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        failed = real_check(scheduled)
        if calls["n"] == 3 and any(sr.req_id == "1" for sr in scheduled):
            failed["1"] = "injected: the device rejected this request's work"
        return failed

    monkeypatch.setattr(runner.inputs, "_check", check)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "abort" and "injected" in (outs[1].error or "")
    for i in (0, 2):
        assert outs[i].outputs[0].token_ids == hf_greedy(tiny_models["v2_group"], batch[i], 24)
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    assert issubclass(RequestFailed, RuntimeError)


def test_an_interrupted_generate_leaves_the_llm_usable(
    llm: LLM, tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step, calls = llm.engine.step, {"n": 0}

    def step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    batch = prompts(3, [6, 8])
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(tiny_models["v2_group"], p, 24) for p in batch
    ]


def test_n_completions_seeds_and_metrics(llm: LLM) -> None:
    p = {"prompt_token_ids": prompts(4, [7])[0]}
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True, seed=11)
    a = llm.generate(p, sp, use_tqdm=False)[0]
    b = llm.generate(p, sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the completions differ
    greedy = llm.generate(
        p, SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    m = a.metrics
    assert m is not None and m.finished_time is not None and m.first_token_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_in_queue is not None and m.time_in_queue >= 0
    assert a.outputs[0].cumulative_logprob is None  # only with logprobs, as in vLLM


def test_unsupported_vllm_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=4)
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="logprobs=21"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="seed=1 and seq_seed=2"):
        SamplingParams(seed=1, seq_seed=2)
    assert SamplingParams(seq_seed=5).seed == 5 and SamplingParams(seed=5).seq_seed == 5


def test_prompt_logprobs_match_transformers_across_chunks_and_cache_hits(
    llm: LLM, tiny_models: dict[str, TinyModel]
) -> None:
    """Every prompt position p > 0 gets log P(token p | tokens < p), also where a chunk
    boundary falls between them (16-token chunks) and when the prompt is cached."""
    import torch

    tiny = tiny_models["v2_group"]
    prompt = prompts(9, [37])[0]
    with torch.no_grad():
        ref = tiny.hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [37, vocab]
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    for _ in range(2):  # the second time the prompt is in the prefix cache
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        for p in range(1, len(prompt)):
            row = lps[p]
            assert row is not None and prompt[p] in row and len(row) <= 4
            assert row[prompt[p]].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
            top = max(row.values(), key=lambda lp: lp.logprob)
            assert top.rank == 1
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].prompt_logprobs is None

"""`LLM(..., disaggregate="1P1D")`: a prefill engine and a decode engine in one process
behind the routers, each request's prompt KV handed over in memory (CPU). Greedy outputs
are the tokens one engine gives, through chunked prefill, prefix caching, async
scheduling, MTP drafts and a decode cache so small that requests queue and are
preempted (a preempted decode request recomputes)."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.disaggregated_engine import DisaggregatedEngine, parse_disaggregation
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _batch() -> list[list[int]]:
    """Shared prefixes (prefix hits on both engines), prompts over several chunks of 8
    tokens, and a one-token prompt (nothing to hand over but its place)."""
    base = prompts(1, [13])[0]
    return [base, base + prompts(2, [9])[0], *prompts(3, [30, 4, 1, 17]), base + [7]]


@pytest.mark.parametrize(
    ("model", "engine_args"),
    [
        ("v3_plain", dict(max_num_batched_tokens=8)),
        ("v3_plain", dict(max_num_batched_tokens=8, async_scheduling=True)),
        ("v3_plain", dict(max_num_batched_tokens=8, num_gpu_blocks=16)),
        ("v3_mtp", dict(max_num_batched_tokens=16, num_speculative_tokens=2)),
    ],
    ids=["chunked", "async", "small-cache", "mtp"],
)
def test_1p1d_greedy_outputs_are_one_engines(
    tiny_models: dict[str, TinyModel], model: str, engine_args: dict
) -> None:
    path = str(tiny_models[model].path)
    args = dict(device="cpu", dtype="float32", block_size=4, check_invariants=True, **engine_args)
    batch = [{"prompt_token_ids": p} for p in _batch()]
    want = LLM(path, **args).generate(batch, GREEDY, use_tqdm=False)
    llm = LLM(path, disaggregate="1P1D", **args)
    got = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    engine = llm.engine
    assert isinstance(engine, DisaggregatedEngine)
    assert engine.num_handovers == len(batch) and not engine.requests
    (prefill,), (decode,) = engine.prefill.engines, engine.decode.engines
    transfer = decode.executor.runner.kv_transfer
    # The decode engine's prefix hits were not imported again; nothing is left pending.
    assert transfer.num_imported_tokens < sum(len(p["prompt_token_ids"]) - 1 for p in batch)
    assert transfer.num_pending == 0 and not decode.scheduler.kv.req_blocks
    assert not prefill.scheduler.kv.req_blocks and not prefill.has_unfinished()
    if "num_gpu_blocks" in engine_args:  # requests queued on the decode engine
        assert max(s.num_waiting for s in decode.steps) > 0
        assert decode.scheduler.num_preemptions > 0
    llm.shutdown()


def test_a_request_its_first_token_ends_is_not_handed_over(
    tiny_models: dict[str, TinyModel],
) -> None:
    """max_tokens=1: the prefill engine's token is the whole output, as one engine's."""
    path = str(tiny_models["v3_plain"].path)
    args = dict(device="cpu", dtype="float32", block_size=4)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(4, [6, 9])]
    want = LLM(path, **args).generate(batch, one, use_tqdm=False)
    llm = LLM(path, disaggregate="1P1D", **args)
    got = llm.generate(batch, one, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert isinstance(llm.engine, DisaggregatedEngine) and llm.engine.num_handovers == 0


def test_options_a_disaggregated_llm_cannot_serve_are_refused_by_name(
    tiny_models: dict[str, TinyModel],
) -> None:
    path = str(tiny_models["v3_plain"].path)
    with pytest.raises(ValueError, match="disaggregate='2P': expected"):
        LLM(path, device="cpu", disaggregate="2P")
    with pytest.raises(ValueError, match="role='prefill': disaggregate sets each"):
        LLM(path, device="cpu", disaggregate="1P1D", role="prefill")
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, disaggregate="1p1d")
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(prompts(5, [6]), SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="so_args: structured outputs are not supported by"):
        llm.generate(
            prompts(5, [6]),
            SamplingParams(so_args={"schema_type": "regex", "schema": "a+"}),
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished()
    assert parse_disaggregation("2P3D") == (2, 3)


def test_a_request_whose_kv_import_fails_ends_aborted_and_frees_everything(
    tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handover whose KV cannot be the decode engine's (here: one layer short) aborts
    that request with the reason; the others are served, and no engine holds a block."""
    path = str(tiny_models["v3_plain"].path)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, disaggregate="1P1D")
    engine = llm.engine
    assert isinstance(engine, DisaggregatedEngine)
    prefill = engine.prefill.engines[0].executor
    export = prefill.export_kv

    def short_export(request, num_tokens):  # type: ignore[no-untyped-def]
        kv = export(request, num_tokens)
        if request.request_id != "1":
            return kv
        return dataclasses.replace(kv, kv=kv.kv[:, 1:])

    monkeypatch.setattr(prefill, "export_kv", short_export)
    outs = llm.generate(prompts(6, [9, 7, 5]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "length"]
    assert "KV import: request '1': imported KV of shape" in (outs[1].error or "")
    assert not outs[1].outputs[0].token_ids and engine.num_handovers == 2
    for e in engine.engines:
        assert not e.scheduler.kv.req_blocks and not e.has_unfinished()
    assert engine.decode.router.outstanding == [0] and engine.prefill.router.outstanding == [0]

"""LLM(..., data_parallel_size=N, enable_expert_parallel=True) on tiny checkpoints: N
spawned ranks over gloo, each with its own scheduler and KV cache, the MoE experts
sharded over them; greedy outputs equal one process's."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from executors.torch_executor import TorchExecutor
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel

ARGS = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)


def _generate(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def _one_process(tiny: TinyModel, batch: list[list[int]], params: list[SamplingParams]) -> list:
    llm = LLM(str(tiny.path), **ARGS)  # type: ignore[arg-type]
    return [o.outputs[0].token_ids for o in _generate(llm, batch, params)]


def test_two_expert_parallel_ranks_equal_one_process(tiny_models: dict[str, TinyModel]) -> None:
    """Five requests over two ranks (chunked prefills beside decodes, scheduler invariants
    checked on both every step); the 1-token request's rank goes idle while the other
    still decodes, and keeps joining the MoE exchange until the end."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(5, [7, 13, 5, 11, 4])
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in [1, 20, 8, 12, 3]
    ]
    want = _one_process(tiny, batch, params)
    llm = LLM(str(tiny.path), data_parallel_size=2, enable_expert_parallel=True,
              check_invariants=True, **ARGS)  # type: ignore[arg-type]  # fmt: skip
    try:
        outs = _generate(llm, batch, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
        short, longest = outs[0].metrics, outs[1].metrics
        assert short.finished_time < longest.first_token_time + 1e9  # (both set)
        assert short.finished_time < longest.last_token_time
        with pytest.raises(ValueError, match="structured outputs are not supported"):
            llm.generate([1, 2, 3], SamplingParams(so_args={"schema_type": "regex", "schema": "a"}))
        again = _generate(llm, batch[:2], params[:2])  # the ranks serve a second batch
        assert [o.outputs[0].token_ids for o in again] == want[:2]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "engine",
    [
        dict(num_speculative_tokens=3, max_model_len=40),
        dict(num_speculative_tokens=4, enable_mtp_varlen=True),
    ],
    ids=["k3-up-to-max-model-len", "varlen4"],
)
def test_expert_parallel_ranks_draft_in_lockstep_and_equal_one_process_without_drafts(
    tiny_models: dict[str, TinyModel], engine: dict[str, object]
) -> None:
    """MTP drafts over two expert-parallel ranks (the MTP layer's experts sharded too):
    greedy outputs are one process's without speculation. The ranks' draft depths
    differ from step to step: a 30-token prompt's chunks (pass 1 only) beside the other
    rank's drafts, chains cut where max_model_len leaves no lookahead slot, varlen
    lengths chosen per rank, a rank whose requests ended, and a second batch of one
    request (the other rank has none and pads every pass)."""
    tiny = tiny_models["v3_mtp"]
    batch = prompts(5, [7, 30, 5, 11, 4, 9])
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in [1, 20, 8, 12, 3, 6]
    ]
    limit = {"max_model_len": engine["max_model_len"]} if "max_model_len" in engine else {}
    llm = LLM(str(tiny.path), **ARGS, **limit)  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids for o in _generate(llm, batch, params)]
    llm.shutdown()
    llm = LLM(str(tiny.path), data_parallel_size=2, enable_expert_parallel=True,
              check_invariants=True, **ARGS, **engine)  # type: ignore[arg-type]  # fmt: skip
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, batch, params)] == want
        again = _generate(llm, batch[1:2], params[1:2])
        assert [o.outputs[0].token_ids for o in again] == want[1:2]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("name", "ranks", "ep"), [("v2_group", 4, True), ("v3_plain", 2, False)],
    ids=["4-ranks-expert-parallel", "2-ranks-replicated-experts"],
)  # fmt: skip
def test_data_parallel_ranks_equal_one_process(
    tiny_models: dict[str, TinyModel], name: str, ranks: int, ep: bool
) -> None:
    tiny = tiny_models[name]
    batch = prompts(6, [9, 4, 12, 6, 3, 10])
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in [6, 2, 9, 4, 7, 5]
    ]
    want = _one_process(tiny, batch, params)
    llm = LLM(str(tiny.path), data_parallel_size=ranks, enable_expert_parallel=ep,
              check_invariants=True, **ARGS)  # type: ignore[arg-type]  # fmt: skip
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, batch, params)] == want
    finally:
        llm.shutdown()


def test_unsupported_layouts_are_refused_before_any_rank_starts(
    tiny_models: dict[str, TinyModel],
) -> None:
    path = str(tiny_models["v3_mtp"].path)  # 8 routed experts
    with pytest.raises(ValueError, match="8 routed experts do not split evenly over 3 ranks"):
        LLM(path, data_parallel_size=3, enable_expert_parallel=True, **ARGS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="executor='sim'.*torch executor only"):
        LLM(path, executor="sim", data_parallel_size=2)
    with pytest.raises(ValueError, match="a TorchExecutor is one rank"):
        TorchExecutor(EngineConfig(data_parallel_size=2), path, device="cpu")
    # (it was each rank's RuntimeError, "rank 0 failed to start", once they had spawned)
    with pytest.raises(ValueError, match="revision='v2': .*hub"):
        LLM(path, data_parallel_size=2, revision="v2", **ARGS)  # type: ignore[arg-type]


def test_generate_cli_over_two_expert_parallel_ranks_prints_what_one_process_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`deepinfer generate --data-parallel-size 2 --expert-parallel` on the demo model."""
    from deepinfer.entrypoints.cli import main

    args = ["generate", "--device", "cpu", "--temperature", "0", "--max-tokens", "8"]
    args += ["Hello there", "The capital of"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--data-parallel-size", "2", "--expert-parallel"]) == 0
    assert capsys.readouterr().out == one

"""Options the offline API accepts take effect, or are refused by name (never accepted
and then ignored): `priority` per prompt under the priority policy, stop strings, which
need a tokenizer, the decode role without the KV it imports, and the simulator as the offline API's executor."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel


def test_priority_per_prompt_orders_the_requests_and_needs_the_priority_policy(
    tiny_models: dict[str, TinyModel],
) -> None:
    """One request at a time: they start in priority order (lower first, as vLLM), not
    in submission order; without policy='priority' a priority is refused."""
    path = str(tiny_models["v3_plain"].path)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_seqs=1,
              policy="priority")  # fmt: skip
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts(3, [5, 6, 7]), params, priority=[2, 0, 1], use_tqdm=False)
    started = [o.metrics.first_scheduled_time for o in outs if o.metrics is not None]
    assert sorted(range(3), key=lambda i: started[i]) == [1, 2, 0]
    with pytest.raises(ValueError, match="priority: 2 values for 3 prompts"):
        llm.generate(prompts(3, [5, 6, 7]), params, priority=[0, 1], use_tqdm=False)
    fcfs = LLM(path, device="cpu", dtype="float32", block_size=4)
    with pytest.raises(ValueError, match="policy='priority'"):
        fcfs.generate(prompts(3, [5]), params, priority=[1], use_tqdm=False)


def test_stop_strings_without_a_tokenizer_are_refused(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["v3_plain"]
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\[.ab.\]: .* no tokenizer"):
        llm.generate(prompts(3, [5]), SamplingParams(stop=["ab"]), use_tqdm=False)


def test_a_decode_engines_request_whose_kv_never_arrived_ends_aborted_naming_it(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Its prompt counts as cached, but nothing imported its KV: it would decode from
    blocks nothing wrote, so it ends aborted with the reason (the disaggregated engine
    imports the KV: tests/executors/test_disaggregated_llm.py)."""
    llm = LLM(str(tiny_models["v3_plain"].path), device="cpu", dtype="float32", role="decode")
    (out,) = llm.generate(prompts(3, [5]), SamplingParams(max_tokens=3), use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
    assert "prompt's KV never arrived" in (out.error or "")


@pytest.mark.parametrize("model", ["tiny", "deepinfer-demo", "moonlight-16b-a3b"])
def test_a_revision_of_a_model_with_one_version_is_refused(
    model: str, tiny_models: dict[str, TinyModel]
) -> None:
    """revision picks a version of a hub repository; a local folder, the demo model or a
    preset has one, and the revision was accepted and then ignored."""
    name = str(tiny_models["v3_plain"].path) if model == "tiny" else model
    with pytest.raises(ValueError, match="revision='v2': .*hub"):
        LLM(name, device="cpu", load_format="dummy", revision="v2")


def test_the_simulator_is_not_an_offline_api_executor(tiny_models: dict[str, TinyModel]) -> None:
    """It was a TypeError from deep inside (SimExecutor takes no dtype)."""
    with pytest.raises(ValueError, match="executor='sim'.*deepinfer simulate"):
        LLM(str(tiny_models["v3_plain"].path), executor="sim")


def test_generate_prints_the_logprobs_it_was_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """`deepinfer generate --logprobs 2` computed them and printed nothing: now one line a
    generated token (its logprob, then the top 2) and the cumulative logprob."""
    from deepinfer.entrypoints.cli import main

    args = ["generate", "--device", "cpu", "--temperature", "0", "--max-tokens", "4", "Hello"]
    assert main([*args, "--logprobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tokens = [line for line in lines if line.startswith("  [")]
    assert len(tokens) == 4 and all("(rank " in line for line in tokens)
    assert all(len(line.split("top: ")[1].split(", ")) == 2 for line in tokens)  # the top 2
    assert any(line.startswith("  cumulative logprob -") for line in lines)
    assert main(args) == 0
    assert "cumulative logprob" not in capsys.readouterr().out

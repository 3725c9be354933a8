"""The offline API on tiny checkpoints: the shared scheduler driving the real model.

Each test goes through `LLM.generate` (engine, scheduler, model runner, sampler,
detokenizer), against transformers' greedy `generate` on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.executors.tiny_models import TinyModel


def hf_greedy(tiny: TinyModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ref = tiny.hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return ref[0, len(prompt) :].tolist()


def prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=8),  # chunked prefill alongside decodes
        dict(max_num_batched_tokens=8, async_scheduling=True),
        dict(num_gpu_blocks=12, max_num_batched_tokens=64),  # too few blocks: preemption
    ],
    ids=["chunked", "async", "preempting"],
)
def test_generate_matches_transformers_greedy(
    tiny_models: dict[str, TinyModel], engine_args: dict
) -> None:
    tiny = tiny_models["v3_mtp"]
    base = prompts(1, [7, 13])[0]
    batch = [base, base + prompts(2, [5])[0], *prompts(3, [11, 4])]  # a shared prefix
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(tiny, p, 24)
    if "num_gpu_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.scheduler.kv.num_hit_tokens > 0  # the shared prefix was reused


def test_logprobs_and_seeded_sampling(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["v2_group"]
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4)
    p = prompts(5, [9])[0]
    sp = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, logprobs=2, seq_seed=7
    )
    a = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0]
    others = [{"prompt_token_ids": q} for q in prompts(6, [3, 12])]
    outs = llm.generate(
        [*others, {"prompt_token_ids": p}],
        [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4), sp],
        use_tqdm=False,
    )
    b = outs[2].outputs[0]
    assert a.token_ids == b.token_ids  # seq_seed: independent of the batch
    for other in outs[:2]:  # companions that asked for none get none (vLLM: None)
        assert other.outputs[0].logprobs is None, other.outputs[0].logprobs
        assert other.outputs[0].cumulative_logprob is None
    assert a.logprobs is not None and len(a.logprobs) == 6
    for tok, lps in zip(a.token_ids, a.logprobs):  # vLLM's shape: {token_id: Logprob}
        assert tok in lps and lps[tok].logprob <= 0.0 and 2 <= len(lps) <= 3
        ranks = sorted(lp.rank for t, lp in lps.items() if t != tok or lp.rank <= 2)
        assert ranks[:2] == [1, 2]
    assert a.cumulative_logprob == pytest.approx(
        sum(lps[t].logprob for t, lps in zip(a.token_ids, a.logprobs))
    )


def test_too_long_prompt_is_rejected_with_both_sizes(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["v2_group"]
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=8)
    ok, too_long = prompts(8, [5, 40])
    outs = llm.generate(
        [{"prompt_token_ids": ok}, {"prompt_token_ids": too_long}],
        SamplingParams(max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "rejected"
    assert "40 tokens" in outs[1].error and "8 blocks" in outs[1].error


def test_bad_input_names_the_field_or_file(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(tiny_models["v2_group"].path), device="cpu", blok_size=4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), device="cpu")


def test_stop_strings_truncate_the_text(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary gives every token a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tiny = tiny_models["v2_group"]
    model_dir = tmp_path / "with_tokenizer"
    model_dir.mkdir()
    for f in tiny.path.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=4)
    free = llm.generate("w5 w9 w17 w33", GREEDY, use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    assert len(words) == 24
    stop = words[5]
    first = words.index(stop)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate("w5 w9 w17 w33", sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text.split() == words[:first]

"""Batch-invariant mode end to end, through LLM (EngineConfig.batch_invariant).

On the GPU, a tiny random-weight DeepSeek V3 in bf16 (head dims the Triton kernels take):
one request alone, beside 7 and 63 companions, with its prompt chunked at 16 tokens, and
after prefix-cache hits gives the same token ids and the same logprobs, bit for bit,
greedy and seeded; the same runs in normal mode document where they differ. On the CPU
the mode is refused with a clear error. tests/executors/test_batch_invariant_runner.py
holds the runner-level tests (which module first differs, the routing rule, preemption).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import CompletionOutput
from executors.loader import read_hf_config
from tests.executors.batch_invariant_model import (
    GREEDY,
    SEEDED,
    TARGET,
    VOCAB,
    companions,
)
from tests.executors.test_llm import prompts

ENGINE = dict(block_size=16, num_gpu_blocks=4096, max_model_len=1024, max_num_seqs=128)


def scenarios(
    path: Path, batch_invariant: bool, num_speculative_tokens: int = 0
) -> dict[str, list[CompletionOutput]]:
    """The target's [greedy, seeded] completions in each scenario."""
    results: dict[str, list[CompletionOutput]] = {}

    def engine(**extra: Any) -> LLM:
        gc.unfreeze()  # (the last engine froze its heap: executors/warmup.py)
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(str(path), dtype="bfloat16", batch_invariant=batch_invariant,
                   num_speculative_tokens=num_speculative_tokens,
                   **{**ENGINE, **extra})  # fmt: skip

    def target_outputs(llm: LLM, others: list[list[int]]) -> list[CompletionOutput]:
        outs = llm.generate([TARGET, TARGET, *others],
                            [GREEDY, SEEDED] + [GREEDY] * len(others), use_tqdm=False)  # fmt: skip
        return [outs[0].outputs[0], outs[1].outputs[0]]

    llm = engine(enable_prefix_caching=False)
    results["alone"] = target_outputs(llm, [])
    results["with 7 companions"] = target_outputs(llm, companions(7, 2))
    results["with 63 companions"] = target_outputs(llm, companions(63, 3))
    del llm
    llm = engine(enable_prefix_caching=False, max_num_batched_tokens=16)
    results["chunked at 16 tokens"] = target_outputs(llm, [])
    results["chunked at 16, 7 companions"] = target_outputs(llm, companions(7, 4))
    del llm
    llm = engine(enable_prefix_caching=True)
    llm.generate([TARGET[:100] + prompts(5, [50], VOCAB)[0]], GREEDY, use_tqdm=False)
    results["prefix hit (96 tokens)"] = target_outputs(llm, [])
    results["prefix hit (288 tokens)"] = target_outputs(llm, companions(7, 6))
    del llm
    return results


def differences(results: dict[str, list[CompletionOutput]]) -> list[str]:
    """How each scenario differs from "alone": the first differing token, the largest
    logprob difference."""
    base = results["alone"]
    found = []
    for name, outs in results.items():
        for kind, a, b in zip(("greedy", "seeded"), base, outs):
            if a.token_ids == b.token_ids and a.logprobs == b.logprobs:
                continue
            first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         None)  # fmt: skip
            worst = 0.0
            for pa, pb in zip(a.logprobs or [], b.logprobs or []):
                for tok in pa.keys() & pb.keys():
                    worst = max(worst, abs(pa[tok].logprob - pb[tok].logprob))
            found.append(f"{name} ({kind}): first differing token {first}, "
                         f"max logprob diff {worst:.3e}")  # fmt: skip
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_a_request_is_bit_identical_whatever_its_batch_chunking_or_cache(
    pow2_model, num_speculative_tokens
) -> None:
    """Greedy and seeded: alone, beside 7 and 63 companions, chunked at 16 (alone and
    beside 7), after prefix hits of 96 and 288 tokens: the same tokens and logprobs; also
    with MTP speculation (2 drafts verified a step)."""
    diffs = differences(scenarios(pow2_model.path, True, num_speculative_tokens))
    print(f"batch-invariant mode, {num_speculative_tokens} drafts:",
          diffs or "all scenarios identical")  # fmt: skip
    assert not diffs, "batch-invariant mode: " + "; ".join(diffs)


@pytest.mark.gpu
def test_normal_mode_documents_where_results_differ(pow2_model) -> None:
    """The contrast: without the mode, batch composition and chunking change the bits (or,
    on a tiny model, may happen not to: then there is nothing to document)."""
    diffs = differences(scenarios(pow2_model.path, batch_invariant=False))
    print("normal mode:", diffs or "all scenarios identical")
    if not diffs:
        pytest.skip("normal mode happened to match in every scenario on this model")


def test_the_mode_is_refused_on_the_cpu_with_a_clear_error(pow2_model) -> None:
    with pytest.raises(ValueError, match="batch-invariant mode needs CUDA"):
        LLM(str(pow2_model.path), device="cpu", batch_invariant=True)


def test_the_mode_is_refused_for_shapes_the_kernels_cannot_take(tiny_models, monkeypatch) -> None:
    """The tiny v3_mtp model has v_head_dim=24: refused before loading, naming the field."""
    from executors.batch_invariant import check_supported

    cfg = ModelConfig.from_dict(read_hf_config(tiny_models["v3_mtp"].path))
    with pytest.raises(ValueError, match="v_head_dim"):
        check_supported(cfg, torch.device("cuda"), 16)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    with pytest.raises(ValueError, match="DEEPINFER_KERNEL_BACKEND=torch"):
        check_supported(cfg, torch.device("cuda"), 16)

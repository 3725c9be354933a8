"""Data-parallel ranks over NCCL, one GPU each (gpu marker; skipped with fewer GPUs)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel

ARGS = dict(device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=64,
            enforce_eager=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize(
    ("name", "drafts"), [("v2_group", 0), ("v3_mtp", 3)], ids=["no-drafts", "mtp-drafts"]
)
def test_expert_parallel_ranks_on_gpus_equal_one_gpu(
    tiny_models: dict[str, TinyModel], ranks: int, name: str, drafts: int
) -> None:
    """Both models have 8 routed experts (1 to 4 a rank). With MTP drafts (v3_mtp: one
    MTP layer, MoE) the ranks agree on each round's MTP passes with a CUDA all-reduce
    and pad them; float32 greedy outputs are one GPU's without speculation."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, {torch.cuda.device_count()} visible")
    tiny = tiny_models[name]
    batch = prompts(7, [9, 40, 12, 6, 3, 25, 17, 8, 30, 11])
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        for m in [6, 2, 19, 4, 7, 5, 12, 1, 9, 3]
    ]
    one = LLM(str(tiny.path), **ARGS)  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids for o in one.generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]  # fmt: skip
    one.shutdown()
    llm = LLM(str(tiny.path), data_parallel_size=ranks, enable_expert_parallel=True,
              num_speculative_tokens=drafts, check_invariants=True, **ARGS)  # type: ignore[arg-type]  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()

"""Batch-invariant mode end to end (EngineConfig.batch_invariant).

On the GPU, a tiny random-weight DeepSeek V3 in bf16 (head dims the Triton kernels take):
one request alone, beside 7 and 63 companions, with its prompt chunked at 16 tokens, and
after prefix-cache hits gives the same token ids and the same logprobs, bit for bit,
greedy and seeded. The same runs in normal mode document where they differ. A runner-level
test compares every module's output rows for the request alone and in a batch, and
names the first module whose rows differ (the diagnosis when the end-to-end test fails).

On the CPU: the mode is refused with a clear error, and the runner's routing rule (prompt
positions take the prefill path, however short the chunk) is checked without a GPU.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import CompletionOutput, ScheduledRequest, SchedulerOutput
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel, save_tiny

# Power-of-two MLA widths (the prefill kernel needs head dims >= 16), grouped V3 routing,
# a dense first layer, q LoRA.
POW2_SPEC: dict[str, Any] = dict(
    arch="v3",
    num_hidden_layers=3,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    vocab_size=512,
    max_position_embeddings=1024,
    q_lora_rank=64,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    num_nextn_predict_layers=0,
)
VOCAB = POW2_SPEC["vocab_size"]
# 18 blocks of 16 plus one token: chunked at 16, the last chunk is a single prompt token
# (as short as a decode step); its decode contexts cross the 256-key attention piece.
TARGET = prompts(1, [289], VOCAB)[0]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True,
                        logprobs=5)  # fmt: skip
ENGINE = dict(block_size=16, num_gpu_blocks=4096, max_model_len=1024, max_num_seqs=128)


@pytest.fixture(scope="module")
def pow2_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return save_tiny("pow2", tmp_path_factory.mktemp("batch_invariant"), spec=POW2_SPEC)


def companions(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return prompts(seed, torch.randint(5, 400, (n,), generator=g).tolist(), VOCAB)


def scenarios(path: Path, batch_invariant: bool) -> dict[str, list[CompletionOutput]]:
    """The target's [greedy, seeded] completions in each scenario."""
    results: dict[str, list[CompletionOutput]] = {}

    def engine(**extra: Any) -> LLM:
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(str(path), dtype="bfloat16", batch_invariant=batch_invariant,
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
def test_a_request_is_bit_identical_whatever_its_batch_chunking_or_cache(pow2_model) -> None:
    results = scenarios(pow2_model.path, batch_invariant=True)
    diffs = differences(results)
    print("batch-invariant mode:", diffs or "all scenarios identical")
    assert not diffs, "batch-invariant mode: " + "; ".join(diffs)


@pytest.mark.gpu
def test_normal_mode_documents_where_results_differ(pow2_model) -> None:
    """The contrast: without the mode, batch composition and chunking change the bits (or,
    on a tiny model, may happen not to: then there is nothing to document)."""
    diffs = differences(scenarios(pow2_model.path, batch_invariant=False))
    print("normal mode:", diffs or "all scenarios identical")
    if not diffs:
        pytest.skip("normal mode happened to match in every scenario on this model")


# ---- the runner level: every module's rows, and the first that differs ---------------


def _runner(path: Path, batch_invariant: bool) -> ModelRunner:
    cfg = ModelConfig.from_dict(read_hf_config(path))
    dev = torch.device("cuda")
    model = load_model(path, cfg, dtype=torch.bfloat16, device=dev)
    cache = PagedKVCache(cfg.num_hidden_layers, 2048, 16, cfg.kv_entry_dim, torch.bfloat16, dev)
    engine = EngineConfig(block_size=16, num_gpu_blocks=2048, batch_invariant=batch_invariant)
    return ModelRunner(model, cache, engine, max_model_len=1024)


def _prefill_step(reqs: list[list[int]], first_block: int) -> SchedulerOutput:
    scheduled, block = [], first_block
    for i, toks in enumerate(reqs):
        n = -(-len(toks) // 16)
        scheduled.append(ScheduledRequest(
            req_id=f"r{i}", num_tokens=len(toks), num_computed_tokens=0, is_prompt=True,
            samples=True, new_block_ids=list(range(block, block + n)),
            block_table=list(range(block, block + n)), token_ids=toks,
            sampling_params=GREEDY, num_prompt_tokens=len(toks),
        ))  # fmt: skip
        block += n
    return SchedulerOutput(0, scheduled)


def _module_rows(runner: ModelRunner, step: SchedulerOutput) -> list[tuple[str, torch.Tensor]]:
    """Every module's output rows of request r0 (whose tokens come first in a batch of
    prompts), in call order."""
    n = step.scheduled[0].num_tokens
    total = step.num_batched_tokens
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = []
    for name, module in runner.model.named_modules():

        def hook(_m, _i, out, name=name) -> None:  # noqa: ANN001
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == total:
                seen.append((name or "model", t[:n].detach().clone()))

        hooks.append(module.register_forward_hook(hook))
    try:
        runner.step(step)
    finally:
        for h in hooks:
            h.remove()
    return seen


def first_difference(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> str:
    for (name, x), (_, y) in zip(a, b):
        if not torch.equal(x, y):
            d = (x.double() - y.double()).abs()
            return f"{name}: max abs diff {d.max().item():.3e} over {int((d > 0).sum())} values"
    return ""


@pytest.mark.gpu
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_every_module_computes_a_requests_rows_alone_as_in_a_batch(pow2_model, batch_invariant):
    """A 289-token prompt prefilled alone vs first in a step with 63 companion prompts:
    every module's rows of it are identical in the mode; the message names the first
    module (in call order) whose rows differ."""
    runner = _runner(pow2_model.path, batch_invariant)
    alone = _module_rows(runner, _prefill_step([TARGET], 0))
    batch = _module_rows(runner, _prefill_step([TARGET, *companions(63, 9)], 0))
    assert len(alone) == len(batch) > 0
    where = first_difference(alone, batch)
    print(f"batch_invariant={batch_invariant}:", where or "every module identical")
    if batch_invariant:
        assert not where, f"first module whose rows differ: {where}"
    elif not where:
        pytest.skip("normal mode happened to match on this model")


# ---- the CPU: refusal and the routing rule ---------------------------------------------


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


def _cpu_runner(path: Path, batch_invariant: bool) -> ModelRunner:
    cfg = ModelConfig.from_dict(read_hf_config(path))
    model = load_model(path, cfg, dtype=torch.float32, device=torch.device("cpu"))
    cache = PagedKVCache(cfg.num_hidden_layers, 64, 16, cfg.kv_entry_dim, torch.float32,
                         torch.device("cpu"))  # fmt: skip
    engine = EngineConfig(block_size=16, num_gpu_blocks=64, batch_invariant=batch_invariant)
    return ModelRunner(model, cache, engine, max_model_len=1024)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_prompt_positions_take_the_prefill_path_in_the_mode(pow2_model, batch_invariant):
    """A prompt's one-token last chunk is as short as a decode step: normally it takes the
    absorbed path, in the mode the prefill path (as the unchunked prompt's last token
    does); output positions take the absorbed path in both. The model switches too."""
    runner = _cpu_runner(pow2_model.path, batch_invariant)
    first = _prefill_step([TARGET[:16], TARGET[:40]], 0)
    runner.update_states(first)
    first.scheduled[1].num_tokens = 39  # r1 computes all but its last prompt token
    first.scheduled[1].token_ids = TARGET[:39]
    runner.collect(first.scheduled)
    decode = ScheduledRequest(req_id="r0", num_tokens=1, num_computed_tokens=16,
                              is_prompt=False, samples=True, new_block_ids=[4],
                              token_ids=[5], num_prompt_tokens=16)  # fmt: skip
    last_chunk = ScheduledRequest(req_id="r1", num_tokens=1, num_computed_tokens=39,
                                  is_prompt=True, samples=True, new_block_ids=[],
                                  token_ids=TARGET[39:40], num_prompt_tokens=40)  # fmt: skip
    runner.update_states(SchedulerOutput(1, [last_chunk, decode]))
    host = runner.collect([last_chunk, decode])
    if batch_invariant:
        assert host.req_ids == ["r0", "r1"] and host.num_decode == 1
    else:
        assert host.num_decode == 2
    linears = [m for m in runner.model.modules() if hasattr(m, "batch_invariant")]
    assert linears and all(m.batch_invariant is batch_invariant for m in linears)
    attn = runner.model.model.layers[0].self_attn
    assert attn.decode_keys_per_split == (256 if batch_invariant else None)


# The mode on the CPU: its Triton kernels in Triton's interpreter (float32; set before any
# kernel module is imported, hence a process of its own). Prints nothing; saves logits.
_INTERPRETED = """
import sys
import tests.kernels.conftest  # TRITON_INTERPRET=1 and the interpreter's scalar patch
import torch
from tests.executors import test_batch_invariant as t
from tests.executors.harness import Driver

path, out, prompt = sys.argv[1], sys.argv[2], t.TARGET[:33]
results = {}
for name, chunk, others in [("whole", 33, []), ("chunked", 16, [t.TARGET[40:47], t.TARGET[50:90]])]:
    driver = Driver(t._cpu_runner(t.Path(path), batch_invariant=True))
    driver.add("t", prompt)
    for i, o in enumerate(others):
        driver.add(f"c{i}", o)
    done = 0
    while done < len(prompt):
        work = {"t": min(chunk, len(prompt) - done)}
        work.update({f"c{i}": len(o) for i, o in enumerate(others) if done == 0})
        driver.step(work)
        done += work["t"]
    for _ in range(3):
        driver.step({rid: 1 for rid in driver.seqs})
    results[name] = (driver.seqs["t"].tokens, driver.seqs["t"].logits)
torch.save(results, out)
"""


def test_the_mode_runs_on_the_triton_interpreter_and_matches_transformers(pow2_model, tmp_path):
    """The mechanism without a GPU: a 33-token prompt chunked 16 + 16 + 1 beside two
    companions (its last prompt token alone in a step: the prefill path) and computed whole
    give the same tokens and logits in the interpreter, and transformers' logits. The
    bitwise claim for the GPU is the GPU tests'; here a wrong routing rule or a kernel
    that reads another row would show."""
    out = tmp_path / "logits.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_KERNEL_BACKEND": "triton"}
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _INTERPRETED, str(pow2_model.path), str(out)],
                   env=env, cwd=root, check=True, timeout=900)  # fmt: skip
    results = torch.load(out)
    (tokens, whole), (chunked_tokens, chunked) = results["whole"], results["chunked"]
    assert tokens == chunked_tokens and whole.keys() == chunked.keys()
    for pos in whole:
        assert torch.equal(whole[pos], chunked[pos]), f"position {pos} differs"
    with torch.no_grad():
        ref = pow2_model.hf(torch.tensor([tokens])).logits[0]
    for pos, row in whole.items():
        assert (row - ref[pos]).abs().max() / ref[pos].abs().max() < 1e-4, pos

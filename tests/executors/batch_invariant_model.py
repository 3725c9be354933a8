"""The batch-invariant tests' model, prompts and runner scenarios (shared by the GPU tests
and the CPU run in Triton's interpreter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner
from tests.executors.harness import Driver
from tests.executors.test_llm import prompts

# Power-of-two MLA widths (the prefill kernel needs head dims >= 16), grouped V3 routing,
# a dense first layer, q LoRA, one MTP layer (speculation).
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
    num_nextn_predict_layers=1,
    mtp=True,
)
# The same widths in one layer of each kind (dense, then MoE): Triton's interpreter runs a
# kernel one program at a time, so the CPU run takes the fewest layers that hold them all.
POW2_TWO_LAYER_SPEC: dict[str, Any] = {**POW2_SPEC, "num_hidden_layers": 2}
VOCAB = POW2_SPEC["vocab_size"]
# 18 blocks of 16 plus one token: chunked at 16, the last chunk is a single prompt token
# (as short as a decode step); its decode contexts cross the 256-key attention piece.
TARGET = prompts(1, [289], VOCAB)[0]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True,
                        logprobs=5)  # fmt: skip


def companions(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return prompts(seed, torch.randint(5, 400, (n,), generator=g).tolist(), VOCAB)


def build_runner(
    path: Path,
    batch_invariant: bool,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    num_blocks: int = 2048,
) -> ModelRunner:
    """A runner over a 16-token-block cache, contexts up to 1,024 (decode pieces of 256)."""
    cfg = ModelConfig.from_dict(read_hf_config(path))
    dev = torch.device(device)
    model = load_model(path, cfg, dtype=dtype, device=dev)
    cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, 16, cfg.kv_entry_dim, dtype, dev)
    engine = EngineConfig(block_size=16, num_gpu_blocks=num_blocks, batch_invariant=batch_invariant)
    return ModelRunner(model, cache, engine, max_model_len=1024)


def prefill_step(reqs: list[list[int]], first_block: int) -> SchedulerOutput:
    """Requests r0, r1, ... each computing its whole prompt, on consecutive blocks."""
    scheduled, block = [], first_block
    for i, toks in enumerate(reqs):
        n = -(-len(toks) // 16)
        scheduled.append(ScheduledRequest(
            req_id=f"r{i}", num_tokens=len(toks), num_computed_tokens=0, is_prompt=True,
            will_sample=True, new_block_ids=list(range(block, block + n)),
            block_table=list(range(block, block + n)), token_ids=toks,
            sampling_params=GREEDY, num_prompt_tokens=len(toks),
        ))  # fmt: skip
        block += n
    return SchedulerOutput(0, scheduled)


Logits = dict[int, torch.Tensor]  # position -> the logits row that predicted the next token


def runner_scenarios(
    path: Path, device: str, dtype: torch.dtype, prompt: list[int], decode_steps: int = 3
) -> dict[str, tuple[list[int], Logits]]:
    """One request through a batch-invariant runner, greedy: its prompt whole, alone;
    chunked at 16 beside two companion prompts; and preempted after all but one of its
    decode steps, then recomputed (prompt and outputs in one step)."""
    results = {}
    others = prompts(12, [7, 40], VOCAB)
    for name, chunk, comp in [("whole", len(prompt), []), ("chunked", 16, others)]:
        driver = Driver(build_runner(path, True, device, dtype))
        driver.add("t", prompt)
        for i, o in enumerate(comp):
            driver.add(f"c{i}", o)
        done = 0
        while done < len(prompt):
            work = {"t": min(chunk, len(prompt) - done)}
            work.update({f"c{i}": len(o) for i, o in enumerate(comp) if done == 0})
            driver.step(work)
            done += work["t"]
        driver.decode_all(decode_steps)
        results[name] = (driver.seqs["t"].tokens, driver.seqs["t"].logits)
    driver = Driver(build_runner(path, True, device, dtype))
    driver.add("t", prompt)
    driver.step({"t": len(prompt)})
    driver.decode_all(decode_steps - 1)
    driver.preempt("t")
    driver.step({"t": len(driver.seqs["t"].tokens)})
    results["recomputed"] = (driver.seqs["t"].tokens, driver.seqs["t"].logits)
    return results


def scenario_differences(results: dict[str, tuple[list[int], Logits]]) -> list[str]:
    """Where each scenario's tokens or logits differ from "whole" (empty: identical)."""
    tokens, base = results["whole"]
    found = []
    for name, (toks, logits) in results.items():
        if toks != tokens:
            found.append(f"{name}: tokens end {toks[-4:]}, alone and whole {tokens[-4:]}")
        for pos, row in logits.items():
            if not torch.equal(row, base[pos]):
                diff = (row.double() - base[pos].double()).abs().max().item()
                found.append(f"{name}: logits at position {pos} differ by up to {diff:.3e}")
    return found

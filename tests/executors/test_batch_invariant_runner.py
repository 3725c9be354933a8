"""Batch-invariant mode at the model runner: the rule that routes rows to the attention
paths, preemption's recompute, and (on the GPU) which module first computes a request's
rows differently in a batch.

On the CPU the whole mode also runs in Triton's interpreter (float32, in a process of its
own: TRITON_INTERPRET is read when a kernel module is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from executors.model_runner import ModelRunner
from tests.executors.batch_invariant_model import (
    GREEDY,
    TARGET,
    build_runner,
    companions,
    prefill_step,
    runner_scenarios,
    scenario_differences,
)


def _cpu_runner(path: Path, batch_invariant: bool) -> ModelRunner:
    return build_runner(path, batch_invariant, "cpu", torch.float32, num_blocks=64)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_prompt_positions_take_the_prefill_path_in_the_mode(pow2_model, batch_invariant):
    """A prompt's one-token last chunk is as short as a decode step: normally it takes the
    absorbed path, in the mode the prefill path (as the unchunked prompt's last token
    does); output positions take the absorbed path in both. The model switches too."""
    runner = _cpu_runner(pow2_model.path, batch_invariant)
    first = prefill_step([TARGET[:16], TARGET[:40]], 0)
    runner.update_states(first)
    first.scheduled[1].num_tokens = 39  # r1 computes all but its last prompt token
    first.scheduled[1].token_ids = TARGET[:39]
    runner.inputs.collect(first.scheduled, drafting=False)
    decode = ScheduledRequest(req_id="r0", num_tokens=1, num_computed_tokens=16,
                              is_prompt=False, will_sample=True, new_block_ids=[4],
                              token_ids=[5], num_prompt_tokens=16)  # fmt: skip
    last_chunk = ScheduledRequest(req_id="r1", num_tokens=1, num_computed_tokens=39,
                                  is_prompt=True, will_sample=True, new_block_ids=[],
                                  token_ids=TARGET[39:40], num_prompt_tokens=40)  # fmt: skip
    runner.update_states(SchedulerOutput(1, [last_chunk, decode]))
    host = runner.inputs.collect([last_chunk, decode], drafting=False)
    if batch_invariant:
        assert host.req_ids == ["r0", "r1"] and host.num_decode == 1
    else:
        assert host.num_decode == 2
    switched = [m for m in runner.model.modules() if hasattr(m, "batch_invariant")]
    assert switched and all(m.batch_invariant is batch_invariant for m in switched)
    attn = runner.model.model.layers[0].self_attn
    assert attn.decode_keys_per_split == (256 if batch_invariant else None)


def test_a_recomputed_request_splits_at_its_prompt_end_in_the_mode(pow2_model) -> None:
    """Resumed after preemption, a request recomputes its 40-token prompt and 3 outputs in
    one step: in the mode its outputs are a segment of their own on the absorbed path
    (first in the batch), its prompt one on the prefill path; the sampled row is its last."""
    runner = _cpu_runner(pow2_model.path, batch_invariant=True)
    tokens = TARGET[:43]
    resumed = ScheduledRequest(req_id="r", num_tokens=43, num_computed_tokens=0,
                               is_prompt=True, will_sample=True, new_block_ids=[0, 1, 2],
                               block_table=[0, 1, 2], token_ids=tokens,
                               sampling_params=GREEDY, num_prompt_tokens=40)  # fmt: skip
    other = prefill_step([TARGET[:20]], 3).scheduled[0]
    runner.update_states(SchedulerOutput(0, [resumed, other]))
    host = runner.inputs.collect([resumed, other], drafting=False)
    assert host.req_ids == ["r", "r", "r0"] and host.num_decode == 1
    assert host.query_lens == [3, 40, 20] and host.context_lens == [40, 0, 0]
    assert host.positions[:3] == [40, 41, 42] and host.input_ids[:3] == tokens[40:]
    assert host.logits_indices[host.sample_rows["r"][0]] == 2  # position 42's row


_INTERPRETED = """
import sys
import tests.kernels.conftest  # TRITON_INTERPRET=1 and the interpreter's patches
import torch
from pathlib import Path
from kernels import batch_invariant
from tests.executors.batch_invariant_model import TARGET, runner_scenarios

# The interpreter runs a kernel one program at a time: the float32 matmul's config for few
# rows (16 x 16 tiles) makes ~30 programs a launch here, its config for many rows (64 x 64)
# a few. One config for every batch keeps the mode batch-invariant (this test compares the
# scenarios with each other); the few-rows config runs in tests/kernels/test_batch_invariant.py.
batch_invariant.MATMUL_CONFIGS_FP32 = batch_invariant.MATMUL_CONFIGS_FP32[-1:]
path, out = Path(sys.argv[1]), sys.argv[2]
# Two decode steps: preempted after two outputs (the prompt step's and a decode step's),
# the request recomputes them as a segment of two rows on the absorbed path.
torch.save(runner_scenarios(path, "cpu", torch.float32, TARGET[:33], decode_steps=2), out)
"""


def test_the_mode_runs_on_the_triton_interpreter_and_matches_transformers(
    pow2_two_layer_model, tmp_path
):
    """The mechanism without a GPU: a 33-token prompt chunked 16 + 16 + 1 beside two
    companions (its last prompt token alone in a step: the prefill path), computed whole,
    and preempted after two outputs then recomputed in one step (prompt rows by the
    prefill path, outputs by the absorbed one) give the same tokens and logits in the
    interpreter, and transformers' logits. The bitwise claim for the GPU is the GPU
    tests'; here a wrong routing rule or a kernel that reads another row shows."""
    model = pow2_two_layer_model
    out = tmp_path / "logits.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_KERNEL_BACKEND": "triton"}
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _INTERPRETED, str(model.path), str(out)],
                   env=env, cwd=root, check=True, timeout=900)  # fmt: skip
    results = torch.load(out)
    assert set(results) == {"whole", "chunked", "recomputed"}
    assert not scenario_differences(results)
    tokens, whole = results["whole"]
    assert len(tokens) == 33 + 3  # two outputs before the preemption, one from the recompute
    with torch.no_grad():
        ref = model.hf(torch.tensor([tokens])).logits[0]
    for pos, row in whole.items():
        assert (row - ref[pos]).abs().max() / ref[pos].abs().max() < 1e-4, pos


@pytest.mark.gpu
def test_runner_scenarios_are_bit_identical_on_the_gpu(pow2_model) -> None:
    """The interpreter's scenarios in bf16 on the GPU with the 289-token prompt: whole,
    chunked at 16 beside companions, preempted and recomputed."""
    diffs = scenario_differences(runner_scenarios(pow2_model.path, "cuda", torch.bfloat16, TARGET))
    print("runner scenarios:", diffs or "all identical")
    assert not diffs, "; ".join(diffs[:8])


# ---- which module first computes a request's rows differently -------------------------


def _module_rows(runner: ModelRunner, step: SchedulerOutput) -> list[tuple[str, torch.Tensor]]:
    """Every module's output rows of request r0 (whose tokens come first in a batch of
    prompts), in the order the modules finish."""
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
    module (innermost first) whose rows differ."""
    runner = build_runner(pow2_model.path, batch_invariant)
    alone = _module_rows(runner, prefill_step([TARGET], 0))
    batch = _module_rows(runner, prefill_step([TARGET, *companions(63, 9)], 0))
    assert len(alone) == len(batch) > 0
    where = first_difference(alone, batch)
    print(f"batch_invariant={batch_invariant}:", where or "every module identical")
    if batch_invariant:
        assert not where, f"first module whose rows differ: {where}"
    elif not where:
        pytest.skip("normal mode happened to match on this model")

"""TorchExecutor and ModelRunner bookkeeping (CPU); bf16 CUDA variants marked gpu."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.entrypoints.executor_registry import get_executor_class
from deepinfer.errors import RequestFailed
from deepinfer.executor import Executor
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors.torch_executor import TorchExecutor
from tests.executors.harness import GREEDY, Driver, load_runner, max_rel_error
from tests.executors.tiny_models import TinyModel


def _prompt_step(req_id: str, tokens: list[int], table: list[int], **kw) -> ScheduledRequest:
    kw.setdefault("sampling_params", GREEDY)
    return ScheduledRequest(
        req_id=req_id,
        num_tokens=len(tokens),
        num_computed_tokens=0,
        is_prompt=True,
        will_sample=True,
        new_block_ids=list(table),
        block_table=list(table),
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        **kw,
    )


def _decode_step(
    req_id: str, pos: int, token: int | None, new_blocks: list[int] = ()
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        num_tokens=1,
        num_computed_tokens=pos,
        is_prompt=False,
        will_sample=True,
        new_block_ids=list(new_blocks),
        token_ids=None if token is None else [token],
    )


def test_executor_satisfies_the_protocol_and_exposes_the_model(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v3_mtp"]
    ex = TorchExecutor(EngineConfig(block_size=4, num_gpu_blocks=64), str(tiny.path), device="cpu")
    assert get_executor_class("torch") is TorchExecutor
    assert isinstance(ex, Executor) and ex.needs_token_ids
    assert ex.num_kv_blocks() == 64 and ex.kv_cache.layers[0].shape == (64, 4, 48)
    assert ex.config.model_type == "deepseek_v3" and ex.model_dir == tiny.path
    assert ex.max_model_len == 512 and ex.eos_token_id == 1 and ex.dtype == torch.float32
    prompt = [5, 6, 7, 8, 9, 10]
    out = ex.execute(SchedulerOutput(1, [_prompt_step("a", prompt, [3, 9])]))
    ref = tiny.hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
    assert out.sampled_token_ids == {"a": [ref]}
    fut = ex.execute_async(SchedulerOutput(2, [_decode_step("a", 6, ref)]))
    assert not fut.done()  # queued: read back by result()
    assert len(fut.result().sampled_token_ids["a"]) == 1 and fut.done()
    ex.shutdown()


def test_cpu_kv_capacity_defaults_to_eight_max_length_sequences(
    tiny_models: dict[str, TinyModel],
) -> None:
    ex = TorchExecutor(
        EngineConfig(block_size=16, max_model_len=128),
        str(tiny_models["v2_lite"].path),
        device="cpu",
    )
    assert ex.num_kv_blocks() == 8 * 128 // 16
    assert ex.max_model_len == 128


def test_the_simulated_cpu_sizes_its_kv_cache_as_the_cpu_executor(
    tiny_models: dict[str, TinyModel],
) -> None:
    """gpu_memory_utilization applies to GPUs: the CPU executor ignores it, and the
    simulator's CPU sized its cache from it (29,175 blocks for the demo model at 0.2,
    322,776 at 0.9, against the executor's 256: an audit). Both follow one rule now."""
    from sim import simulate
    from sim.traces import TraceRequest

    path = tiny_models["v2_lite"].path
    for util in (0.2, 0.9):
        cfg = EngineConfig(block_size=16, max_model_len=128, gpu_memory_utilization=util)
        real = TorchExecutor(cfg, str(path), device="cpu").num_kv_blocks()
        res = simulate([TraceRequest("a", 0.0, 16, 2)], str(path / "config.json"), "cpu", cfg)
        assert res.meta["num_gpu_blocks"] == real == 8 * 128 // 16


def test_dummy_executor_runs_from_a_config_alone(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(
        (tiny_models["v2_group"].path / "config.json").read_text()
    )
    ex = TorchExecutor(
        EngineConfig(block_size=4, num_gpu_blocks=8),
        str(tmp_path),
        device="cpu",
        load_format="dummy",
        dtype="float32",
    )
    out = ex.execute(SchedulerOutput(1, [_prompt_step("a", [1, 2, 3], [0])]))
    assert 0 <= out.sampled_token_ids["a"][0] < 256


def test_runner_state_lifecycle(tiny_models: dict[str, TinyModel]) -> None:
    runner = load_runner(tiny_models["v3_plain"].path, block_size=4, num_blocks=16)
    runner.execute(SchedulerOutput(1, [_prompt_step("a", [4, 5, 6, 7], [0])]))
    assert runner.requests["a"].block_table == [0]
    runner.execute(SchedulerOutput(2, [_decode_step("a", 4, None, [1])]))  # async: own token
    assert runner.requests["a"].block_table == [0, 1]
    assert len(runner.requests["a"].sampling.output_token_ids) == 2
    assert runner.requests["a"].sampling.prompt_token_ids == [4, 5, 6, 7]
    runner.execute(SchedulerOutput(3, [], finished_req_ids={"a"}))
    assert "a" not in runner.requests
    with pytest.raises(ValueError, match="no block_table"):
        runner.execute(SchedulerOutput(4, [_decode_step("a", 6, 1)]))
    with pytest.raises(RequestFailed, match="cannot hold"):
        runner.execute(SchedulerOutput(5, [_prompt_step("b", [1] * 5, [2])]))


def test_chunk_that_does_not_end_the_prompt_samples_nothing(
    tiny_models: dict[str, TinyModel],
) -> None:
    runner = load_runner(tiny_models["v3_plain"].path, block_size=4, num_blocks=16)
    sr = _prompt_step("a", [4, 5, 6], [0, 1])
    sr.will_sample, sr.num_prompt_tokens = False, 6
    assert runner.execute(SchedulerOutput(1, [sr])).sampled_token_ids == {}


def test_draft_tokens_are_verified_greedily(tiny_models: dict[str, TinyModel]) -> None:
    """Drafts equal to the greedy continuation are all accepted, plus one bonus token;
    a wrong draft stops acceptance there."""
    tiny = tiny_models["v2_group"]
    prompt = [9, 8, 7, 6, 5]
    ref = tiny.hf.generate(
        torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0
    )[0, 5:].tolist()
    for drafts, expect in ((ref[1:4], ref[1:5]), ([ref[1], (ref[2] + 1) % 256], ref[1:3])):
        runner = load_runner(tiny.path, block_size=4, num_blocks=16, num_speculative_tokens=3)
        out = runner.execute(SchedulerOutput(1, [_prompt_step("a", prompt, [0, 1])]))
        assert out.sampled_token_ids["a"] == ref[:1]
        sr = ScheduledRequest(
            req_id="a",
            num_tokens=1 + len(drafts),
            num_computed_tokens=5,
            is_prompt=False,
            will_sample=True,
            new_block_ids=[2],
            token_ids=ref[:1] + drafts,
            draft_token_ids=drafts,
        )
        assert runner.execute(SchedulerOutput(2, [sr])).sampled_token_ids["a"] == expect


def test_seeded_sampling_is_reproducible(tiny_models: dict[str, TinyModel]) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, seq_seed=7)
    outs = []
    for _ in range(2):
        runner = load_runner(tiny_models["v3_mtp"].path, block_size=4, num_blocks=16)
        out = runner.execute(
            SchedulerOutput(1, [_prompt_step("a", [3, 4, 5], [0], sampling_params=params)])
        )
        outs.append(out.sampled_token_ids["a"])
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_bf16_cuda_matches_transformers(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["v3_mtp"]
    ex = TorchExecutor(EngineConfig(block_size=16), str(tiny.path), device="cuda", dtype="bfloat16")
    assert ex.num_kv_blocks() > 0 and ex.kv_cache.layers[0].dtype == torch.bfloat16
    d = Driver(ex.runner)
    d.add("a", list(range(2, 40)))
    d.add("b", list(range(50, 61)))
    d.step({"a": 20, "b": 11})
    d.step({"a": 18, "b": 1})
    d.decode_all(8)
    assert max_rel_error(d, tiny.hf) < 5e-2  # bf16 against the float32 reference
    ex.shutdown()


@pytest.mark.gpu
def test_dummy_weights_in_published_shapes_run_on_cuda(tmp_path: Path) -> None:
    """Moonlight-16B-A3B's layer shapes (fewer layers), random weights made on the GPU."""
    import json

    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 163840,
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ex = TorchExecutor(
        EngineConfig(block_size=64, max_num_batched_tokens=2048), str(tmp_path), load_format="dummy"
    )
    assert ex.device.type == "cuda" and ex.num_kv_blocks() > 100
    out = ex.execute(SchedulerOutput(1, [_prompt_step("a", list(range(100)), [0, 1])]))
    assert 0 <= out.sampled_token_ids["a"][0] < 163840
    ex.shutdown()


def test_speculation_needs_mtp_layers(tiny_models: dict[str, TinyModel]) -> None:
    """Drafts come from the MTP layer: a model without one is refused, naming it."""
    cfg = EngineConfig(num_speculative_tokens=2, num_gpu_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="num_speculative_tokens=2: drafts come from"):
        TorchExecutor(cfg, str(tiny_models["v3_plain"].path), device="cpu")
    ex = TorchExecutor(cfg, str(tiny_models["v3_mtp"].path), device="cpu")
    assert len(ex.kv_cache.mtp_layers) == 1 and ex.runner.speculator is not None


@pytest.mark.parametrize(
    ("seqs", "drafts", "budget", "rows"), [(8, 0, 64, 8), (8, 3, 64, 32), (32, 3, 64, 64)]
)
def test_the_memory_profile_samples_a_full_batch_of_rows(
    tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch,
    seqs: int, drafts: int, budget: int, rows: int,
) -> None:  # fmt: skip
    """The forward that sizes the KV cache on CUDA samples one row; the sampler's own peak
    (a step's logits over every request and draft, each filter on) is profiled beside it."""
    import executors.torch_executor as te

    cfg = EngineConfig(num_speculative_tokens=drafts, num_gpu_blocks=16, block_size=4,
                       max_num_seqs=seqs, max_num_batched_tokens=budget)  # fmt: skip
    ex = TorchExecutor(cfg, str(tiny_models["v3_mtp"].path), device="cpu")
    seen = []
    real = te.sample_on_device

    def spy(logits, states, *a, **kw):  # type: ignore[no-untyped-def]
        seen.append((tuple(logits.shape), states[0].params))
        return real(logits, states, *a, **kw)

    monkeypatch.setattr(te, "sample_on_device", spy)
    ex._profile_run()
    ((shape, params),) = seen
    assert shape == (rows, ex.config.vocab_size)
    assert params.temperature > 0 and params.top_p < 1 and params.top_k > 0 and params.min_p > 0
    assert params.logprobs is not None


def test_cuda_asked_of_a_torch_without_cuda_is_a_clear_error(
    tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    from executors.torch_executor import TorchExecutor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where CUDA is
    with pytest.raises(ValueError, match=r"device='cuda': this torch .* sees no CUDA device"):
        TorchExecutor(
            EngineConfig(num_gpu_blocks=16), str(tiny_models["v3_mtp"].path), device="cuda"
        )


def test_max_model_len_past_the_models_positions_is_refused(
    tiny_models: dict[str, TinyModel],
) -> None:
    from executors.torch_executor import TorchExecutor

    cfg = EngineConfig(num_gpu_blocks=16, max_model_len=10**6)
    with pytest.raises(ValueError, match="max_model_len=1000000 exceeds"):
        TorchExecutor(cfg, str(tiny_models["v3_mtp"].path), device="cpu")


@pytest.mark.gpu
def test_shutdown_gives_the_gpu_memory_back(tiny_models: dict[str, TinyModel]) -> None:
    """An executor sizes its KV cache to gpu_memory_utilization of the device; shut down,
    it must leave that memory to the next one (a second engine in the same process, as in
    a notebook or a test session), even while the caller still holds it and without
    waiting for the garbage collector: graphs, drafter and MTP caches included."""
    tiny = tiny_models["v3_mtp"]
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        ex = TorchExecutor(
            EngineConfig(block_size=16, num_speculative_tokens=2, max_num_seqs=8),
            str(tiny.path), device="cuda", dtype="bfloat16",
        )  # fmt: skip
        assert ex.kv_cache.num_blocks > 1000  # most of the device: 0.9 of it
        ex.shutdown()
        held = torch.cuda.memory_allocated() - before
        assert held < 256 * 2**20, f"{held / 2**30:.2f} GiB still allocated after shutdown"

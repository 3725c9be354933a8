"""DeepSeek's FP8 checkpoints (e4m3 + weight_scale_inv per 128 x 128 block) load and
generate like transformers on the dequantized weights (CPU: the torch twins, which
dequantize), and `quantization="fp8"` puts a bf16 checkpoint into the same layout."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from executors.loader import load_model, read_hf_config, read_model_config
from tests.executors.harness import Driver, load_runner, max_rel_error
from tests.executors.tiny_fp8 import TinyFp8, save_tiny_fp8

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> TinyFp8:
    return save_tiny_fp8(tmp_path_factory.mktemp("tiny_fp8"))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in lengths]


def test_fp8_checkpoint_holds_e4m3_where_deepseek_does(tiny_fp8: TinyFp8) -> None:
    """Linears and experts in e4m3 with their block scales; the LM head, embedding, norms
    and router in float; kv_b_proj dequantized (absorbed decode reads its slices)."""
    model = load_runner(tiny_fp8.path).model
    params = dict(model.named_parameters())
    fp8 = torch.float8_e4m3fn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert params[f"model.layers.0.self_attn.{name}.weight"].dtype == fp8, name
    assert params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == fp8
    assert params["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 2, 2)
    assert params["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == fp8
    assert params["mtp.layers.0.eh_proj.weight"].dtype == fp8
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight"):  # fmt: skip
        assert params[name].dtype == torch.float32, name
    attn = model.model.layers[0].self_attn
    assert attn.in_proj_scale is not None  # q_a (128 rows) + kv_a fused at a block edge
    assert attn.q_a_proj.weight_scale_inv.data_ptr() == attn.in_proj_scale.data_ptr()


def test_fp8_checkpoint_logits_match_transformers_on_dequantized_weights(
    tiny_fp8: TinyFp8,
) -> None:
    """Prefill chunks beside decodes, then decode steps: every logits row."""
    d = Driver(load_runner(tiny_fp8.path, block_size=4))
    long, short = _prompts([19, 6], seed=1)
    d.add("long", long)
    d.add("short", short)
    d.step({"long": 9, "short": 6})
    d.step({"long": 10, "short": 1})
    d.decode_all(6)
    with torch.no_grad():
        assert max_rel_error(d, tiny_fp8.hf) < TOL


def test_fp8_checkpoint_greedy_tokens_equal_transformers_generate(tiny_fp8: TinyFp8) -> None:
    prompts = _prompts([6, 10], seed=4)
    d = Driver(load_runner(tiny_fp8.path, block_size=4))
    for i, p in enumerate(prompts):
        d.add(f"g{i}", p)
    d.step({rid: len(s.tokens) for rid, s in d.seqs.items()})
    d.decode_all(23)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = tiny_fp8.hf.generate(
                torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert d.seqs[f"g{i}"].tokens == ref[0].tolist(), i


def test_quantization_fp8_of_a_float_checkpoint_equals_deepseeks_layout(tiny_fp8: TinyFp8) -> None:
    """The same model quantized as it loads holds the FP8 checkpoint's tensors bit for
    bit: one layout, one set of kernels, whichever way the weights arrived."""
    cpu = torch.device("cpu")
    cfg = ModelConfig.from_dict(read_hf_config(tiny_fp8.bf16_path)).with_quantization("fp8")
    ours = load_model(tiny_fp8.bf16_path, cfg, dtype=torch.float32, device=cpu)
    cfg8 = ModelConfig.from_dict(read_hf_config(tiny_fp8.path))
    theirs = load_model(tiny_fp8.path, cfg8, dtype=torch.float32, device=cpu)
    want = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert p.dtype == want[name].dtype, name
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           want[name].view(torch.uint8) if p.dtype == torch.float8_e4m3fn
                           else want[name]), name  # fmt: skip


def test_llm_generates_with_quantization_fp8(tiny_fp8: TinyFp8) -> None:
    """The engine option reaches the loader: greedy text of the float checkpoint served in
    FP8 equals the FP8 checkpoint's."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = {"prompt_token_ids": _prompts([7], seed=9)[0]}
    outs = []
    for path, quant in ((tiny_fp8.bf16_path, "fp8"), (tiny_fp8.path, None)):
        llm = LLM(str(path), dtype="float32", device="cpu", quantization=quant, num_gpu_blocks=64)
        outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.shutdown()
    assert outs[0] == outs[1] and len(outs[0]) == 8


def test_dummy_fp8_weights_are_quantized_in_place() -> None:
    """load_format="dummy" with FP8 draws random weights and quantizes them: finite
    scales, no NaN in the dequantized weights."""
    from deepinfer.model_config import load_model_config
    from tests.executors.tiny_fp8 import FP8_SPEC

    raw = {k: v for k, v in FP8_SPEC.items() if k not in ("arch", "mtp")}
    raw.update(model_type="deepseek_v3", max_position_embeddings=512)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    raw["rope_theta"] = 10000.0
    cfg = ModelConfig.from_dict(raw)
    assert load_model_config is not None and cfg.weight_block_size == (64, 64)
    model = load_model(Path("."), cfg, dtype=torch.float32, device=torch.device("cpu"),
                       load_format="dummy")  # fmt: skip
    lin = model.model.layers[0].self_attn.o_proj
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv is not None
    assert torch.isfinite(lin.weight.float()).all() and (lin.weight_scale_inv > 0).all()


def test_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"quantization='int4'"):
        EngineConfig(quantization="int4")


def test_fp8_format_other_than_e4m3_is_refused_naming_the_key(
    tiny_fp8: TinyFp8, tmp_path: Path
) -> None:
    shutil.copytree(tiny_fp8.path, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["quantization_config"]["fmt"] = "e5m2"
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantization_config\.fmt='e5m2'"):
        read_model_config(tmp_path / "m")


def test_fp8_with_expert_parallel_is_refused(tiny_fp8: TinyFp8) -> None:
    from executors.distributed.expert_parallel import ExpertParallel

    cfg = ModelConfig.from_dict(read_hf_config(tiny_fp8.path))
    with pytest.raises(ValueError, match="fp8 with enable_expert_parallel"):
        load_model(tiny_fp8.path, cfg, dtype=torch.float32, device=torch.device("cpu"),
                   ep=ExpertParallel(0, 2, cfg.n_routed_experts))  # fmt: skip


def _driven(model: torch.nn.Module, cfg: ModelConfig, dev: torch.device) -> Driver:
    """The model over a paged cache, two prompts prefilled and decoded six steps."""
    from executors.kv_cache import PagedKVCache
    from executors.model_runner import ModelRunner

    cache = PagedKVCache(cfg.num_hidden_layers, 256, 4, cfg.kv_entry_dim, torch.float32, dev)
    engine = EngineConfig(block_size=4, num_gpu_blocks=256)
    d = Driver(ModelRunner(model, cache, engine, eos_token_id=cfg.eos_token_id))
    for i, p in enumerate(_prompts([7, 12], seed=3)):
        d.add(f"r{i}", p)
    d.step({rid: len(s.tokens) for rid, s in d.seqs.items()})
    d.decode_all(6)
    return d


def _row_errors(a: Driver, b: Driver) -> dict[str, list[float]]:
    """Per sequence, in position order: max |a - b| / max |b| of each logits row both runs
    computed from the same tokens (a near tie may sample apart: the rows after it see
    other inputs)."""
    errors: dict[str, list[float]] = {}
    for rid, seq in a.seqs.items():
        other = b.seqs[rid]
        mine = errors[rid] = []
        for pos, row in sorted(seq.logits.items()):
            if seq.tokens[: pos + 1] != other.tokens[: pos + 1]:
                break
            ref = other.logits[pos].float().cpu()
            mine.append(float((row.float().cpu() - ref).abs().max() / ref.abs().max()))
    return errors


@pytest.mark.gpu
def test_fp8_checkpoint_on_cuda_runs_the_fp8_kernels_as_their_rounding_twin(
    tiny_fp8: TinyFp8, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the projections and experts run the Triton FP8 kernels, which also round
    each GEMM's input to e4m3 per 128-group (DeepSeek's act_quant). Against the torch
    twins doing the same rounding (the CPU model, `round_activations`) the logits agree
    to float32 accumulation; against transformers on the dequantized weights (no
    activation rounding) they differ by what that rounding does to a small random model,
    bounded loosely here and measured by the test itself."""
    import functools

    import kernels.ops as ops
    from kernels.reference import fp8_linear_ref, fused_moe_ref

    dev = torch.device("cuda")
    cfg = ModelConfig.from_dict(read_hf_config(tiny_fp8.path))
    model = load_model(tiny_fp8.path, cfg, dtype=torch.float32, device=dev)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        gpu = _driven(model, cfg, dev)
        monkeypatch.setattr(
            ops, "fp8_linear_ref", functools.partial(fp8_linear_ref, round_activations=True)
        )
        monkeypatch.setattr(
            ops, "fused_moe_ref", functools.partial(fused_moe_ref, round_activations=True)
        )
        cpu_model = load_model(tiny_fp8.path, cfg, dtype=torch.float32, device=torch.device("cpu"))
        twin = _driven(cpu_model, cfg, torch.device("cpu"))
        errors = _row_errors(gpu, twin)
        rows = [e for seq in errors.values() for e in seq]
        # Rows agree to float32 accumulation until an activation that lies on an e4m3
        # rounding boundary rounds the other way on one side (one e4m3 step of it): from
        # there the cached KV carries the difference, and that prompt's later rows differ
        # by a few percent. On the H100 one prompt of the two flips in its prefill.
        assert len(rows) >= 6 and sum(e < 1e-5 for e in rows) >= len(rows) // 2, errors
        assert max(rows) < 0.1, errors
        assert max_rel_error(gpu, tiny_fp8.hf) < 0.25

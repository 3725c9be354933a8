"""Checkpoint discovery, config parsing and weight loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.model_config import ModelConfig
from executors.loader import (
    checkpoint_files,
    load_model,
    read_hf_config,
    read_model_config,
    resolve_dtype,
    resolve_model_dir,
)
from tests.executors.tiny_models import TinyModel, save_fused

CPU = torch.device("cpu")


def _load(path: Path, **kw) -> torch.nn.Module:
    cfg = ModelConfig.from_dict(read_hf_config(path))
    return load_model(path, cfg, dtype=torch.float32, device=CPU, **kw)


def _copy_without(src: Path, dst: Path, drop: str) -> Path:
    """A single-file copy of `src` lacking every tensor whose name starts with `drop`."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith(drop)}, dst / "model.safetensors"
    )
    return dst


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_every_shard(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["v2_group"]
    assert (tiny.path / "model.safetensors.index.json").is_file()
    files = checkpoint_files(tiny.path)
    assert len(set(files.values())) > 1
    model = _load(tiny.path)
    hf_experts = tiny.hf.model.layers[2].mlp.experts
    ours = model.model.layers[2].mlp.experts
    torch.testing.assert_close(ours.gate_up_proj, hf_experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.down_proj, hf_experts.down_proj, rtol=0, atol=0)


def test_fused_and_per_expert_names_load_the_same_weights(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    tiny = tiny_models["v3_plain"]
    fused_dir = save_fused(tiny, tmp_path)
    assert any(k.endswith("experts.gate_up_proj") for k in checkpoint_files(fused_dir))
    assert any(k.endswith("experts.0.up_proj.weight") for k in checkpoint_files(tiny.path))
    a, b = _state(_load(tiny.path)), _state(_load(fused_dir))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_missing_tensor_is_named(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    tiny = tiny_models["v3_plain"]
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    path = _copy_without(tiny.path, tmp_path / "m", name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load(path)
    path = _copy_without(tiny.path, tmp_path / "n", "model.norm.weight")
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        _load(path)


def test_missing_mtp_layer_drops_mtp_but_a_partial_one_is_an_error(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    tiny = tiny_models["v3_mtp"]
    assert _load(tiny.path).mtp is not None
    without = _copy_without(tiny.path, tmp_path / "no_mtp", "model.layers.3.")
    assert _load(without).mtp is None
    partial = _copy_without(tiny.path, tmp_path / "partial", "model.layers.3.eh_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.3\.eh_proj\.weight"):
        _load(partial)


def test_unexpected_tensor_is_named(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    tiny = tiny_models["v3_plain"]
    path = _copy_without(tiny.path, tmp_path / "m", "nothing")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.mystery.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"mystery"):
        _load(path)


def test_missing_config_and_missing_weights_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"safetensors.*pytorch_model\.bin"):
        checkpoint_files(tmp_path)


def test_unknown_architecture_and_model_type_are_named(tiny_models: dict[str, TinyModel]) -> None:
    raw = read_hf_config(tiny_models["v3_plain"].path)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ValueError, match="'mystery'"):
        ModelConfig.from_dict({**raw, "architectures": [], "model_type": "mystery"})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 3}, "n_group"),
        ({"topk_method": "magic"}, "topk_method"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_config_values_that_matter_are_validated(
    tiny_models: dict[str, TinyModel], change: dict, needle: str
) -> None:
    raw = read_hf_config(tiny_models["v3_mtp"].path)
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**raw, **change})


def test_a_quantized_checkpoint_other_than_fp8_is_refused_naming_the_file(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    raw = read_hf_config(tiny_models["v3_mtp"].path)
    (tmp_path / "config.json").write_text(
        json.dumps({**raw, "quantization_config": {"quant_method": "fp8"}})
    )
    assert (
        ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text())).dtype_bytes == 1
    )
    assert read_model_config(tmp_path).weight_block_size == (128, 128)  # DeepSeek's default
    (tmp_path / "config.json").write_text(
        json.dumps({**raw, "quantization_config": {"quant_method": "awq"}})
    )
    with pytest.raises(ValueError, match=r"config\.json: quantization_config \(awq\)"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        read_model_config(tmp_path)


def test_original_and_transformers_config_spellings_agree(
    tiny_models: dict[str, TinyModel],
) -> None:
    original = read_hf_config(tiny_models["v2_lite"].path)
    assert "rope_scaling" in original and "rope_parameters" not in original
    hf = tiny_models["v2_lite"].hf.config.to_dict()
    a, b = ModelConfig.from_dict(original), ModelConfig.from_dict(hf)
    assert a.rope == b.rope and a.rope.type == "yarn" and a.rope.mscale_all_dim == 0.707
    assert a.dtype == "float32" and a.q_lora_rank is None


def test_dummy_load_has_the_real_shapes_and_small_random_values(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v3_mtp"]
    real = _state(_load(tiny.path))
    dummy_model = _load(tiny.path, load_format="dummy", seed=3)
    dummy = _state(dummy_model)
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    w = dummy["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.isfinite(w).all() and 0.015 < float(w.std()) < 0.025
    assert torch.equal(dummy["model.norm.weight"], torch.ones(64))
    assert dummy["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_dummy_load_needs_only_the_config(
    tiny_models: dict[str, TinyModel], tmp_path: Path
) -> None:
    shutil.copy(tiny_models["v2_lite"].path / "config.json", tmp_path / "config.json")
    model = _load(tmp_path, load_format="dummy")
    assert model.model.layers[1].mlp.experts.down_proj.shape == (8, 64, 32)


def test_model_dir_resolution(tiny_models: dict[str, TinyModel], monkeypatch, tmp_path) -> None:
    path = tiny_models["v2_lite"].path
    assert resolve_model_dir(str(path)) == path
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(path))
    assert resolve_model_dir("deepseek-ai/DeepSeek-V2-Lite") == path
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(path.parent))
    assert resolve_model_dir("org/v2_lite") == path
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="DEEPINFER_HF_MODEL_DIR"):
        resolve_model_dir("org/other")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "absent"))


def test_hub_unreachable_is_a_clear_error(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    with pytest.raises(RuntimeError, match=r"'nobody/no-such-model'.*DEEPINFER_HF_MODEL_DIR"):
        resolve_model_dir("nobody/no-such-model")


def test_dtype_resolution(tiny_models: dict[str, TinyModel]) -> None:
    cfg = ModelConfig.from_dict(read_hf_config(tiny_models["v3_plain"].path))
    assert resolve_dtype(cfg, None, CPU) == torch.float32  # the checkpoint's
    assert resolve_dtype(cfg, "bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype(cfg, torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="int3"):
        resolve_dtype(cfg, "int3", CPU)
    raw = {**read_hf_config(tiny_models["v3_plain"].path), "dtype": None}
    assert resolve_dtype(ModelConfig.from_dict(raw), None, CPU) == torch.float32
    assert json.loads((tiny_models["v3_plain"].path / "config.json").read_text())["dtype"]


@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float32"])
def test_the_simulator_sizes_kv_in_the_dtype_the_executor_caches(checkpoint_dtype: str) -> None:
    """The executor caches KV in the checkpoint's dtype; the simulator's memory plan
    must count the same bytes a block (it once assumed bf16 for every checkpoint)."""
    from deepinfer.model_config import _config_source
    from executors.kv_cache import bytes_per_block
    from executors.loader import resolve_dtype

    raw = json.loads(_config_source("deepseek-v2-lite")[0].read_text())
    cfg = ModelConfig.from_dict({**raw, "torch_dtype": checkpoint_dtype})
    cached = resolve_dtype(cfg, None, torch.device("cpu"))
    assert bytes_per_block(cfg, 64, cached) == 64 * cfg.kv_bytes_per_token

"""Write and read the demo checkpoint in DeepSeek's original layout.

transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
gate rows first; `mlp.experts.down_proj` [E, H, I]); DeepSeek's files, and our
loader, name them per expert (`mlp.experts.{e}.gate_proj.weight` ...). The MTP
module goes to `model.layers.{num_hidden_layers}.*`. Weights are bf16; the
routers' `e_score_correction_bias` stays float32 as in DeepSeek-V3's release.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .modeling import MODEL_CONFIG, MTPModule, hf_config

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FP32 = ("e_score_correction_bias",)


def _unfuse(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    m = _FUSED.match(name)
    if not m:
        return {name: t}
    base, kind = m.groups()
    if kind == "down_proj":
        return {f"{base}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    gate, up = t.chunk(2, dim=1)  # [E, I, H] each
    out = {}
    for e in range(t.shape[0]):
        out[f"{base}.{e}.gate_proj.weight"] = gate[e]
        out[f"{base}.{e}.up_proj.weight"] = up[e]
    return out


def _fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of _unfuse over a whole state dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = t
        else:
            out[name] = t
    for base, pieces in experts.items():
        n = 1 + max(e for _, e in pieces)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([pieces[("gate_proj", e)], pieces[("up_proj", e)]]) for e in range(n)]
        )
        out[f"{base}.down_proj"] = torch.stack([pieces[("down_proj", e)] for e in range(n)])
    return out


def _mtp_name(name: str, prefix: str) -> str | None:
    """MTPModule parameter name -> checkpoint name (None: not saved)."""
    if name.startswith("body.embed_tokens") or "rotary_emb" in name:
        return None
    if name.startswith("body.layers.0."):
        return prefix + name.removeprefix("body.layers.0.")
    if name == "body.norm.weight":
        return prefix + "shared_head.norm.weight"
    return prefix + name  # enorm, hnorm, eh_proj


def checkpoint_tensors(model: nn.Module, mtp: MTPModule) -> dict[str, torch.Tensor]:
    """Checkpoint name -> contiguous CPU tensor (bf16; expert-score biases fp32)."""
    n = model.config.num_hidden_layers
    prefix = f"model.layers.{n}."
    named: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if "rotary_emb" not in name:
            named.update(_unfuse(name, t))
    for name, t in mtp.state_dict().items():
        key = _mtp_name(name, prefix)
        if key is not None:
            named.update(_unfuse(key, t))
    named[prefix + "shared_head.head.weight"] = model.lm_head.weight  # DeepSeek's copy
    out = {}
    for name, t in named.items():
        dtype = torch.float32 if name.endswith(_FP32) else torch.bfloat16
        out[name] = t.detach().to("cpu", dtype).contiguous()
    return out


def model_config_json() -> dict:
    """config.json: transformers' DeepseekV3Config fields plus DeepSeek's original keys."""
    raw = hf_config().to_dict()
    for key in (
        "_name_or_path",
        "transformers_version",
        "id2label",
        "label2id",
        "_experts_implementation",
        "experts_implementation",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "problem_type",
    ):
        raw.pop(key, None)
    raw.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        dtype="bfloat16",
        torch_dtype="bfloat16",
        scoring_func=MODEL_CONFIG["scoring_func"],
        topk_method=MODEL_CONFIG["topk_method"],
        rope_theta=MODEL_CONFIG["rope_parameters"]["rope_theta"],
        num_nextn_predict_layers=1,
    )
    return raw


def save_checkpoint(model: nn.Module, mtp: MTPModule, out: Path) -> int:
    """config.json, generation_config.json and model.safetensors; returns the file's bytes."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config_json()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    path = out / "model.safetensors"
    save_file(checkpoint_tensors(model, mtp), str(path), metadata={"format": "pt"})
    return path.stat().st_size


def load_for_eval(out: Path, device: str) -> tuple[nn.Module, MTPModule]:
    """The saved checkpoint back in float32: transformers' model (which skips the MTP
    layer) and an MTPModule filled from model.layers.{N}.*; both in eval mode."""
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    if info.get("missing_keys"):
        raise ValueError(f"transformers found no checkpoint tensor for {info['missing_keys']}")
    model = model.to(device)
    n = model.config.num_hidden_layers
    prefix = f"model.layers.{n}."
    mtp = MTPModule()
    wanted = {_mtp_name(k, prefix): k for k in mtp.state_dict() if _mtp_name(k, prefix)}
    raw = {}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            if key.startswith(prefix) and key != prefix + "shared_head.head.weight":
                raw[key] = f.get_tensor(key).float()
    # Fuse the experts only where this transformers version holds them fused.
    fused_layout = any(k.endswith("experts.gate_up_proj") for k in mtp.state_dict())
    tensors = _fuse(raw) if fused_layout else raw
    missing, unexpected = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"MTP layer: missing {missing}, unexpected {unexpected}")
    mtp.load_state_dict({wanted[k]: v for k, v in tensors.items()}, strict=False)
    return model.eval(), mtp.to(device).eval()


def parameter_counts(out: Path) -> dict[str, int]:
    """Counted from model.safetensors: main model, its embedding + head, MTP layer
    (without its copy of the head)."""
    with open(out / "config.json") as f:
        prefix = f"model.layers.{json.load(f)['num_hidden_layers']}."
    counts = {"params_main": 0, "params_embed": 0, "params_mtp": 0}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            size = math.prod(f.get_slice(key).get_shape())
            if key.startswith(prefix):
                if not key.endswith("shared_head.head.weight"):
                    counts["params_mtp"] += size
                continue
            counts["params_main"] += size
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                counts["params_embed"] += size
    return counts

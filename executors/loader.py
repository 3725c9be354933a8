"""Find a checkpoint, parse its config and load its safetensors into a DeepseekForCausalLM.

Model resolution: an existing local directory; else DEEPINFER_HF_MODEL_DIR (the
directory itself or `<dir>/<model id>`); else the Hugging Face hub through
`snapshot_download`. Weights: `model.safetensors.index.json` (sharded) or every
`*.safetensors` file; both the original DeepSeek per-expert names and
transformers' fused expert tensors. `load_format="dummy"` makes random weights
of the right shapes directly on the target device. Pickle files are never read.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from deepinfer import envs
from deepinfer.model_config import PRESETS_DIR, ModelConfig, known_models
from executors.distributed.expert_parallel import ExpertParallel
from executors.models.deepseek import DeepseekForCausalLM, fuse_projections
from executors.models.fp8 import convert_to_fp8, finish_fp8, quantize_into
from executors.models.moe import MoE, shard_experts
from executors.models.mtp import DeepseekMTP

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_HUB_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt"]
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$"
)
_FP8_FORMATS = {"fmt": ("e4m3",), "activation_scheme": ("dynamic",)}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_FUSED_EXPERTS = tuple(
    f"experts.{w}{s}" for w in ("gate_up_proj", "down_proj") for s in ("", "_scale_inv")
)
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the main model's are used


def resolve_model_dir(model: str, *, revision: str | None = None, weights: bool = True) -> Path:
    """Local directory for `model` (a path or a hub id), downloading it if needed.
    `revision` (a hub branch, tag or commit) only for a model from the hub."""
    path = Path(model).expanduser()
    from executors.demo import DEMO_MODEL_NAME, demo_model_path

    local = path.is_dir() or model == DEMO_MODEL_NAME or model.lower() in known_models()
    if revision is not None and (local or envs.hf_model_dir()):
        where = "DEEPINFER_HF_MODEL_DIR's copy" if not local else f"{model!r}, which is local"
        raise ValueError(
            f"revision={revision!r}: a revision picks a version of a Hugging Face hub "
            f"repository, and the model is {where}; drop it, or name the hub id"
        )
    if path.is_dir():
        return path
    if model == DEMO_MODEL_NAME:  # the small trained model shipped with the package
        return demo_model_path()
    if model.lower() in known_models():  # a preset: its published config.json, no weights
        if weights:
            raise FileNotFoundError(
                f"model {model!r} is a preset config with no weights on this machine; pass "
                "load_format='dummy' (random weights in its shapes) or a checkpoint directory"
            )
        return _preset_dir(model.lower())
    env = envs.hf_model_dir()
    if env:
        root = Path(env).expanduser()
        for cand in (root, root / model, root / model.split("/")[-1]):
            if (cand / "config.json").is_file():
                return cand
        raise FileNotFoundError(
            f"DEEPINFER_HF_MODEL_DIR={env}: no config.json in {root} nor in {root / model}"
        )
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model directory {model} does not exist")
    from huggingface_hub import snapshot_download

    patterns = _HUB_PATTERNS + (["*.safetensors"] if weights else [])
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except Exception as e:  # offline mode, no network, unknown repo, gated repo, ...
        raise RuntimeError(
            f"could not get model {model!r} (revision {revision or 'main'}) from the Hugging "
            f"Face hub: {type(e).__name__}: {e}. The hub may be unreachable or offline mode "
            "set; pass a local checkpoint directory or set DEEPINFER_HF_MODEL_DIR."
        ) from e


def _preset_dir(name: str) -> Path:
    """A directory holding the preset's config.json (for dummy weights)."""
    target = Path(tempfile.gettempdir()) / "deepinfer-presets" / name
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PRESETS_DIR / f"{name}.json", target / "config.json")
    return target


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir} (expected {path})")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def read_model_config(model_dir: Path) -> ModelConfig:
    """The checkpoint's config.json, parsed; refuses what this executor cannot run."""
    path = Path(model_dir) / "config.json"
    raw = read_hf_config(model_dir)
    cfg = ModelConfig.from_dict(raw, source=str(path), name=Path(model_dir).name)
    if cfg.quant_method is not None and cfg.quant_method != "fp8":
        raise ValueError(
            f"{path}: quantization_config ({cfg.quant_method}) is not supported by the torch "
            "executor; it runs fp8 (DeepSeek's block-scaled e4m3) and bf16/fp16/fp32 "
            "checkpoints (the simulator prices it as given)"
        )
    for key, accepted in _FP8_FORMATS.items() if cfg.quant_method == "fp8" else ():
        value = raw["quantization_config"].get(key, accepted[0])
        if value not in accepted:
            raise ValueError(
                f"{path}: quantization_config.{key}={value!r} is not supported by the torch "
                f"executor (it runs {key} {accepted[0]!r}, DeepSeek's FP8 checkpoints)"
            )
    return cfg


def resolve_dtype(
    cfg: ModelConfig, dtype: str | torch.dtype | None, device: torch.device
) -> torch.dtype:
    """The argument, else the checkpoint's dtype, else bf16 on CUDA and fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype not in (None, "auto") else cfg.dtype
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if str(name).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[str(name).removeprefix("torch.")]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: model_dir / file for name, file in weight_map.items()}
        for missing in sorted({p for p in files.values() if not p.is_file()}):
            raise FileNotFoundError(f"{index} lists {missing.name}, which is not in {model_dir}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        hint = f" (found {pickles}: pickle checkpoints are not read)" if pickles else ""
        raise FileNotFoundError(
            f"no model.safetensors.index.json nor *.safetensors weights in {model_dir}{hint}"
        )
    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), shard))
    return files


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    with_mtp: bool,
    ep: ExpertParallel | None = None,
) -> DeepseekForCausalLM:
    """Uninitialised parameters allocated once, on `device`, in `dtype` (routers in fp32).
    With `ep` each MoE layer, the MTP layers' too, holds only this rank's experts (the
    drafter's passes then run in lock-step: executors/distributed/expert_parallel.py)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg)
        if with_mtp:
            model.mtp = DeepseekMTP(cfg)
        if ep is not None:
            ep.layers = shard_experts(model.model, ep)
            if model.mtp is not None:
                shard_experts(model.mtp, ep)
                mlp = model.mtp.drafting_mlp()
                ep.draft_layer = mlp if isinstance(mlp, MoE) else None
    model.to(dtype)
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.float()
    if cfg.quant_method == "fp8":
        convert_to_fp8(model, cfg)
    model.to_empty(device=device)
    fuse_projections(model)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    ep: ExpertParallel | None = None,
) -> DeepseekForCausalLM:
    """The checkpoint's weights (or random ones: load_format="dummy"); with `ep`, only this
    rank's experts of each MoE layer are read. cfg.quant_method "fp8" (an FP8 checkpoint,
    or `cfg.with_quantization("fp8")` of a bf16 one): the layout of executors/models/fp8.py,
    e4m3 tensors copied as they are and others quantized as they load."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {LOAD_FORMATS}")
    if cfg.quant_method == "fp8" and ep is not None:
        raise ValueError(
            "quantization fp8 with enable_expert_parallel: the expert exchange carries "
            "bf16 expert weights only; use one of the two"
        )
    if load_format == "dummy":
        model = build_model(cfg, dtype, device, cfg.num_nextn_predict_layers > 0, ep)
        init_dummy_weights(model, seed, experts_seed=None if ep is None else seed + 1 + ep.rank)
        finish_fp8(model, dtype)
        return model
    files = checkpoint_files(model_dir)
    mtp_prefixes = tuple(
        f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers)
    )
    with_mtp = bool(mtp_prefixes) and any(n.startswith(mtp_prefixes) for n in files)
    model = build_model(cfg, dtype, device, with_mtp, ep)
    _WeightFiller(model, cfg, with_mtp, ep).fill(files, device)
    finish_fp8(model, dtype)
    return model


@torch.no_grad()
def load_state_dict_into(
    model: DeepseekForCausalLM, cfg: ModelConfig, state: Mapping[str, torch.Tensor]
) -> None:
    """Fill `model` from an in-memory state dict in checkpoint names (e.g. transformers'
    own `state_dict()`), with the same name mapping and completeness checks as files."""
    filler = _WeightFiller(model, cfg, with_mtp=model.mtp is not None)
    filler.finish(filler.fill_tensors((name, state.__getitem__) for name in state))
    finish_fp8(model, model.lm_head.weight.dtype)  # (the LM head is never FP8)


@torch.no_grad()
def init_dummy_weights(
    model: nn.Module, seed: int = 0, std: float = 0.02, experts_seed: int | None = None
) -> None:
    """Random weights in place, generated on the parameters' device: norms 1, biases 0.
    experts_seed: routed experts draw from their own generator (expert parallelism: the
    ranks' expert shares differ in size, and the replicated weights must stay equal)."""
    gens: dict[tuple[torch.device, bool], torch.Generator] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("bias", "e_score_correction_bias")):
            p.zero_()
        elif name.endswith("_scale_inv"):
            continue  # filled with its FP8 weight
        else:
            own = experts_seed is not None and ".experts." in name
            s = experts_seed if own and experts_seed is not None else seed
            gen = gens.setdefault((p.device, own), torch.Generator(p.device).manual_seed(s))
            if p.dtype != torch.float8_e4m3fn:
                p.normal_(0.0, std, generator=gen)
                continue
            value = torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=gen)
            module = model.get_submodule(name.rsplit(".", 1)[0])
            block = getattr(module, "fp8_block")  # noqa: B009 (Linear or Experts)
            quantize_into(
                p, params[f"{name}_scale_inv"], value, block, name.endswith("gate_up_proj")
            )


class _WeightFiller:
    """Copies checkpoint tensors into parameters and checks every piece got filled."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        cfg: ModelConfig,
        with_mtp: bool,
        ep: ExpertParallel | None = None,
    ) -> None:
        self.cfg = cfg
        self.ep = ep  # only this rank's experts are read
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.with_mtp = with_mtp
        self.filled: dict[str, set[tuple[str, int]]] = defaultdict(set)

    def fill(self, files: dict[str, Path], device: torch.device) -> None:
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, file in files.items():
            by_file[file].append(name)
        unexpected: list[str] = []
        load_device = "cpu" if device.type == "meta" else str(device)
        for file, names in by_file.items():
            with safe_open(file, framework="pt", device=load_device) as f:
                unexpected += self.fill_tensors((name, f.get_tensor) for name in names)
        self.finish(unexpected)

    def fill_tensors(self, items: Iterable[tuple[str, Callable[[str], torch.Tensor]]]) -> list[str]:
        """Copy (name, getter) pairs in; returns the names the model has no place for."""
        unexpected = []
        for name, get in items:
            target = self._target(name)
            if target is None:
                continue
            if target[0] not in self.params:
                unexpected.append(name)
                continue
            self._copy(name, get(name), *target)
        return unexpected

    def finish(self, unexpected: list[str]) -> None:
        if unexpected:
            raise ValueError(
                f"checkpoint tensors this model has no place for: {unexpected[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}"
            )
        self._check_complete()

    def _target(self, name: str) -> tuple[str, str, int] | None:
        """checkpoint name -> (parameter name, piece kind, expert) or None to skip."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.cfg.num_hidden_layers:
            k = int(m.group(1)) - self.cfg.num_hidden_layers
            rest = m.group(2)
            if not self.with_mtp or k >= self.cfg.num_nextn_predict_layers or rest in _MTP_SHARED:
                return None
            block = "" if rest.startswith(_MTP_OWN) else "block."
            name = f"mtp.layers.{k}.{block}{rest}"
        e = _EXPERT.match(name)
        if e:
            param = e.group(1) + (".down_proj" if e.group(3) == "down_proj" else ".gate_up_proj")
            param += e.group(4) or ""  # an FP8 checkpoint's block scales
            expert = int(e.group(2))
            if self.ep is not None:
                expert -= self.ep.first_expert
                if not 0 <= expert < self.ep.num_local:
                    return None  # another rank's expert
            return param, e.group(3), expert
        return name, "all", -1

    def _copy(self, name: str, tensor: torch.Tensor, param: str, kind: str, expert: int) -> None:
        p = self.params[param]
        fused_experts = param.endswith(_FUSED_EXPERTS)
        if self.ep is not None and fused_experts and kind == "all":
            # A fused [E, ...] checkpoint tensor: this rank's rows.
            tensor = tensor[self.ep.first_expert : self.ep.first_expert + self.ep.num_local]
        dst = self._piece(p.data, kind, expert)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name}: shape {tuple(tensor.shape)}, the model "
                f"expects {tuple(dst.shape)} (config.json disagrees with the weights?)"
            )
        fp8 = torch.float8_e4m3fn
        if tensor.dtype == fp8 and p.dtype != fp8:
            raise ValueError(
                f"checkpoint tensor {name} is float8_e4m3fn, and this model holds "
                f"{param} in {p.dtype} (config.json's quantization_config disagrees with "
                "the weights?)"
            )
        pieces = self._pieces(param) if kind == "all" else {(kind, expert)}
        if p.dtype == fp8 and tensor.dtype != fp8:  # a bf16 checkpoint served in FP8
            scale = f"{param}_scale_inv"
            module = self.modules[param.rsplit(".", 1)[0]]
            block = getattr(module, "fp8_block")  # noqa: B009 (Linear or Experts)
            halves = kind == "all" and param.endswith("gate_up_proj")
            s_dst = self._piece(self.params[scale].data, kind, expert)
            quantize_into(dst, s_dst, tensor.to(dst.device), block, halves)
            self.filled[scale] |= pieces
        else:
            dst.copy_(tensor)
        self.filled[param] |= pieces

    @staticmethod
    def _piece(dst: torch.Tensor, kind: str, expert: int) -> torch.Tensor:
        """The part of a parameter one checkpoint tensor fills: all of it, or one expert's
        rows (gate rows first, then up rows; a scale's block rows the same way)."""
        if kind == "all":
            return dst
        dst = dst[expert]
        half = dst.shape[0] // 2
        return {"gate_proj": dst[:half], "up_proj": dst[half:]}.get(kind, dst)

    def _pieces(self, param: str) -> set[tuple[str, int]]:
        if param.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale_inv")):
            n = self.params[param].shape[0]
            return {(k, e) for e in range(n) for k in ("gate_proj", "up_proj")}
        if param.endswith(("experts.down_proj", "experts.down_proj_scale_inv")):
            return {("down_proj", e) for e in range(self.params[param].shape[0])}
        return {("all", -1)}

    def _check_complete(self) -> None:
        missing = []
        for param in self.params:
            for kind, e in sorted(self._pieces(param) - self.filled[param]):
                scale = "_scale_inv" if param.endswith("_scale_inv") else ""
                missing.append(
                    param
                    if kind == "all"
                    else f"{param.rsplit('.', 1)[0]}.{e}.{kind}.weight{scale}"
                )
        if missing:
            missing = [_checkpoint_name(n, self.cfg) for n in missing]
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}"
            )


def _checkpoint_name(param: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the checkpoint's (MTP layers live at model.layers.{N + k})."""
    m = re.match(r"^mtp\.layers\.(\d+)\.(block\.)?(.*)$", param)
    if not m:
        return param
    return f"model.layers.{cfg.num_hidden_layers + int(m.group(1))}.{m.group(3)}"

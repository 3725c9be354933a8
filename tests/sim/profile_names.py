"""What a shipped profile's file name says:
<model>[__<quantization>]__<hardware>[__batch_invariant].json."""

from __future__ import annotations

from pathlib import Path

from deepinfer.model_config import ModelConfig, load_model_config
from sim.hardware import HardwareSpec, get_hardware


def named_model(path: Path, model_dir: Path | None = None) -> tuple[ModelConfig, HardwareSpec]:
    """The model (with its quantization) and the hardware a profile was measured on;
    model_dir: where the model's config lives when its name is not a preset."""
    parts = path.stem.removesuffix("__batch_invariant").split("__")
    model = load_model_config(model_dir or parts[0])
    if len(parts) == 3:
        model = model.with_quantization(parts[1])
    return model, get_hardware(parts[-1])

"""Where a profile's numbers come from: the device, the software versions, the commit,
and what of the executor changes its step times (a profile's meta, and a real run's step
log header, deepinfer/step_log_file.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.step_log_file import StepLogWriter, step_log_header


def hardware_name(device: Any) -> str:
    """The simulator's hardware preset for this device ("h200", "h100", ...) or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "h800", "b200", "a100"):
        if key in name:
            return key
    return name.replace("nvidia", "").strip().replace(" ", "-")


def environment(executor: Any) -> dict[str, Any]:
    """Device, software versions and commit: where a profile's numbers come from."""
    import platform
    import subprocess

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str | None:
        try:
            run = subprocess.run(
                ["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD") or None
    # Files that differ from that commit: the numbers are not the commit's alone (a copied
    # working tree, as on the device machine, keeps an older .git beside newer files).
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    dev = executor.device
    backend = envs.kernel_backend()  # the kernels its steps ran (kernels.ops.use_triton)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "torch"
    return {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "hardware": hardware_name(dev),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit,
        "commit_dirty": None if status is None else bool(status),
        "cpu_threads": torch.get_num_threads(),
        "kernel_backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def executor_meta(executor: Any, config: EngineConfig) -> dict[str, Any]:
    """`environment` and what of the executor its step times depend on."""
    runner = executor.runner
    return {
        **environment(executor),
        "dtype": str(executor.dtype).removeprefix("torch."),
        "cuda_graphs": runner.graphs is not None,
        # Verify steps whose requests all score 1 + K tokens replay these graphs.
        "verify_graphs": runner.verify_graphs is not None,
        # Batch-invariant kernels are slower: the simulator prices each mode only with
        # a profile measured in it (sim/cost_model_registry.py check_mode).
        "batch_invariant": config.batch_invariant,
        # FP8 weights stream at half the bytes: priced only by an FP8 profile.
        "quantization": executor.config.quant_method,
        # Steps up to this many tokens replay piecewise graphs; larger ones run eagerly.
        "piecewise_max_tokens": pw.max_size if (pw := runner.piecewise) else 0,
    }


def step_log_writer(
    path: str | Path, executor: Any, config: EngineConfig, model: str
) -> StepLogWriter:
    """A step log of a run of `executor` (the torch one): its header names `model` as
    the simulator loads it (a preset run on random weights, else the checkpoint's
    directory), the hardware preset of its device and its executor's meta."""
    from deepinfer.model_config import known_models

    name = model if model in known_models() else str(executor.model_dir)
    meta = executor_meta(executor, config)
    header = step_log_header(name, meta["hardware"], config, "torch", meta)
    return StepLogWriter(path, header)

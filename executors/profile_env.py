"""Where a profile's numbers come from: the device, the software versions, the commit."""

from __future__ import annotations

import time
from typing import Any

from deepinfer import envs


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
    from pathlib import Path

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

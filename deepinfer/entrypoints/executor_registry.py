"""Executors by name ("sim", "torch"), for the entry points that take a name.

The core never builds an executor: it is handed one. This registry lives above it
and imports an executor's module only when it is asked for, so importing
`deepinfer` pulls in neither simpy nor torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> "module:attribute" of a factory taking (engine_config, **kwargs)
_REGISTRY: dict[str, str] = {
    "sim": "sim.sim_executor:SimExecutor",
    "torch": "executors.torch_executor:TorchExecutor",
}


def register_executor(name: str, target: str) -> None:
    """Register `target` ("module:attribute") under `name`."""
    _REGISTRY[name] = target


def get_executor_class(name: str) -> Callable[..., Any]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown executor {name!r}; known: {sorted(_REGISTRY)}")
    module, _, attr = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), attr)

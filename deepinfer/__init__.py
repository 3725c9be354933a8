"""deepinfer: an inference engine and scheduler simulator for DeepSeek-architecture models.

Importing this package pulls in neither torch nor simpy; `LLM` (the real
executor's offline API) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.errors import SchedulerStalled
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineRole",
    "RequestOutput",
    "SamplingParams",
    "SchedulerStalled",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from deepinfer.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")

"""The Executor protocol: what the core asks of the executor it is handed.

Executors live outside the core (`sim`, `executors`); the entry points build one
(`deepinfer.entrypoints.executor_registry` names them) and hand it to `EngineCore`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    """Runs one scheduled step.

    `needs_token_ids`: whether `ScheduledRequest.token_ids` must be filled
    (a real model needs them; the simulator does not).
    """

    needs_token_ids: bool

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the step and return the sampled tokens (blocking)."""
        ...

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Start the step and return a handle; `.result()` blocks for it."""
        ...

    def num_kv_blocks(self) -> int:
        """KV blocks this executor's cache holds (the scheduler's pool size)."""
        ...

    def shutdown(self) -> None: ...


class StepHandle(Protocol):
    """What `execute_async` returns: a `concurrent.futures.Future` fits, or `Done`."""

    def result(self, timeout: float | None = None) -> ModelRunnerOutput: ...


class Done:
    """A handle already holding its result, for executors with no real overlap (a Future
    would do, but costs a lock per step that the simulator pays a hundred thousand times)."""

    __slots__ = ("_value",)

    def __init__(self, value: ModelRunnerOutput) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self._value

    def done(self) -> bool:
        return True


def completed(result: ModelRunnerOutput) -> Done:
    """A handle already holding its result."""
    return Done(result)

"""The handle of a launched step (ModelRunner.launch), what `execute_async` returns.

Launching queues a step's device work (the forward and the sampler's kernels) and
returns at once; `result()` waits for the device, reads the sampled tokens back and
applies them to the runner's request state. Async scheduling launches step N+1
before it asks for step N's result, so the host's work for both hides behind the
device's; N+1 reads N's tokens from `tokens`, on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.executor import StepHandle
from deepinfer.outputs import ModelRunnerOutput
from executors.spec_chain import Chained


@dataclass
class StepResult:
    output: ModelRunnerOutput
    # The step's sampled logits [N, vocab] and each request's rows in them (first, count).
    sampled_logits: torch.Tensor | None = None
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def logits(self) -> dict[str, torch.Tensor]:
        """req_id -> [rows, vocab]: the logits its tokens were sampled from (for tests and
        logprobs; sliced on demand, not for every request of every step)."""
        if self.sampled_logits is None:
            return {}
        return {rid: self.sampled_logits[a : a + n] for rid, (a, n) in self.rows.items()}


class PendingStep(StepHandle):
    """A step whose results may still be on the device.

    `tokens` [num_sampled] int64 (device): each sampling request's token, in the order of
    `rows` (req_id -> index); set while the result is unread, for the next step to read.
    A verify step on the device leaves `chain` (executors/spec_chain.py): `tokens` then
    holds `chain.width` next input ids a request (its newest token, then its drafts).
    """

    def __init__(
        self,
        finish: Callable[[], StepResult] | None = None,
        *,
        result: StepResult | None = None,
        tokens: torch.Tensor | None = None,
        rows: dict[str, int] | None = None,
        chain: Chained | None = None,
    ) -> None:
        assert (finish is None) != (result is None)
        self._finish = finish
        self._result = result
        self._error: BaseException | None = None
        self.tokens = tokens
        self.rows = rows or {}
        self.chain = chain
        # CUDA events on the compute stream around the launch's device work (the
        # executor's `execute_async` records them), then their span once read.
        self.events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._device_s: float | None = None

    @classmethod
    def failed(cls, error: BaseException) -> PendingStep:
        """A handle whose result is `error`."""

        def raise_() -> StepResult:
            raise error

        return cls(raise_)

    def done(self) -> bool:
        """Whether the result was read (or reading it failed)."""
        return self._finish is None

    def step_result(self) -> StepResult:
        """Wait for the step and apply it (once); a failure is raised on every call."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.tokens = self.chain = None
            try:
                self._result = finish()
            except BaseException as e:
                self._error = e
                raise
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self.step_result().output

    @property
    def times_device(self) -> bool:  # type: ignore[override]
        return self.events is not None or self._device_s is not None

    def device_seconds(self, wait: bool = False) -> float | None:
        """The span between the step's events (StepHandle.device_seconds): read once the
        end event has been passed (`query()`, which does not synchronise), or after
        waiting for it with `wait`."""
        if self._device_s is None and self.events is not None:
            start, end = self.events
            if wait:
                end.synchronize()
            elif not end.query():
                return None
            self._device_s = max(start.elapsed_time(end), 0.0) / 1e3
            self.events = None
        return self._device_s

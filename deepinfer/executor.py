"""The executor contract: `Executor`, and the `StepHandle` its launch returns.

Every hook the core calls is declared here: abstract where each executor must say
(`execute`, `num_kv_blocks`, `needs_token_ids`; a handle's `result`), with its default
where most executors have nothing to add. An executor subclasses `Executor` and
overrides what it does differently; the core calls every hook without asking whether
it is there.

Executors live outside the core (`sim`, `executors`); the entry points build one
(`deepinfer.entrypoints.executor_registry` names them) and hand it to `EngineCore`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from deepinfer.kv_cache.tiers import KVTiers
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request

if TYPE_CHECKING:  # (only an engine of a disaggregated pair hands KV over)
    from deepinfer.kv_cache.handover import KVHandover


class StepHandle(ABC):
    """What `Executor.execute_async` returns: a launched step, its result to come.

    The engine reads `done()` and `ran_in_launch` right after the launch returns, to
    time the step (EngineCore._launch), and calls `result()` once, when it applies it.
    """

    __slots__ = ()

    # The launch ran the step's work before it returned (the device is the host's CPU),
    # though its result may be unread: the step ended when the launch returned.
    ran_in_launch: bool = False
    # The executor times the step's device work: `device_seconds` gives it, now or later.
    times_device: bool = False

    @abstractmethod
    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        """Wait for the step and return its output; raises what the step raised."""

    def done(self) -> bool:
        """Whether the result is there already (default False: not known). True when
        the launch returned it ready: the launch did the step's work."""
        return False

    def device_seconds(self, wait: bool = False) -> float | None:
        """The device's span of the step's work in seconds (from where the device reached
        the step's first work to where it passed its last), for the step log; None where
        the executor does not time its device (the default: the simulator, a CPU, whose
        step's duration is its own time) or, without `wait`, while the device has not
        passed the step's end yet (asking then never waits for the device; a step later
        it has, by the stream's order). With `wait` it waits for the device."""
        return None


class CompletedStep(StepHandle):
    """A handle already holding its result, for executors with no real overlap (a Future
    would do, but costs a lock per step that the simulator pays a hundred thousand times)."""

    __slots__ = ("_value",)

    def __init__(self, value: ModelRunnerOutput) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self._value

    def done(self) -> bool:
        return True


class Executor(ABC):
    """Runs the steps the scheduler plans: `SchedulerOutput` in, `ModelRunnerOutput` out.

    `needs_token_ids` (no default: every executor says): whether
    `ScheduledRequest.token_ids` must be filled (a real model needs them; the simulator
    does not). Read once, when the EngineCore is built.
    `vocab_size` (default None: not known): the model's vocabulary; the scheduler
    rejects a prompt with a token outside [0, vocab_size), and so does `LLM.generate`.
    """

    needs_token_ids: bool
    vocab_size: int | None = None
    # Whether `execute_decode_run` gives a decode run's tokens without running its steps:
    # only an executor whose tokens are a function of the request and position (the
    # simulator's) can; the engine offers decode runs only then.
    can_fast_forward: bool = False

    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks this executor's cache holds (the scheduler's pool size); read once,
        when the EngineCore is built."""

    def kv_tiers(self, given: KVTiers | None) -> KVTiers | None:
        """The KV tiers below HBM that this engine's prefix blocks move through (read once,
        when the EngineCore is built): by default `given`, the tiers whoever runs the
        executor built (the simulator sizes them from the model's KV bytes and prices
        their copies). An executor that copies the blocks (`SchedulerOutput.kv_loads`,
        `kv_saves`) builds the tiers of its own memory and refuses others by name."""
        return given

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the step and return the sampled tokens (blocking)."""

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Launch the step and return its handle; the engine calls this for every step.
        Default: run the step now (`execute`) and hand back its result."""
        return CompletedStep(self.execute(out))

    def execute_decode_run(
        self,
        req_ids: Sequence[str],
        contexts: Sequence[int],
        num_steps: Sequence[int],
        dropped_req_ids: frozenset[str],
    ) -> list[list[int]]:
        """The tokens of consecutive decode steps of these requests, without a
        SchedulerOutput per step: request i decodes one token a step in num_steps[i]
        steps, step s at context contexts[i] + s; [i] lists its tokens in step order. A
        request with fewer steps than the run's longest ends within it. dropped_req_ids:
        requests the first step would have told the executor to drop (ended or
        preempted). Called by `EngineCore.advance_decode`, only where `can_fast_forward`."""
        raise TypeError(
            f"the {type(self).__name__} executor cannot fast-forward decode runs "
            "(can_fast_forward is False): its tokens come from running the steps"
        )

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether `out`, launched now, runs beside the step in flight (default True).
        Asked under async scheduling before each launch; False makes the engine apply the
        step in flight first (the executor must read its results on the host: grammars,
        samplers that read a request's history)."""
        return True

    def prepare_grammar(self, so_args: dict[str, Any]) -> Future[Any]:
        """Start compiling `so_args`'s grammar (a future of it); ValueError when this
        executor cannot serve structured outputs (the default: it cannot). Called when a
        structured request is added to an executor that `needs_token_ids`."""
        raise ValueError(
            f"SamplingParams.so_args: the {type(self).__name__} executor does not support "
            "structured outputs"
        )

    def export_kv(self, request: Request, num_tokens: int) -> KVHandover:
        """The KV of `request`'s positions [0, num_tokens), copied out of this executor's
        cache while it still holds the request (a prefill engine's request that just
        ended, before the engine's next step). ValueError when this executor cannot (the
        default: it cannot) or holds no such KV."""
        raise ValueError(
            f"the {type(self).__name__} executor cannot export a request's KV cache "
            "(a prefill engine of a disaggregated setup needs one that can)"
        )

    def import_kv(self, handover: KVHandover) -> None:
        """Keep `handover` until the engine schedules its request with the block table
        (a decode engine's request: `ScheduledRequest.num_cached_blocks` short of its
        computed tokens), then fill the request's blocks from it before that step's
        forward. ValueError when this executor cannot (the default) or the KV does not
        fit its cache (another model, dtype or layer count)."""
        raise ValueError(
            f"the {type(self).__name__} executor cannot import a request's KV cache "
            "(a decode engine of a disaggregated setup needs one that can)"
        )

    def settle_kv_saves(self, out: SchedulerOutput) -> None:  # noqa: B027 (a default)
        """`out` will never run (it failed, or it was scheduled after a step that failed
        and never launched), yet its schedule moved prefix blocks down a KV tier
        (`out.kv_saves`): the tier's bookkeeping holds them, so their KV must get there.
        Their HBM blocks are unwritten since (no step launched after `out`). Default:
        nothing copied (the simulator prices the moves, it performs none)."""

    def discard_pending(self) -> None:  # noqa: B027 (a default that does nothing)
        """The engine dropped its step in flight (a step failed, or `discard_in_flight`):
        its result will never be read. Default: nothing to forget."""

    def shutdown(self) -> None:  # noqa: B027 (a default that does nothing)
        """Release what the executor holds (device memory, workers). Default: nothing."""

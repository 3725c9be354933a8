"""The simulated twin of a served engine (`deepinfer serve --executor sim`).

The same EngineCore as the real server, over a simulated executor, stepping in
wall-clock time: each step is released when the cost model's price of it has passed
(`WallClockPacer`), so a client, a router or a load generator sees a server with the
timing of the modelled deployment (its queueing, batching and preemption are the real
scheduler's) without its hardware. Its tokens are ids of the model's vocabulary drawn at
random (`VocabularySimExecutor`), never an end or special token: a request runs to its
max_tokens (or a stop string), as a benchmark's ignore_eos request does.

The pacing is the simulator's rule (`sim/simulator.py`, `_serve`): host time after each
schedule, the device's from each launch (under async scheduling a step launched behind
a running one starts when that one ends; one launched on an idle device pays its host
part too), an await waits for the step's result; here time passes by sleeping until then.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore, StepEventKind
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from sim.acceptance import AcceptanceModel
from sim.cost_model import CostModel, mask_time
from sim.cost_model_registry import engine_cost_model
from sim.hardware import HardwareSpec, get_hardware
from sim.kv_capacity import engine_kv_blocks
from sim.sim_executor import SimExecutor

_SCHEDULED, _LAUNCHED = StepEventKind.SCHEDULED, StepEventKind.LAUNCHED


class VocabularySimExecutor(SimExecutor):
    """A SimExecutor whose tokens are ids of the model's vocabulary.

    Each token is a function of the request's seed (or, unseeded, of its id) and its
    position, folded onto the vocabulary less `excluded` (end and special tokens): a
    seeded request repeats its tokens. Drafts are accepted as SimExecutor accepts them.
    It does not fast-forward decode runs: the twin runs every step in wall-clock time,
    and a run's tokens would lack the vocabulary's folding and the seed's salt.
    """

    can_fast_forward = False

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        excluded: Iterable[int] = (),
        *,
        acceptance_rate: float | AcceptanceModel = 0.7,
    ) -> None:
        super().__init__(config, num_blocks, acceptance_rate=acceptance_rate)
        self.vocab_size = vocab_size  # the scheduler rejects prompts outside it
        skip = set(excluded)
        self._allowed = [t for t in range(vocab_size) if t not in skip]
        if not self._allowed:
            raise ValueError(f"vocab_size={vocab_size}: no token left to draw")

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for sr in out.scheduled:  # (sampling params come with a request's whole table)
            sp = sr.sampling_params
            if sp is not None and sp.seed is not None:
                self._salts[sr.req_id] = zlib.crc32(f"seed:{sp.seed}".encode())
        res = super().execute(out)
        allowed, n = self._allowed, len(self._allowed)
        for tokens in (res.sampled_token_ids, res.draft_token_ids):
            for rid, ids in tokens.items():
                tokens[rid] = [allowed[t % n] for t in ids]
        return res


class WallClockPacer:
    """Runs `EngineCore.step_events` in wall-clock time, releasing each step once the
    cost model's price of it has passed (the simulator's rule, with sleeps).

    `step(core)` is one engine step, as `EngineCore.step()` is; the engine's clock must
    be `clock` (time.monotonic by default).
    """

    def __init__(
        self,
        cost: CostModel,
        *,
        on_host: bool = False,
        mask_per_token_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cost = cost
        self.on_host = on_host
        self.mask_per_token_s = mask_per_token_s
        self._clock = clock
        self._sleep = sleep
        self._host_free = self._device_free = 0.0
        self._ready_at: dict[int, float] = {}  # step id -> when its results are back

    def step(self, core: EngineCore) -> list[Request]:
        events = core.step_events()
        while True:
            try:
                kind, out = next(events)
            except StopIteration as done:
                return done.value
            now = self._clock()
            if kind is _SCHEDULED:
                self._host_free = max(self._host_free, now) + self.cost.cpu_time(out)
                self._sleep_until(self._host_free)
            elif kind is _LAUNCHED:
                self._launched(out, max(self._host_free, now))
            else:
                done_at = self._ready_at.pop(out.step_id, now)
                self._sleep_until(max(done_at, self._host_free))

    def _launched(self, out: SchedulerOutput, start: float) -> None:
        masks = mask_time(out, self.mask_per_token_s) if self.mask_per_token_s else 0.0
        if self.on_host:  # the launch runs the step: the host is busy until it ends
            self._host_free = self._device_free = start + masks + self.cost.step_time(out)
        else:  # (as the simulator's Timeline.launched)
            priced, idle = self.cost.launch_cost(out)
            self._host_free = start + self.cost.launch_seconds(out) + masks
            self._device_free = max(self._device_free, start + idle) + priced
        self._ready_at[out.step_id] = max(self._device_free, self._host_free)

    def _sleep_until(self, t: float) -> None:
        wait = t - self._clock()
        if wait > 0:
            self._sleep(wait)


def twin_engine(
    engine: EngineConfig,
    spec: ModelConfig,
    hardware: str | HardwareSpec = "h200",
    cost_model: str | None = None,
    *,
    profile: str | Path | None = None,
    acceptance_rate: float | str | Path = 0.7,
    excluded_tokens: Iterable[int] = (),
) -> tuple[EngineCore, WallClockPacer, dict[str, Any]]:
    """The twin's EngineCore (wall clock, vocabulary tokens), its pacer, and what the
    simulator's report says of the cost model (name, calibrated, profile). The KV cache
    is sized as `simulate` sizes it."""
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    if engine.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={engine.data_parallel_size}: the simulated server runs one "
            "rank (`deepinfer simulate` models several)"
        )
    spec = spec.with_quantization(engine.quantization)
    cost, meta = engine_cost_model(cost_model, spec, hw, profile, engine)
    num_blocks = engine_kv_blocks(spec, hw, engine, check_fit=cost_model != "unit")
    spec.check_max_model_len(engine.max_model_len)
    acceptance: float | AcceptanceModel = (
        AcceptanceModel.load(acceptance_rate)
        if isinstance(acceptance_rate, (str, Path))
        else acceptance_rate
    )
    executor = VocabularySimExecutor(
        engine, num_blocks, spec.vocab_size, excluded_tokens, acceptance_rate=acceptance
    )
    core = EngineCore(
        engine,
        executor,
        clock=time.monotonic,
        model_max_len=spec.max_position_embeddings,
        record_steps=False,
    )
    pacer = WallClockPacer(
        cost, on_host=hw.runs_on_host, mask_per_token_s=cost.grammar_mask_per_token_s
    )
    meta = dict(meta, hardware=hw.name, num_gpu_blocks=num_blocks)
    return core, pacer, meta

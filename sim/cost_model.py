"""What a simulated step costs: the CostModel contract, and the unit model.

The simulator advances its clock by `step_time(out)` (the device) and `cpu_time(out)`
(the host, which async scheduling overlaps with the previous step's device time).
Every hook the simulator calls is declared on `CostModel`, with its default: a cost
model subclasses it and overrides what it prices. Structured outputs are priced by
`grammar_mask_per_token_s`: `mask_time(out, per_token)` of host work that fills the
step's token masks while the device runs its forward, so only the part longer than
the device time delays the step.

The cost models by name ("profiled", "analytic", "unit") are in
sim/cost_model_registry.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from deepinfer.kv_cache.tiers import step_copies

if TYPE_CHECKING:
    from deepinfer.decode_run import DecodeRun
    from deepinfer.model_config import ModelConfig
    from deepinfer.outputs import SchedulerOutput
    from sim.hardware import HardwareSpec

# (cpu_time, launch_cost's two figures, launch_seconds) of each step of a decode run, in
# order.
RunCosts = Iterator[tuple[float, float, float, float]]

__all__ = [
    "CostModel",
    "device_span",
    "EngineSettings",
    "KVLoadPricing",
    "RunCosts",
    "UnitCostModel",
    "mask_time",
    "prices_decode_runs",
]


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings a step's price can depend on besides its shape: the drafts
    verified a step, whether host work overlaps the device's (pipelined step times), and
    the limits that choose which graphs and token buckets the real runner captures."""

    num_speculative_tokens: int = 0
    async_scheduling: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


class CostModel(ABC):
    """Prices one step. Pure: the same SchedulerOutput always costs the same.

    `profile_name` and `meta` (defaults None and empty): the profile the model fitted and
    what it says of its measurement (block size, kernel backend, batch-invariant mode);
    `simulate` warns where they differ from the engine it prices.
    """

    profile_name: str | None = None
    meta: Mapping[str, Any] = MappingProxyType({})

    @abstractmethod
    def step_time(self, out: SchedulerOutput) -> float:
        """Device seconds to execute `out`; 0.0 for an empty step. Called at each launch
        (through `launch_cost` where the device is not the host)."""

    def cpu_time(self, out: SchedulerOutput) -> float:
        """Host seconds spent around `out` (scheduling, input prep, output processing),
        charged after each schedule. Default 0.0: host time is not modelled."""
        return 0.0

    def launch_cost(self, out: SchedulerOutput) -> tuple[float, float]:
        """(`step_time(out)`, the seconds more `out` costs when launched on an idle
        device): the simulator prices each launch under async scheduling with this one
        call, so a model that needs a second fit for the idle case reads the step once.
        Default: the step costs the same whatever runs before it (0.0 more)."""
        return self.step_time(out), 0.0

    def launch_seconds(self, out: SchedulerOutput) -> float:
        """Host seconds the launch of `out` takes (read after `launch_cost` of the same
        step): the host is busy meanwhile. A model that prices it apart prices the
        device's own work in `launch_cost` (its first figure), the rest of the step's
        sequential time in the second: a step whose launch outlasts its kernels (the host
        issuing a piecewise step's eager attention layer by layer) then ends a sequential
        time after its launch began, under async scheduling while the step before it
        runs on the device. Default 0.0: a launch is instant (the device price holds
        whatever of it the device waits for)."""
        return 0.0

    def for_engine(
        self, model: ModelConfig, hardware: HardwareSpec, settings: EngineSettings
    ) -> CostModel:
        """This model as it prices the steps of an engine of these settings (`simulate`
        asks each object it is given): a model built for other settings returns one built
        for these, and one that cannot price this model or hardware raises ValueError.
        Default: itself (its prices do not depend on them)."""
        return self

    def decode_run_costs(self, run: DecodeRun) -> RunCosts | None:
        """The run's steps priced one after another without a SchedulerOutput each: for
        step s (every request decoding one token at its context + s), exactly the floats
        `cpu_time(out)`, `launch_cost(out)` and `launch_seconds(out)` give for that step's
        `out`, up to `run.horizon` steps; the simulator fast-forwards through the run with
        them.
        Default None: this model prices only whole outputs, and the simulator runs
        single steps."""
        return None

    @property
    def grammar_mask_per_token_s(self) -> float:
        """Host seconds to fill one token mask of a structured request (`mask_time`), read
        once by `simulate` unless it is given one. Default 0.0: masks are free."""
        return 0.0


def prices_decode_runs(cost: CostModel) -> bool:
    """Whether `cost.decode_run_costs` is the model's own account of its steps: a subclass
    that overrides `step_time`, `cpu_time`, `launch_cost` or `launch_seconds` below the
    class that defines `decode_run_costs` would have its runs priced by the parent's
    formula, so it gets single steps (and so does a model that defines no run pricing)."""
    cls = type(cost)
    owner = _definer(cls, "decode_run_costs")
    if owner is CostModel:
        return False
    hooks = ("step_time", "cpu_time", "launch_cost", "launch_seconds")
    return all(issubclass(owner, _definer(cls, hook)) for hook in hooks)


def _definer(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


def device_span(priced: float, idle: float, behind: float | None) -> float:
    """The device's span of a step's work as the simulator's timeline makes it
    (`Timeline.launched`: from its launch, or from the end of the step before where that
    is later, to its end), from its `launch_cost` (priced, idle): on an idle device
    (behind None) its sequential time; launched behind a step with `behind` device
    seconds left, its device price and what its idle-launch part outlasts that step."""
    if behind is None:
        return priced + idle
    return priced + (idle - behind if idle > behind else 0.0)


def mask_time(out: SchedulerOutput, per_token_s: float) -> float:
    """Host seconds filling the grammar token masks of `out`'s structured requests: one
    mask per sampled position (each verified draft too)."""
    n = 0
    for r in out.scheduled:
        if r.structured and r.will_sample:
            n += 1 + len(r.draft_token_ids)
    return n * per_token_s


class KVLoadPricing:
    """Device seconds a step waits for its loads from the lower KV tiers
    (`SchedulerOutput.kv_loads`), added to its priced time by the engine loop whatever the
    cost model. The loads priced are those that cross a link (the core's `step_copies`:
    a load of a block the same step saved reads the save, a device copy, and costs
    nothing): per tier, the link's latency plus the blocks' bytes at its bandwidth; the
    tiers' links (PCIe from host DRAM, the network from the store) run side by side, so
    the step waits for the slower.

    As the torch executor copies (executors/host_kv_tier.py): a step's loads start once
    the step before has run (its copy stream waits for the compute stream: the step
    gathers its saves from blocks the step before wrote) and its forward waits for them,
    so they add to the step's device time, not hidden behind the step before; its saves
    cross the link beside the forward, and cost it nothing. Not priced: the device copies
    (the gather of the saves, the loads' scatter into their blocks, a load from the
    step's own save), a block read and written at HBM's bandwidth, some 30 times less
    than its way over PCIe by the datasheets; and a load of a slot whose save from an
    earlier step is still crossing the link, which waits for it (the simulator keeps no
    clock of the saves' link). A decode step never loads (decode runs are priced without
    it)."""

    __slots__ = ("block_bytes", "links")

    def __init__(self, block_bytes: int, links: Mapping[str, tuple[float, float]]) -> None:
        self.block_bytes = block_bytes
        self.links = dict(links)  # tier -> (bandwidth bytes/s, latency s)

    def seconds(self, out: SchedulerOutput) -> float:
        loads = out.kv_loads
        if not loads:
            return 0.0
        counts = step_copies(loads, out.kv_saves).link_loads(loads)
        worst = 0.0
        for tier, n in counts.items():
            bandwidth, latency = self.links[tier]
            worst = max(worst, latency + n * self.block_bytes / bandwidth)
        return worst


class UnitCostModel(CostModel):
    """Every non-empty step costs `step_seconds`; host time is `cpu_seconds` (default 0)."""

    def __init__(self, step_seconds: float = 0.001, cpu_seconds: float = 0.0):
        if step_seconds < 0 or cpu_seconds < 0:
            raise ValueError("UnitCostModel: step_seconds and cpu_seconds must be >= 0")
        self.step_seconds = step_seconds
        self.cpu_seconds = cpu_seconds

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_seconds if out.scheduled else 0.0

    def cpu_time(self, out: SchedulerOutput) -> float:
        return self.cpu_seconds if out.scheduled else 0.0

    def decode_run_costs(self, run: DecodeRun) -> RunCosts:
        return repeat((self.cpu_seconds, self.step_seconds, 0.0, 0.0), run.horizon)

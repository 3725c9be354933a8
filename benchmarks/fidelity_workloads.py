"""The fidelity benchmark's workloads: named recipes, each a slice of a bundled trace, the
arrival times it is replayed at, and the engine options it runs with on both sides.

`deepinfer bench fidelity --suite held-out` (or `--workloads NAME,...`) replays each
recipe through the real engine and the simulator. The profiles are fitted on a
synthetic step grid, so every recipe here is held out from them; the set spans what
users send: a trace's own arrival times (at its pace, and sped up to the engine's
capacity and past it), Poisson loads with async scheduling on and off, a small KV cache
that preempts, prefix reuse at set hit rates, speculation (k = 3, and variable-length
drafts), and long prompts.

Slices (the requests; sizes in tokens):
  azure-code     Azure LLM trace 2023, code: the 200 requests from its first dense
                 burst on (180 s into traces/azure_code_small.json), prompts ~2k,
                 outputs ~20
  conversation   Mooncake FAST'25 conversation: the first 40 requests that fit the
                 model, with their prefix blocks; prompts ~3k, outputs ~340
  long-prompts   the same Mooncake trace's requests with 16k-64k-token prompts (a model
                 with a longer context than Moonlight's 8k: DeepSeek-V2-Lite)

A recipe's load is one of: every request at t = 0 (offline); the trace's own arrival
times at `speed` times its pace; its own gaps scaled so that the mean rate is
`of_capacity` times the capacity the real engine measured offline on the same slice;
or a seeded Poisson process at `of_capacity` of that capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from deepinfer.config import EngineConfig
from sim.traces import Trace, load_trace, offline, poisson, retimed

TRACES = Path(__file__).resolve().parents[1] / "traces"
ARRIVALS = ("offline", "own", "poisson")
SUITES = {"held-out": "every held-out recipe (HELD_OUT)"}


@dataclass(frozen=True)
class TraceSlice:
    """Requests cut from a bundled trace: those arriving from `start_s` on (re-based so the
    first arrives at 0), with prompts in [min_prompt, max_prompt], prompt + output within
    the model's longest request, the first `num_requests` of them."""

    name: str
    trace: str  # file under traces/
    num_requests: int
    start_s: float = 0.0
    min_prompt: int = 1
    max_prompt: int | None = None

    def cut(self, limit: int, num_requests: int | None = None) -> Trace:
        """The slice for a model whose longest request is `limit` tokens: its first
        `num_requests` (default: the slice's own count)."""
        base = load_trace(TRACES / self.trace)
        reqs = [
            r
            for r in base.requests
            if r.arrival >= self.start_s
            and self.min_prompt <= r.prompt_len <= (self.max_prompt or r.prompt_len)
            and r.prompt_len + r.output_len <= limit
        ]
        reqs = reqs[: num_requests or self.num_requests]
        t0 = reqs[0].arrival if reqs else 0.0
        return Trace(self.name, base.source, [replace(r, arrival=r.arrival - t0) for r in reqs])

    def longest_needed(self) -> int:
        """The longest request (prompt + output) among those of the slice's prompt range,
        whatever the model: what a model must hold to run the slice as recipes mean it."""
        if self.max_prompt is None:
            return 0  # (the slice keeps the requests that fit: any model runs it)
        reqs = load_trace(TRACES / self.trace).requests
        return max(
            r.prompt_len + r.output_len
            for r in reqs
            if r.arrival >= self.start_s and self.min_prompt <= r.prompt_len <= self.max_prompt
        )


@dataclass(frozen=True)
class Workload:
    """One named load: a slice, its arrival times, and the engine options (`overrides`,
    EngineConfig fields) it runs with on the real engine and in the simulator alike."""

    name: str
    what: str  # one line for tables and --help
    slice: TraceSlice
    arrivals: str = "offline"  # one of ARRIVALS
    speed: float = 1.0  # own arrivals: the trace's pace times this
    # own or poisson: the mean rate as a fraction of the slice's offline capacity (req/s)
    of_capacity: float | None = None
    num_requests: int | None = None  # None: the slice's
    # The prefix blocks rewritten so that an unbounded cache would serve this fraction of
    # the prompt tokens (`with_prefix_hit`); None: the trace's own blocks.
    prefix_hit: float | None = None
    # The KV cache sized to this fraction of the slice's whole demand (every request's
    # prompt + output at once), so that a burst of them must preempt (`kv_blocks`).
    kv_fraction: float | None = None
    overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Speculation: drafts accepted at this rate per position on both sides (the real
    # engine through benchmarks/speculative.py's ForcedAcceptance: dummy weights draft
    # nothing a target accepts).
    acceptance: float | None = None

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"{self.name}: arrivals={self.arrivals!r}, expected {ARRIVALS}")
        if self.arrivals == "poisson" and self.of_capacity is None:
            raise ValueError(f"{self.name}: a Poisson load needs of_capacity")
        unknown = set(self.overrides) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"{self.name}: unknown engine option(s) {sorted(unknown)}")
        if self.speculates and self.acceptance is None:
            raise ValueError(f"{self.name}: speculation needs the acceptance both sides use")

    @property
    def speculates(self) -> bool:
        return bool(self.overrides.get("num_speculative_tokens")) or bool(
            self.overrides.get("enable_mtp_varlen")
        )

    @property
    def needs_capacity(self) -> bool:
        return self.of_capacity is not None

    def engine(self, base: EngineConfig, trace: Trace) -> EngineConfig:
        """`base` with this recipe's options; a KV fraction becomes num_gpu_blocks."""
        changes = dict(self.overrides)
        if self.kv_fraction is not None:
            changes["num_gpu_blocks"] = kv_blocks(trace, base.block_size, self.kv_fraction)
        return base.replace(**changes) if changes else base

    def load(self, trace: Trace, capacity: float | None, seed: int) -> Trace:
        """The slice's requests at this recipe's arrival times (and prefix blocks);
        `capacity`: the slice's offline capacity in requests/s, where the load is a
        fraction of it."""
        if self.prefix_hit is not None:
            trace = with_prefix_hit(trace, self.prefix_hit)
        if self.needs_capacity and not capacity:
            raise ValueError(f"{self.name}: needs the offline capacity of {self.slice.name}")
        if self.arrivals == "offline":
            out = offline(trace)
        elif self.arrivals == "poisson":
            assert capacity is not None and self.of_capacity is not None
            out = poisson(trace, self.of_capacity * capacity, seed=seed)
        elif self.of_capacity is not None:
            assert capacity is not None
            out = own_arrivals(trace, mean_rate(trace) / (self.of_capacity * capacity))
        else:
            out = own_arrivals(trace, 1.0 / self.speed)
        out.name = self.name
        return out


def own_arrivals(trace: Trace, scale: float) -> Trace:
    """The trace's own arrival times multiplied by `scale` (0.5: twice its pace)."""
    return retimed(trace, [r.arrival * scale for r in trace.requests], trace.name)


def mean_rate(trace: Trace) -> float:
    """Requests per second over the trace's span (n - 1 gaps)."""
    if len(trace) < 2 or trace.duration <= 0:
        raise ValueError(f"{trace.name}: fewer than two distinct arrivals, no rate")
    return (len(trace) - 1) / trace.duration


def kv_blocks(trace: Trace, block_size: int, fraction: float) -> int:
    """KV blocks for `fraction` of the trace's whole demand, never fewer than its longest
    request needs plus one (each request must fit alone, or the engine rejects it)."""
    need = [math.ceil((r.prompt_len + r.output_len) / block_size) for r in trace.requests]
    return max(math.ceil(fraction * sum(need)), max(need) + 1)


def ideal_hit_rate(trace: Trace) -> float:
    """The fraction of prompt tokens an unbounded prefix cache serves, requests taken in
    arrival order, each after the one before has computed its prompt: a leading block is
    a hit where an earlier request had the same chain of blocks up to it (at least one
    prompt token is always computed)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in trace.requests:
        chains = [tuple(r.prefix_blocks[: i + 1]) for i in range(len(r.prefix_blocks))]
        cached = 0
        for chain in chains:
            if chain not in seen:
                break
            cached += 1
        hit += min(cached * r.prefix_block_size, r.prompt_len - 1)
        total += r.prompt_len
        seen.update(chains)
    return hit / total if total else 0.0


def with_prefix_hit(trace: Trace, target: float, documents: int = 1, size: int = 64) -> Trace:
    """The trace's sizes and arrivals with its prefix blocks rewritten so that its
    `ideal_hit_rate` is `target` (within a percent): request i shares the leading
    f * prompt_len tokens (whole blocks of `size`) of document i mod `documents`, the
    rest of its prompt its own; f is found by bisection. Blocks of 64 tokens, not
    Mooncake's 512: a prompt's partial last block is never shared, and 512-token blocks
    would lose ~8% of a 3k prompt to it (90% out of reach)."""
    if not 0 < target < 1:
        raise ValueError(f"prefix hit rate {target}: must be in (0, 1)")

    def shared(f: float) -> Trace:
        reqs = [
            replace(
                r,
                prefix_blocks=tuple(
                    (1 + i % documents) * 1_000_000 + j
                    for j in range(int(f * r.prompt_len) // size)
                ),
                prefix_block_size=size,
            )
            for i, r in enumerate(trace.requests)
        ]
        return Trace(trace.name, trace.source, reqs)

    lo, hi = 0.0, 1.0
    if ideal_hit_rate(shared(hi)) < target:
        raise ValueError(
            f"{trace.name}: a prefix hit rate of {target:.0%} is out of reach (at most "
            f"{ideal_hit_rate(shared(hi)):.0%} with {documents} shared documents)"
        )
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ideal_hit_rate(shared(mid)) < target else (lo, mid)
    return shared(hi)


AZURE_CODE = TraceSlice("azure-code", "azure_code_small.json", 200, start_s=180.0)
CONVERSATION = TraceSlice("conversation", "mooncake_conversation_small.jsonl", 40)
LONG_PROMPTS = TraceSlice(
    "long-prompts", "mooncake_conversation_small.jsonl", 16, min_prompt=16384, max_prompt=65536
)


def _opts(**kw: Any) -> Mapping[str, Any]:
    return MappingProxyType(kw)


# The held-out recipes, in the order the suite runs them (an executor's workloads
# together: see fidelity.plan).
HELD_OUT: tuple[Workload, ...] = (
    Workload("offline", "azure-code, every request at t = 0 (the capacity)", AZURE_CODE),
    Workload("own-arrivals", "azure-code at its own arrival times", AZURE_CODE, "own"),
    Workload("own-arrivals-x2", "azure-code at twice its own pace", AZURE_CODE, "own", speed=2.0),
    Workload(
        "saturated",
        "azure-code, its own gaps scaled to 100% of the capacity",
        AZURE_CODE,
        "own",
        of_capacity=1.0,
    ),
    Workload(
        "overload-2x",
        "azure-code, its own gaps scaled to 200% of the capacity",
        AZURE_CODE,
        "own",
        of_capacity=2.0,
    ),
    Workload(
        "async",
        "azure-code, Poisson at 70% of the capacity, async scheduling on",
        AZURE_CODE,
        "poisson",
        of_capacity=0.7,
        overrides=_opts(async_scheduling=True),
    ),
    Workload(
        "sync",
        "azure-code, Poisson at 70% of the capacity, async scheduling off",
        AZURE_CODE,
        "poisson",
        of_capacity=0.7,
        overrides=_opts(async_scheduling=False),
    ),
    Workload(
        "conversation",
        "conversation at its own arrival times, its own prefix blocks",
        CONVERSATION,
        "own",
    ),
    *(
        Workload(
            f"prefix-reuse-{round(100 * hit)}",
            f"conversation at twice its pace, prefix blocks for a {hit:.0%} hit rate",
            CONVERSATION,
            "own",
            speed=2.0,
            prefix_hit=hit,
        )
        for hit in (0.5, 0.7, 0.9)
    ),
    Workload(
        "small-kv",
        "conversation, every request at t = 0, KV cache for 15% of their demand (preempts)",
        CONVERSATION,
        kv_fraction=0.15,
    ),
    Workload(
        "spec-k3",
        "conversation at twice its pace, 3 MTP drafts a step, 80% accepted a position",
        CONVERSATION,
        "own",
        speed=2.0,
        overrides=_opts(num_speculative_tokens=3),
        acceptance=0.8,
    ),
    Workload(
        "spec-varlen",
        "spec-k3 with confidence-scheduled drafts (at most 3)",
        CONVERSATION,
        "own",
        speed=2.0,
        overrides=_opts(num_speculative_tokens=3, enable_mtp_varlen=True),
        acceptance=0.8,
    ),
    Workload("long-context", "long-prompts, every request at t = 0", LONG_PROMPTS),
)


def by_name(workloads: Sequence[Workload]) -> dict[str, Workload]:
    return {w.name: w for w in workloads}


def parse_workloads(text: str) -> list[Workload]:
    """Recipes by comma-separated name, or a suite's name ("held-out"); an unknown name
    is an error listing the known ones."""
    known = by_name(HELD_OUT)
    out: list[Workload] = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name in SUITES:
            out += [w for w in HELD_OUT if w not in out]
        elif name in known:
            if known[name] not in out:
                out.append(known[name])
        else:
            raise ValueError(
                f"unknown workload {name!r}; known: {', '.join(known)}, or the suite "
                f"{', '.join(SUITES)}"
            )
    if not out:
        raise ValueError("no workload named")
    return out

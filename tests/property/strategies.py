"""Generators of engine configurations and workloads for the property suite.

An `EngineCase` is an `EngineConfig` plus the SimExecutor's draft acceptance
rate. A `Workload` is a tuple of `ReqSpec`: arrival and abort are step numbers
of the driver loop (one engine step each), so Poisson-like gaps, bursts and
"all at once" are all just step patterns. Prompts are built from a small pool
of shared token chunks so that prefix-cache hits, sharing and evictions happen.
Sizes are kept so that one example runs in tens of milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st

from deepinfer.config import EngineConfig, EngineRole

MAX_TOKENS = 4096  # capacity (num_blocks * block_size) stays below this


def either(draw: st.DrawFn, *options: st.SearchStrategy) -> object:
    """Draw from one of `options`, chosen by index (shrinks toward the first).

    Unlike st.one_of, options that happen to be equal strategies stay distinct
    choices, so the draw structure never depends on the values drawn before.
    """
    return draw(options[draw(st.integers(0, len(options) - 1))])


def scaled(weight: float) -> settings:
    """The loaded profile's example count times `weight` (cheap tests run more)."""
    return settings(max_examples=max(5, int(settings.default.max_examples * weight)))


@dataclass(frozen=True)
class EngineCase:
    config: EngineConfig
    acceptance_rate: float

    @property
    def capacity(self) -> int:
        return self.config.block_size * self.config.num_gpu_blocks  # type: ignore[operator]


@dataclass(frozen=True)
class ReqSpec:
    req_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    abort_step: int | None = None  # driver step at which the client aborts it

    def __repr__(self) -> str:  # prompts are long: show their shape, not every token
        head = ",".join(map(str, self.prompt[:3]))
        return (
            f"ReqSpec({self.req_id!r}, arrive={self.arrival_step}, prompt=[{head}..]"
            f"x{len(self.prompt)}, max_tokens={self.max_tokens}, prio={self.priority}, "
            f"abort={self.abort_step})"
        )


Workload = tuple[ReqSpec, ...]


@st.composite
def engine_cases(
    draw: st.DrawFn,
    *,
    roles: tuple[EngineRole, ...] = tuple(EngineRole),
    allow_async: bool = True,
    allow_spec: bool = True,
    max_capacity: int = MAX_TOKENS,
    caching: bool | None = None,
) -> EngineCase:
    """`max_capacity` small (~100 tokens) makes contention, preemption and eviction common."""
    block_size: int = either(
        draw, st.integers(1, 8), st.sampled_from([16, 32, 64, 128]), st.integers(1, 128)
    )  # type: ignore[assignment]
    most = max(1, max_capacity // block_size)
    # Mostly small caches (contention, preemption, eviction), sometimes thousands of blocks.
    num_blocks: int = either(
        draw,
        st.integers(1, max(1, min(most, 96 // block_size))),
        st.integers(1, min(24, most)),
        st.integers(1, min(2048, most)),
    )  # type: ignore[assignment]
    capacity = block_size * num_blocks
    k = draw(st.integers(0, 4)) if allow_spec else 0
    # At least ~1/40 of the cache per step keeps a full-cache prompt at <= 40 chunks.
    low = max(k + 1, -(-capacity // 40))
    budget = draw(st.integers(low, low + capacity + 8))
    chunked = draw(st.booleans())
    max_model_len = draw(st.none() | st.integers(max(2, capacity // 2), capacity + 4))
    if not chunked and max_model_len is not None:
        max_model_len = min(max_model_len, budget)
    config = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 12)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        prefill_watermark=draw(st.sampled_from([0.5, 0.9, 1.0]) | st.floats(0.5, 1.0)),
        enable_prefix_caching=draw(st.booleans()) if caching is None else caching,
        role=draw(st.sampled_from(roles)),
        num_speculative_tokens=k,
        enable_mtp_varlen=draw(st.booleans()) if k else False,
        async_scheduling=draw(st.booleans()) if allow_async else False,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        seed=draw(st.integers(0, 3)),
    )
    rate = draw(st.sampled_from([0.0, 0.5, 0.7, 1.0])) if k else 0.7
    return EngineCase(config, rate)


def _chunk_tokens(chunk: int, length: int) -> list[int]:
    """Content of shared chunk `chunk`: distinct from every other chunk's."""
    return [chunk * 10_007 + j + 1 for j in range(length)]


@st.composite
def prompts(
    draw: st.DrawFn, capacity: int, block_size: int, chunk_len: int, unique: int
) -> tuple[int, ...]:
    share = st.sampled_from([0.1, 0.25, 0.4, 0.6, 0.85])
    length: int = either(
        draw,
        st.integers(1, min(capacity + 1, 3 * block_size + 2)),
        st.integers(1, max(1, capacity // block_size)).map(lambda m: m * block_size),
        st.tuples(share, st.integers(-2, 2)).map(lambda t: max(1, int(capacity * t[0]) + t[1])),
        st.integers(1, capacity + 1),
        st.sampled_from([max(1, capacity - 1), capacity]),  # exactly fits / just too long
    )  # type: ignore[assignment]
    chunks = draw(st.lists(st.integers(0, 3), min_size=0, max_size=6))
    tokens: list[int] = []
    for c in chunks:
        tokens += _chunk_tokens(c, chunk_len)
    if len(tokens) < length:  # a private tail: unique to this request
        tokens += [900_000 + unique * 5_003 + j for j in range(length - len(tokens))]
    return tuple(tokens[:length])


@st.composite
def arrivals(draw: st.DrawFn, n: int) -> list[int]:
    mode = draw(st.sampled_from(["once", "poisson", "bursts"]))
    if mode == "once":
        return [0] * n
    if mode == "poisson":  # small geometric-like gaps between consecutive arrivals
        gaps = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
        out, t = [], 0
        for g in gaps:
            t += g
            out.append(t)
        return out
    starts = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    picks = draw(st.lists(st.integers(0, len(starts) - 1), min_size=n, max_size=n))
    return sorted(starts[p] for p in picks)


@st.composite
def workloads(
    draw: st.DrawFn, case: EngineCase, *, max_requests: int = 10, aborts: bool = True
) -> Workload:
    bs = case.config.block_size
    n: int = either(draw, st.integers(1, max_requests), st.just(max_requests))  # type: ignore
    chunk_len = draw(st.sampled_from([bs, 2 * bs, max(1, bs // 2), bs + 1, 3]))
    times = draw(arrivals(n))
    specs = []
    for i, t in enumerate(times):
        abort_after = draw(st.none() | st.integers(0, 30)) if aborts else None
        if i and draw(st.booleans()):  # repeat (a prefix of) an earlier prompt: whole hits
            src = specs[draw(st.integers(0, i - 1))].prompt
            cut: int = either(
                draw,
                st.just(len(src)),
                st.integers(1, len(src)),
                st.integers(1, max(1, len(src) // bs)).map(lambda m: m * bs),
            )
            prompt = src[: max(1, cut)]
        else:
            prompt = draw(prompts(case.capacity, bs, chunk_len, i))
        specs.append(
            ReqSpec(
                req_id=f"r{i}",
                arrival_step=t,
                prompt=prompt,
                max_tokens=either(
                    draw,
                    st.integers(1, 24),  # type: ignore[arg-type]
                    st.integers(1, min(64, case.capacity)),
                ),
                priority=draw(st.integers(0, 3)),
                abort_step=None if abort_after is None else t + abort_after,
            )
        )
    return tuple(specs)


@st.composite
def any_case_and_workload(draw: st.DrawFn, **case_kwargs: object) -> tuple[EngineCase, Workload]:
    """Half general engines, half small caches where preemption and eviction are common."""
    return either(
        draw,
        cases_and_workloads(**case_kwargs),  # type: ignore[return-value]
        cases_and_workloads(max_capacity=64, **case_kwargs),
    )


@st.composite
def cases_and_workloads(
    draw: st.DrawFn, *, aborts: bool = True, max_requests: int = 10, **case_kwargs: object
) -> tuple[EngineCase, Workload]:
    case = draw(engine_cases(**case_kwargs))  # type: ignore[arg-type]
    return case, draw(workloads(case, aborts=aborts, max_requests=max_requests))

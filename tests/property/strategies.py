"""Generators of engine configurations and workloads for the property suite.

An `EngineCase` is an `EngineConfig` plus the SimExecutor's draft acceptance
rate. A `Workload` is a tuple of `ReqSpec`: arrival and abort are step numbers
of the driver loop (one engine step each), so Poisson-like gaps, bursts and
"all at once" are all just step patterns. Prompts are built from a small pool
of shared token chunks so that prefix-cache hits, sharing and evictions happen.
Each request also draws its stop conditions: stop token ids and an EOS id placed at
output positions where SimExecutor's token rule (`sim_token`) will emit them, before,
at or after `min_tokens` and `max_tokens`, with `ignore_eos` on or off, and stop
strings cut from its own simulated text (sim_text.py) across token boundaries, which a
driver that detokenizes (the `Driver`, as `LLM` does) ends it on.
Sizes are kept so that one example runs in tens of milliseconds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

from hypothesis import settings
from hypothesis import strategies as st

from deepinfer.config import EngineConfig, EngineRole
from tests.property.sim_text import sim_text

MAX_TOKENS = 4096  # capacity (num_blocks * block_size) stays below this
SIM_VOCAB = 1 << 20  # SimExecutor's placeholder vocabulary (its tokens are 1 .. SIM_VOCAB - 1)


def sim_token(req_id: str, pos: int) -> int:
    """The token SimExecutor samples for position `pos` of `req_id` (its documented rule,
    restated here as the tests' independent account). The multiplier is prime to
    SIM_VOCAB - 1, so a request never sees one token at two positions of a run."""
    return 1 + ((zlib.crc32(req_id.encode()) + pos * 2654435761) % (SIM_VOCAB - 1))


def either(draw: st.DrawFn, *options: st.SearchStrategy) -> object:
    """Draw from one of `options`, chosen by index (shrinks toward the first).

    Unlike st.one_of, options that happen to be equal strategies stay distinct
    choices, so the draw structure never depends on the values drawn before.
    """
    return draw(options[draw(st.integers(0, len(options) - 1))])


def scaled(weight: float, floor: int = 5) -> settings:
    """The loaded profile's example count times `weight` (cheap tests run more), never
    fewer than `floor`: a cheap model test keeps its ci count under the mutation profile,
    whose few examples would leave its rare interleavings unreached."""
    return settings(max_examples=max(floor, int(settings.default.max_examples * weight)))


def at_least(examples: int) -> settings:
    """The loaded profile's example count, never fewer than `examples`: for a test of one
    object cheap enough to run its ci count under every profile, since the mutation
    profile's few examples would leave its rare cases (a stop string at min_tokens, a
    window over a skipped token) unreached."""
    return settings(max_examples=max(examples, settings.default.max_examples))


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
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = True
    stop: tuple[str, ...] = ()  # stop strings (over sim_text.sim_text of its tokens)

    def __repr__(self) -> str:  # prompts are long: show their shape, not every token
        head = ",".join(map(str, self.prompt[:3]))
        n = len(self.prompt)
        at = [self._at(t) for t in self.stop_token_ids]
        return (
            f"ReqSpec({self.req_id!r}, arrive={self.arrival_step}, prompt=[{head}..]"
            f"x{n}, max_tokens={self.max_tokens}, prio={self.priority}, "
            f"abort={self.abort_step}, min_tokens={self.min_tokens}, stop ids at outputs #{at}, "
            f"eos at #{self._at(self.eos_token_id)}, ignore_eos={self.ignore_eos}, "
            f"stop={self.stop})"
        )

    def _at(self, token: int | None) -> int | str | None:
        """Which output (counting from 1) SimExecutor makes `token` (within 4096), if any."""
        if token is None:
            return None
        n = len(self.prompt)
        return next(
            (i for i in range(1, 4097) if sim_token(self.req_id, n + i - 1) == token), "never"
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
    chunked: bool | None = None,
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
    # Sometimes a budget that binds: a few decodes or one chunk fill it.
    budget: int = either(draw, st.integers(low, low + capacity + 8), st.integers(low, low + 3))  # type: ignore[assignment]
    chunked = draw(st.booleans()) if chunked is None else chunked
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


_SHARES = st.sampled_from([0.1, 0.25, 0.4, 0.6, 0.85])
_CHUNKS = st.lists(st.integers(0, 3), min_size=0, max_size=6)


def _prompt(
    draw: st.DrawFn, capacity: int, block_size: int, chunk_len: int, unique: int
) -> tuple[int, ...]:
    """Shared chunks then a private tail; its length small, whole blocks, a share of the
    cache, anything up to one past it, or exactly fitting / just too long."""
    kind = draw(st.integers(0, 4))  # only the chosen length strategy is built (cheaper)
    if kind == 0:
        length = draw(st.integers(1, min(capacity + 1, 3 * block_size + 2)))
    elif kind == 1:
        length = draw(st.integers(1, max(1, capacity // block_size))) * block_size
    elif kind == 2:
        length = max(1, int(capacity * draw(_SHARES)) + draw(st.integers(-2, 2)))
    elif kind == 3:
        length = draw(st.integers(1, capacity + 1))
    else:
        length = draw(st.sampled_from([max(1, capacity - 1), capacity]))
    tokens: list[int] = []
    for c in draw(_CHUNKS):
        tokens += _chunk_tokens(c, chunk_len)
    if len(tokens) < length:  # a private tail: unique to this request
        tokens += [900_000 + unique * 5_003 + j for j in range(length - len(tokens))]
    return tuple(tokens[:length])


def _arrivals(draw: st.DrawFn, n: int) -> list[int]:
    """Arrival steps of n requests: all at once, small gaps, or a few bursts."""
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


def _workload(draw: st.DrawFn, case: EngineCase, max_requests: int, aborts: bool) -> Workload:
    """Up to max_requests requests (plain draws: building strategies per example is slow)."""
    bs = case.config.block_size
    n: int = either(draw, st.integers(1, max_requests), st.just(max_requests))  # type: ignore
    chunk_len = draw(st.sampled_from([bs, 2 * bs, max(1, bs // 2), bs + 1, 3]))
    times = _arrivals(draw, n)
    specs: list[ReqSpec] = []
    for i, t in enumerate(times):
        abort_after = draw(st.none() | st.integers(0, 30)) if aborts else None
        spec = _spec(draw, case, i, t, chunk_len, [s.prompt for s in specs])
        if abort_after is not None:
            spec = replace(spec, abort_step=t + abort_after)
        specs.append(spec)
    return tuple(specs)


def _spec(
    draw: st.DrawFn,
    case: EngineCase,
    i: int,
    arrival: int,
    chunk_len: int,
    earlier: list[tuple[int, ...]],
) -> ReqSpec:
    """Request `r{i}`: a fresh prompt or (a prefix of) an earlier one (whole prefix-cache
    hits), its max_tokens, priority and stop conditions; never aborted."""
    bs = case.config.block_size
    if earlier and draw(st.booleans()):  # repeat (a prefix of) an earlier prompt
        src = earlier[draw(st.integers(0, len(earlier) - 1))]
        kind = draw(st.integers(0, 2))
        if kind == 0:
            cut = len(src)
        elif kind == 1:
            cut = draw(st.integers(1, len(src)))
        else:
            cut = draw(st.integers(1, max(1, len(src) // bs))) * bs
        prompt = src[: max(1, cut)]
    else:
        prompt = _prompt(draw, case.capacity, bs, chunk_len, i)
    longer = draw(st.booleans())
    max_tokens = draw(st.integers(1, min(64, case.capacity) if longer else 24))
    return ReqSpec(
        f"r{i}",
        arrival,
        prompt,
        max_tokens,
        priority=draw(st.integers(0, 3)),
        **stop_fields(draw, f"r{i}", len(prompt), max_tokens),
    )


@st.composite
def request_specs(
    draw: st.DrawFn,
    case: EngineCase,
    i: int,
    arrival: int,
    chunk_len: int,
    earlier: list[tuple[int, ...]],
) -> ReqSpec:
    """One request as `workloads` draws it (for the state machine's arrivals)."""
    return _spec(draw, case, i, arrival, chunk_len, earlier)


def stop_fields(draw: st.DrawFn, req_id: str, n: int, max_tokens: int) -> dict:
    """ReqSpec's stop fields: none at all (ignore_eos, the lengths decide) half the time;
    else stop token ids and EOS that SimExecutor emits at chosen output indices (some
    past max_tokens, some before min_tokens), or ids it never emits (0 and None)."""
    if not draw(st.booleans()):
        return {}
    at = st.integers(0, max_tokens + 1)
    stops = [sim_token(req_id, n + i) for i in draw(st.lists(at, max_size=3))]
    kind = draw(st.integers(0, 2))
    eos = None if kind == 0 else 0 if kind == 1 else sim_token(req_id, n + draw(at))
    return dict(
        min_tokens=draw(st.integers(0, max_tokens)),
        stop_token_ids=tuple(stops + ([0] if draw(st.booleans()) else [])),
        eos_token_id=eos,
        ignore_eos=draw(st.booleans()),
        stop=_stop_strings(draw, req_id, n, max_tokens),
    )


def _stop_strings(draw: st.DrawFn, req_id: str, n: int, max_tokens: int) -> tuple[str, ...]:
    """None half the time; else one or two pieces of the request's own text (see
    sim_text), taken across the boundary after a chosen output token, or text it never
    makes."""
    if not draw(st.booleans()):
        return ()
    texts = [sim_text(sim_token(req_id, n + i)) for i in range(max_tokens + 1)]
    ends = [len("".join(texts[: i + 1])) for i in range(len(texts))]
    whole = "".join(texts)
    out = []
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.integers(0, 3)):
            b = ends[draw(st.integers(0, len(ends) - 1))]
            lo, hi = max(0, b - draw(st.integers(1, 3))), b + draw(st.integers(0, 2))
            out.append(whole[lo:hi] or "z")
        else:
            out.append("z")  # never made: no word has it
    return tuple(out)


def any_case_and_workload(**case_kwargs: object) -> st.SearchStrategy[tuple[EngineCase, Workload]]:
    """Half general engines, half small caches where preemption and eviction are common."""
    options = (
        cases_and_workloads(**case_kwargs),
        cases_and_workloads(max_capacity=64, **case_kwargs),  # type: ignore[arg-type]
    )

    @st.composite
    def pick(draw: st.DrawFn) -> tuple[EngineCase, Workload]:
        return either(draw, *options)  # type: ignore[return-value]

    return pick()


def cases_and_workloads(
    *, aborts: bool = True, max_requests: int = 10, **case_kwargs: object
) -> st.SearchStrategy[tuple[EngineCase, Workload]]:
    """An engine case and a workload for it."""
    cases = engine_cases(**case_kwargs)  # type: ignore[arg-type]

    @st.composite
    def both(draw: st.DrawFn) -> tuple[EngineCase, Workload]:
        case = draw(cases)
        return case, _workload(draw, case, max_requests, aborts)

    return both()
